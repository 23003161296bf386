"""The distillation analysis of a sweep whose study has `analysis: {kind: distill}` (docs/ablate.md "The distillation
study"): each variant (a distillation estimator) against the teacher, over seeds.

Per finished run (`run_numbers`), from its summary.json and metrics.jsonl:

    initial, final   eval_accuracy_initial / eval_accuracy_final (summary.json)
    teacher          teacher_accuracy (summary.json; else the step-0 row's eval/teacher_accuracy)
    gap closed       (final - initial) / (teacher - initial); None when teacher <= initial (no gap to close)
    steps to target  the first evaluated step > 0 whose eval accuracy is >= teacher_fraction x teacher
                     (stability.steps_to_target with initial 0 and gain teacher_fraction x teacher); None: not reached
    wall to target   sum over the steps 1..steps-to-target of time/rollout + time/update (metrics.jsonl): the training
                     time of those steps; evaluations, logging, checkpoints and start-up are not in it (the rows carry
                     no cumulative clock). None when a step of them has no timing
    entropy, tail mass, distill KL, grad norm
                     distill/entropy, distill/tail_mass, distill/kl and grad/norm averaged over the last tail_fraction
                     of the run's logged steps (the last ceil(tail_fraction x m) of its m logged values)

Per variant (`analyze`): every number's mean over seeds with its 95% Student-t interval, min and max; the count of runs
that did not reach the target; the mean curves over seeds; paired differences variant - baseline (final accuracy on the
shared finished seeds; steps and wall time to target on the seeds where both reached it). Only finished runs count;
failed, running and pending ones are listed. Written as `distill.md` and `distill.json`; the figures are
`plots.plot_distill`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from emapg_cli.ablate.aggregate import CONFIDENCE, RunRecord, write_report_files
from emapg_cli.ablate.plots import mean_band
from emapg_cli.ablate.stability import steps_to_target
from emapg_cli.ablate.study import Sweep
from emapg_cli.stats import fixed, interval, mean_range, paired_differences, sig3, with_ci

DISTILL_MD = "distill.md"
DISTILL_JSON = "distill.json"
#: The student's per-step metrics averaged over the last tail_fraction of the run: (report key, metrics.jsonl key).
TAIL_METRICS = (("entropy", "distill/entropy"), ("tail_mass", "distill/tail_mass"), ("kl", "distill/kl"), ("grad_norm", "grad/norm"))
#: The mean curves over seeds kept in distill.json and drawn (report key -> metrics.jsonl key).
CURVE_METRICS = {"accuracy": "eval/accuracy", "entropy": "distill/entropy", "tail_mass": "distill/tail_mass",
                 "kl": "distill/kl", "grad_norm": "grad/norm"}
#: The numbers summarised per variant over seeds.
NUMBERS = ("final", "initial", "teacher", "gap_closed", "steps_to_target", "wall_to_target_s", "wall_time_s",
           "entropy", "tail_mass", "kl", "grad_norm")


def last_fraction_mean(series: list[tuple[int, float]], fraction: float) -> Optional[float]:
    """The mean of the last ceil(fraction x m) of the m values of `series` [(step, value)] in step order; None without
    values. 150 logged steps at 0.2: the last 30."""
    if not series:
        return None
    values = [v for _, v in sorted(series)]
    k = max(1, math.ceil(fraction * len(values) - 1e-9))  # <= len(values): fraction <= 1
    return sum(values[-k:]) / k


def wall_to_step(curves: dict[str, list[tuple[int, float]]], step: int) -> Optional[float]:
    """Seconds of training up to and including RL step `step`: sum over s = 1..step of time/rollout + time/update; None
    when one of those steps has neither (a row without timings)."""
    rollout = dict(curves.get("time/rollout", []))
    update = dict(curves.get("time/update", []))
    total = 0.0
    for s in range(1, step + 1):
        if s not in rollout and s not in update:
            return None
        total += rollout.get(s, 0.0) + update.get(s, 0.0)
    return total


def gap_closed(initial: Optional[float], final: Optional[float], teacher: Optional[float]) -> Optional[float]:
    """(final - initial) / (teacher - initial): 1 = the student reached the teacher; None when a number is missing or
    the teacher is not above the student's start (no gap)."""
    if initial is None or final is None or teacher is None or teacher - initial <= 1e-12:
        return None
    return (final - initial) / (teacher - initial)


@dataclass
class DistillRun:
    """One run of the distillation analysis; `status`: done | failed | running | interrupted | pending."""

    run_id: str
    variant: str
    seed: int
    status: str
    initial: Optional[float] = None
    final: Optional[float] = None
    teacher: Optional[float] = None
    gap_closed: Optional[float] = None
    target: Optional[float] = None  # teacher_fraction x teacher
    steps_to_target: Optional[int] = None
    wall_to_target_s: Optional[float] = None
    steps: Optional[int] = None
    wall_time_s: Optional[float] = None
    entropy: Optional[float] = None
    tail_mass: Optional[float] = None
    kl: Optional[float] = None
    grad_norm: Optional[float] = None
    reason: str = ""


def run_numbers(rec: RunRecord, variant: str, teacher_fraction: float, tail_fraction: float) -> DistillRun:
    """The DistillRun of one aggregated run."""
    run = DistillRun(rec.spec.run_id, variant, rec.spec.seed, rec.status,
                     reason=rec.error.strip().splitlines()[-1] if rec.error.strip() else "")
    if rec.status != "done":
        return run
    curves = rec.curves
    teacher = rec.metrics.get("teacher_accuracy")
    if teacher is None:
        teacher = next((v for s, v in curves.get("eval/teacher_accuracy", []) if s == 0), None)
    run.initial, run.final, run.teacher = rec.metrics.get("eval_accuracy_initial"), rec.metrics.get("eval_accuracy_final"), teacher
    run.gap_closed = gap_closed(run.initial, run.final, teacher)
    run.steps, run.wall_time_s = rec.metrics.get("steps"), rec.metrics.get("wall_time_s")
    if teacher is not None:
        run.target = teacher_fraction * teacher
        run.steps_to_target = steps_to_target(curves.get("eval/accuracy", []), 0.0, run.target)
        if run.steps_to_target is not None:
            run.wall_to_target_s = wall_to_step(curves, run.steps_to_target)
    for key, metric in TAIL_METRICS:
        setattr(run, key, last_fraction_mean([(s, v) for s, v in curves.get(metric, []) if s > 0], tail_fraction))
    return run


@dataclass
class Report:
    """Everything distill.md and distill.json say (JSON: `asdict`)."""

    study: str
    baseline: str
    analysis: dict[str, Any]
    confidence: float
    variants: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    differences: list[dict[str, Any]] = field(default_factory=list)
    curves: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)  # variant -> metric -> steps/mean/std
    runs: list[dict[str, Any]] = field(default_factory=list)

    def row(self, variant: str) -> dict[str, Any]:
        return next(r for r in self.rows if r["variant"] == variant)

    def difference(self, variant: str) -> Optional[dict[str, Any]]:
        return next((d for d in self.differences if d["variant"] == variant), None)


def _paired(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    """variant - baseline on the shared seeds: the pairs, their mean and 95% t interval; `excludes_zero`."""
    diffs = paired_differences(a, b)
    iv = interval(list(diffs.values()))
    return {**iv, "seeds": sorted(diffs), "excludes_zero": iv["n"] >= 2 and (iv["lo"] > 0 or iv["hi"] < 0)}


def analyze(sweep: Sweep, records: list[RunRecord], out: Optional[Path] = None) -> Report:
    """The distillation report of the sweep's runs (sweep.analysis.kind == distill; `out` is not read, as in
    stability.analyze)."""
    analysis = sweep.analysis
    assert analysis is not None and analysis.kind == "distill"
    variants = list(sweep.variants)
    runs = [run_numbers(rec, str(rec.spec.values.get("variant")), analysis.teacher_fraction, analysis.tail_fraction)
            for rec in records if rec.spec.values.get("variant") in variants]
    report = Report(sweep.name, analysis.baseline, analysis.settings(), CONFIDENCE, variants, runs=[asdict(r) for r in runs])
    for v in variants:
        mine = [r for r in runs if r.variant == v]
        done = [r for r in mine if r.status == "done"]
        judged = [r for r in done if r.target is not None]
        report.rows.append({
            "variant": v, "runs": len(done), "failed": sum(r.status == "failed" for r in mine),
            "unfinished": sum(r.status not in ("done", "failed") for r in mine),
            "reached": sum(r.steps_to_target is not None for r in judged),
            "not_reached": sum(r.steps_to_target is None for r in judged),
            **{k: interval([getattr(r, k) for r in done]) for k in NUMBERS},
        })
        recs = [rec for rec in records if rec.spec.values.get("variant") == v and rec.status == "done"]
        report.curves[v] = {}
        for key, metric in CURVE_METRICS.items():
            steps, mean, std = mean_band([rec.curves.get(metric, []) for rec in recs if rec.curves.get(metric)])
            if steps:
                report.curves[v][key] = {"steps": steps, "mean": mean, "std": std}
    by = {v: [r for r in runs if r.variant == v and r.status == "done"] for v in variants}

    def seeds(v: str, key: str) -> dict[int, float]:
        return {r.seed: getattr(r, key) for r in by[v] if getattr(r, key) is not None}

    for v in variants:
        if v == analysis.baseline:
            continue
        report.differences.append({"variant": v, **{k: _paired(seeds(v, k), seeds(analysis.baseline, k))
                                                    for k in ("final", "steps_to_target", "wall_to_target_s")}})
    return report


# --- writing ---------------------------------------------------------------------------------------


def _cells(r: dict[str, Any]) -> list[str]:
    """A variant's cells from the teacher's accuracy to the grad norm (distill.md's (a) and the console table)."""
    judged = r["reached"] + r["not_reached"]
    return [mean_range(r["teacher"]), mean_range(r["gap_closed"], 2), f"{r['reached']}/{judged}" if judged else "–",
            *(mean_range(r[k], fmt=sig3) for k in ("steps_to_target", "wall_to_target_s", "entropy", "tail_mass", "kl", "grad_norm"))]


def console_table(report: Report) -> tuple[str, list[str], list[list[str]]]:
    """The short table `emapg ablate` prints (title, headers, rows): per variant over seeds, Δ = variant − baseline."""
    pct = f"{report.analysis['teacher_fraction']:.0%}"
    rows = []
    for v in report.variants:
        r, d = report.row(v), report.difference(v)
        final = with_ci(r["final"])
        if d is not None and d["final"]["mean"] is not None:
            final += f" Δ{d['final']['mean']:+.3f}" + ("*" if d["final"]["excludes_zero"] else "")
        rows.append([v, str(r["runs"]), final, *_cells(r)[:7]])
    return (f"distill: per variant over seeds; Δ = variant − {report.baseline} (* 95% CI excludes 0)",
            ["variant", "seeds", "final accuracy", "teacher", "gap closed", f"reached {pct}", f"steps to {pct}",
             f"wall s to {pct}", "entropy", "tail mass"], rows)


def markdown(report: Report) -> str:
    """distill.md: (a) per variant, (b) paired differences against the baseline, the runs not counted."""
    a = report.analysis
    pct = f"{a['teacher_fraction']:.0%}"
    lines = [f"# Distillation: {report.study}", "",
             f"Variants (the study's estimators) against the teacher; baseline `{report.baseline}`. Finished runs only. "
             f"**Gap closed**: (final − initial) / (teacher − initial), the teacher's accuracy (`teacher_accuracy`) and the "
             f"student's on the same evaluation set. **Steps to {pct}**: the first evaluated step whose eval accuracy is "
             f">= {a['teacher_fraction']:g} x the run's teacher accuracy; **wall s**: the sum of the time/rollout + "
             "time/update of the steps up to it (training time; evaluations and start-up excluded). Entropy "
             "(`distill/entropy`), tail mass (`distill/tail_mass`, 1 − the student's mass on the top-k set), distill KL "
             f"(`distill/kl`) and grad norm (`grad/norm`): means over the last {a['tail_fraction']:.0%} of the run's logged "
             "steps, then over seeds.", "",
             "## (a) Per variant", "",
             f"Final accuracy: mean over seeds [{report.confidence:.0%} Student-t interval]. Other columns: mean (min–max) over "
             f"seeds. Reached: runs that reached {pct} of their teacher / runs (the steps and wall time are over those).", "",
             f"| variant | seeds | final accuracy | teacher | gap closed | reached {pct} | steps to {pct} | wall s to {pct} | "
             "entropy | tail mass | distill KL | grad norm | run wall s |",
             "|---|---:|---|---|---|---|---|---|---|---|---|---|---:|"]
    for v in report.variants:
        r = report.row(v)
        extra = "".join(f" (+{r[k]} {k})" for k in ("failed", "unfinished") if r[k])
        lines.append(f"| {v} | {r['runs']}{extra} | {with_ci(r['final'])} | " + " | ".join(_cells(r)) + f" | {fixed(r['wall_time_s']['mean'], 0)} |")
    lines += ["", f"## (b) Paired differences: variant − {report.baseline}", "",
              f"Seed by seed (the same seeds in every variant): final accuracy on the seeds both finished; steps and wall "
              f"time to {pct} on the seeds where both reached it. Mean [{report.confidence:.0%} Student-t interval] (pairs); "
              "`*`: the interval excludes 0.", "",
              f"| variant | final accuracy | steps to {pct} | wall s to {pct} |", "|---|---|---|---|"]
    for d in report.differences:
        cells = []
        for key, digits in (("final", 3), ("steps_to_target", 1), ("wall_to_target_s", 1)):
            x = d[key]
            cells.append("– (0)" if x["n"] == 0 else f"{with_ci(x, digits, signed=True)}{' *' if x['excludes_zero'] else ''} ({x['n']})")
        lines.append(f"| {d['variant']} | " + " | ".join(cells) + " |")
    other = [r for r in report.runs if r["status"] != "done"]
    if other:
        lines += ["", "## Runs not counted", ""]
        lines += [f"- `{r['run_id']}`: {r['status']}" + (f" — {r['reason']}" if r["reason"] else "") for r in other]
    return "\n".join(lines) + "\n"


def write(out: Path, report: Report) -> list[Path]:
    """Write distill.md and distill.json into the sweep folder; return their paths."""
    return write_report_files(out, DISTILL_MD, DISTILL_JSON, markdown(report), report)
