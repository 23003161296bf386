"""The stability analysis of a sweep whose study has an `analysis:` section (docs/ablate.md "The stability study").

Rows are the study's variants (methods: no anchor, fixed anchor, EMA, adaptive controllers), columns the values of its
one grid axis (the learning rate, x1 .. x8 of the preset's). Per run (`classify`):

    final     the final eval accuracy; a diverged run has none and counts as 0.0 (it left no usable policy)
    best      the highest eval accuracy of the run (initial, periodic and final evaluations)
    collapsed diverged, or final < best - collapse_points / 100 (more than X points below its own best)
    steps to target  the first evaluated step whose accuracy is >= initial + target_gain (None: never reached)

A run *diverged* when `emapg train` stopped it because training broke down: exit code 2 with the trainer's reason
(`<run>/status.json`, else the last `error:` line of its output) matching one of DIVERGED_PATTERNS (the optimizer step
made the weights non-finite; too many optimizer steps skipped for a non-finite loss or gradient). Any other failure
(a crash, a missing file, a killed process) stays "failed": it says nothing about the method, so it is left out.

Per cell (method x grid value) and across cells (`analyze`): mean final accuracy with its t interval, collapse rate,
median steps to target, mean KL and final policy-anchor distance; paired differences method - baseline on the shared
seeds with their t interval and the seeds a paired t-test would need for 80% power; tuning sensitivity with a
percentile bootstrap interval; the collapse boundary. Written as `stability.md` and `stability.json`; the figures are
`plots.plot_stability`.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from emapg_cli.ablate.aggregate import CONFIDENCE, RunRecord, anchor_numbers, runs_section, write_report_files
from emapg_cli.ablate.grid import format_value
from emapg_cli.ablate.study import StudyAnalysis, Sweep
from emapg_cli.stats import (bootstrap_within_best, finite, fixed, interval, mean_ci, median, paired_compare,
                             paired_differences, seeds_for_power, sig3)

STABILITY_MD = "stability.md"
STABILITY_JSON = "stability.json"
#: The tuning-sensitivity bootstrap: resamples and the seed of its generator (fixed, so the file is reproducible).
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
#: The power analysis of each paired comparison: two-sided level and the power aimed at.
POWER, ALPHA = 0.8, 0.05
#: `emapg train` exits with this code on a user-facing error, which includes the two breakdowns below.
DIVERGED_EXIT = 2
#: The trainer's one-line reasons for stopping a run that broke down (train/trainer.py `_update` around
#: NonFiniteWeights; train/bookkeeping.py `check_skips`). Matched at the start of the reason.
DIVERGED_PATTERNS = (
    re.compile(r"step \d+: the optimizer step made the policy's weights non-finite"),
    re.compile(r"step \d+: \d+ of the last \d+ optimizer steps \(\d+ RL steps\) were skipped for a non-finite loss or gradient"),
)
#: Slack for comparing accuracies (multiples of 1/eval items) with thresholds written in points.
_EPS = 1e-9


def divergence(status: str, returncode: Optional[int], reason: str, error: str = "") -> Optional[str]:
    """The trainer's reason when a failed run diverged, else None.

    `reason`: the run's own status.json reason; `error`: the run's output tail, whose last `error: ...` line is used
    when there is no reason. `returncode` None (a run launched elsewhere, known only from its folder) is accepted;
    any code but 2 is a crash, not a divergence."""
    if status != "failed" or returncode not in (None, DIVERGED_EXIT):
        return None
    text = reason.strip()
    if not text:
        lines = [ln.strip() for ln in error.splitlines() if ln.strip().startswith("error:")]
        text = lines[-1][len("error:"):].strip() if lines else ""
    return text if any(p.match(text) for p in DIVERGED_PATTERNS) else None


def steps_to_target(evals: list[tuple[int, float]], initial: Optional[float], gain: float) -> Optional[int]:
    """The first evaluated step > 0 whose accuracy is >= initial + gain; None when no evaluation reached it (or the
    initial accuracy is unknown)."""
    if initial is None:
        return None
    for step, acc in sorted(evals):
        if step > 0 and acc >= initial + gain - _EPS:
            return step
    return None


@dataclass
class Outcome:
    """One run of the stability analysis (`classify`); `status`: done | diverged | failed | running | interrupted | pending."""

    run_id: str
    method: str
    column: str
    seed: int
    status: str
    initial: Optional[float] = None
    final: Optional[float] = None
    best: Optional[float] = None
    collapsed: Optional[bool] = None
    steps_to_target: Optional[int] = None
    kl_mean: Optional[float] = None
    ema_distance_final: Optional[float] = None
    reason: str = ""

    @property
    def counted(self) -> bool:
        """Whether the run enters the statistics: finished, or diverged (as a collapse at accuracy 0)."""
        return self.status in ("done", "diverged")


def classify(evals: list[tuple[int, float]], initial: Optional[float], final: Optional[float], diverged: bool,
             analysis: StudyAnalysis) -> tuple[Optional[float], Optional[float], Optional[bool], Optional[int]]:
    """(final, best, collapsed, steps to target) of one run from its eval-accuracy curve `evals` [(step, acc)].

    A diverged run's final accuracy is 0.0 and it is collapsed; best = max over its evaluations (and 0.0). A finished
    run collapses when best - final > collapse_points / 100; without a final accuracy nothing is judged (None)."""
    accs = [a for _, a in evals] + [a for a in (initial, final) if a is not None]
    if diverged:
        final = 0.0
        accs.append(0.0)
    best = max(accs) if accs else None
    if final is None or best is None:
        collapsed = None
    else:
        collapsed = diverged or best - final > analysis.collapse_points / 100 + _EPS
    return final, best, collapsed, steps_to_target(evals, initial, analysis.target_gain)


def outcome(rec: RunRecord, method: str, column: str, analysis: StudyAnalysis) -> Outcome:
    """The Outcome of one aggregated run."""
    evals = rec.curves.get("eval/accuracy", [])
    why = divergence(rec.status, rec.returncode, rec.reason, rec.error)
    if rec.status == "done":
        initial, final = rec.metrics.get("eval_accuracy_initial"), rec.metrics.get("eval_accuracy_final")
    elif why is not None:
        initial = next((a for s, a in evals if s == 0), None)  # the step-0 evaluation of metrics.jsonl
        final = None
    else:
        return Outcome(rec.spec.run_id, method, column, rec.spec.seed, rec.status, reason=rec.error.strip().splitlines()[-1] if rec.error.strip() else "")
    final, best, collapsed, stt = classify(evals, initial, final, why is not None, analysis)
    return Outcome(rec.spec.run_id, method, column, rec.spec.seed, "diverged" if why is not None else "done", initial, final, best,
                   collapsed, stt, **anchor_numbers(rec.curves), reason=why or "")


@dataclass
class Report:
    """Everything stability.md and stability.json say (JSON: `asdict`)."""

    study: str
    axis: str
    baseline: str
    analysis: dict[str, Any]
    confidence: float
    methods: list[str]
    columns: list[dict[str, Any]]  # {"label": "x2", "values": [typed values of the axis in that column]}
    cells: list[dict[str, Any]] = field(default_factory=list)
    differences: list[dict[str, Any]] = field(default_factory=list)
    sensitivity: list[dict[str, Any]] = field(default_factory=list)
    boundary: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    bootstrap: dict[str, Any] = field(default_factory=dict)
    power: dict[str, Any] = field(default_factory=dict)

    def cell(self, method: str, column: str) -> dict[str, Any]:
        return next(c for c in self.cells if c["method"] == method and c["column"] == column)

    def difference(self, method: str, column: str) -> Optional[dict[str, Any]]:
        return next((d for d in self.differences if d["method"] == method and d["column"] == column), None)


def analyze(sweep: Sweep, records: list[RunRecord], out: Optional[Path] = None) -> Report:
    """The stability report of the sweep's runs (sweep.analysis must be set: a study with variants and one grid axis;
    `out`, the sweep folder, is not read: the signature of every analysis, ablate/__init__.py)."""
    analysis = sweep.analysis
    assert analysis is not None
    axis = next(iter(sweep.grid))
    methods = list(sweep.variants)
    labels = [format_value(v) for v in sweep.grid[axis]]
    outcomes = []
    typed: dict[str, list[Any]] = {label: [] for label in labels}
    for rec in records:
        label = rec.spec.grid.get(axis) or format_value(rec.spec.values.get(axis))
        method = str(rec.spec.values.get("variant"))
        if label not in typed or method not in methods:
            continue
        if rec.spec.values.get(axis) not in typed[label]:
            typed[label].append(rec.spec.values.get(axis))
        outcomes.append(outcome(rec, method, label, analysis))
    report = Report(sweep.name, axis, analysis.baseline, analysis.settings(), CONFIDENCE, methods,
                    [{"label": label, "values": typed[label]} for label in labels],
                    runs=[asdict(o) for o in outcomes],
                    bootstrap={"resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED, "unit": "seed"},
                    power={"power": POWER, "alpha": ALPHA, "two_sided": True,
                           "formula": "n = ceil(((z_{1-alpha/2} + z_{power}) / d_z)^2 + z_{1-alpha/2}^2 / 2)"})
    finals: dict[str, dict[str, dict[int, float]]] = {m: {label: {} for label in labels} for m in methods}
    for m in methods:
        for label in labels:
            runs = [o for o in outcomes if o.method == m and o.column == label]
            done = [o for o in runs if o.counted]
            finals[m][label] = {o.seed: o.final for o in done if o.final is not None}
            judged = [o for o in done if o.collapsed is not None]
            reached = [o.steps_to_target for o in done if o.steps_to_target is not None]
            k = sum(o.collapsed for o in judged)
            report.cells.append({
                "method": m, "column": label, "runs": len(done),
                "diverged": sum(o.status == "diverged" for o in runs),
                "failed": sum(o.status == "failed" for o in runs),
                "unfinished": sum(o.status not in ("done", "diverged", "failed") for o in runs),
                "final": interval([o.final for o in done], extremes=False), "best": interval([o.best for o in done], extremes=False),
                "collapsed": k, "collapse_rate": k / len(judged) if judged else None,
                "steps_to_target_median": median(reached) if reached else None, "reached_target": len(reached),
                "kl_mean": interval([o.kl_mean for o in done])["mean"],
                "ema_distance_final": interval([o.ema_distance_final for o in done])["mean"],
            })
    for m in methods:
        if m == analysis.baseline:
            continue
        for label in labels:
            diffs = paired_differences(finals[m][label], finals[analysis.baseline][label])
            iv = mean_ci(list(diffs.values()), CONFIDENCE)
            sd = iv.std if iv.n >= 2 else math.nan
            d_z = iv.mean / sd if math.isfinite(sd) and sd > 0 else math.nan
            report.differences.append({
                "method": m, "column": label, "n": iv.n, "seeds": sorted(diffs), "mean": finite(iv.mean), "sd": finite(sd),
                "lo": finite(iv.lo), "hi": finite(iv.hi), "excludes_zero": iv.n >= 2 and (iv.lo > 0 or iv.hi < 0),
                "d_z": finite(d_z), "seeds_for_power": seeds_for_power(d_z) if math.isfinite(d_z) else None,
                # the exact paired permutation test over the seeds (stats.paired_compare, as emapg eval --compare)
                "p": paired_compare(finals[m][label], finals[analysis.baseline][label]).p if diffs else None,
            })
    # a value where no method ends above the runs' mean initial accuracy works for none (stats.within_best_fraction)
    starts = [o.initial for o in outcomes if o.counted and o.initial is not None]
    floor = sum(starts) / len(starts) if starts else -math.inf
    report.analysis["sensitivity_floor"] = floor if starts else None
    sens = bootstrap_within_best(finals, analysis.within_points / 100, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, CONFIDENCE, floor)
    for m in methods:
        point, lo, hi = sens[m] if any(finals[m][label] for label in labels) else (None, None, None)  # no finished run: no verdict
        report.sensitivity.append({"method": m, "fraction": finite(point), "lo": finite(lo), "hi": finite(hi),
                                   "columns": sum(1 for label in labels if any(finals[x][label] for x in methods))})
        first = next((c for c in (report.cell(m, label) for label in labels)
                      if c["collapse_rate"] is not None and c["collapse_rate"] >= 0.5 - _EPS), None)
        judged = any(report.cell(m, label)["collapse_rate"] is not None for label in labels)
        report.boundary.append({"method": m, "column": first["column"] if first else None,
                                "values": typed[first["column"]] if first else None, "judged": judged})
    return report


# --- writing ---------------------------------------------------------------------------------------


def column_header(col: dict[str, Any]) -> str:
    """`x2 (0.0006)` for a relative value with one typed value, else the label."""
    vals = col["values"]
    return f"{col['label']} ({format_value(vals[0])})" if len(vals) == 1 and format_value(vals[0]) != col["label"] else col["label"]


def boundary_text(report: Report, b: dict[str, Any]) -> str:
    if b["column"] is not None:
        return column_header(next(c for c in report.columns if c["label"] == b["column"]))
    return f"none up to {report.columns[-1]['label']}" if report.columns and b.get("judged", True) else "–"


def console_table(report: Report) -> tuple[str, list[str], list[list[str]]]:
    """The short table `emapg ablate` prints (title, headers, rows): per method and value, mean final accuracy ·
    collapsed/runs and Δ = method − baseline; the tuning sensitivity; the collapse boundary."""
    title = (f"stability: mean final accuracy · collapsed/runs per {report.axis}; Δ = method − {report.baseline} "
             "(* 95% CI excludes 0)")
    heads = ["method", *(column_header(c) for c in report.columns),
             f"within {report.analysis['within_points']:g} pts [95% CI]", "collapses from"]
    rows = []
    for m, sens, bound in zip(report.methods, report.sensitivity, report.boundary):
        cells = []
        for col in report.columns:
            c, d = report.cell(m, col["label"]), report.difference(m, col["label"])
            text = "–" if c["final"]["mean"] is None else f"{c['final']['mean']:.3f} · {c['collapsed']}/{c['runs']}"
            if d is not None and d["mean"] is not None:
                text += f" Δ{d['mean']:+.3f}" + ("*" if d["excludes_zero"] else "")
            cells.append(text)
        frac = "–" if sens["fraction"] is None else f"{sens['fraction']:.2f}" + (
            f" [{sens['lo']:.2f}, {sens['hi']:.2f}]" if sens["lo"] is not None else "")
        rows.append([m, *cells, frac, boundary_text(report, bound)])
    return title, heads, rows


def markdown(report: Report) -> str:
    """stability.md: (a) per method x grid value, (b) paired differences, (c) tuning sensitivity, (d) collapse boundary,
    (e) power, each with its definition."""
    a = report.analysis
    heads = [column_header(c) for c in report.columns]
    lines = [f"# Stability: {report.study}", "",
             f"Methods (the study's variants) x `{report.axis}`; baseline `{report.baseline}`. A run **collapses** when its "
             f"final eval accuracy is more than {a['collapse_points']:g} points below its own best evaluation, or when it "
             "**diverged** (`emapg train` stopped it: weights made non-finite, or too many optimizer steps skipped for a "
             "non-finite loss or gradient); a diverged run counts with final accuracy 0.0. Runs that failed for any other "
             "reason are left out (listed as failed). **Steps to target**: the first evaluated step whose accuracy is >= "
             f"the run's initial + {a['target_gain']:g}.", "",
             "## (a) Per method and value", "",
             f"Final accuracy: mean over seeds and its {report.confidence:.0%} Student-t interval. Collapsed: k/n. Steps to "
             "target: median over the seeds that reached it (reached/n). Mean KL: `kl/value` averaged over the steps, then "
             "over seeds; distance: the last `ema/distance` (policy-anchor), mean over seeds.", "",
             f"| method | {report.axis} | n | final accuracy | 95% CI | best | collapsed | steps to target | mean KL | distance |",
             "|---|---|---:|---|---|---|---|---|---|---|"]
    for m in report.methods:
        for col, head in zip(report.columns, heads):
            c = report.cell(m, col["label"])
            fi = c["final"]
            n = c["runs"]
            extra = "".join(f" (+{c[k]} {k})" for k in ("failed", "unfinished") if c[k])
            ci = f"[{fixed(fi['lo'])}, {fixed(fi['hi'])}]" if fi["n"] >= 2 else "–"
            stt = f"{c['steps_to_target_median']:g} ({c['reached_target']}/{n})" if c["steps_to_target_median"] is not None else f"– (0/{n})"
            div = f", {c['diverged']} diverged" if c["diverged"] else ""
            lines.append(f"| {m} | {head} | {n}{extra} | {fixed(fi['mean'])} | {ci} | {fixed(c['best']['mean'])} | {c['collapsed']}/{n}{div} | "
                         f"{stt} | {sig3(c['kl_mean'])} | {sig3(c['ema_distance_final'])} |")
    lines += ["", f"## (b) Paired differences: method − {report.baseline}", "",
              f"Final accuracy of the method minus the baseline's, seed by seed (the same seeds in every cell), then the mean and "
              f"its {report.confidence:.0%} Student-t interval; `*`: the interval excludes 0. d_z = mean / sd of the differences; "
              f"seeds for 80%: pairs a two-sided paired t-test at 5% needs for 80% power at this d_z (section e). p: the exact "
              "paired permutation test over all 2^n sign flips of the differences (two-sided; with n seeds its smallest value "
              "is 2 / 2^n).", "",
              f"| method | {report.axis} | pairs | mean difference | 95% CI | d_z | seeds for 80% power | p |", "|---|---|---:|---|---|---|---:|---:|"]
    for d in report.differences:
        head = heads[[c["label"] for c in report.columns].index(d["column"])]
        ci = f"[{fixed(d['lo'], signed=True)}, {fixed(d['hi'], signed=True)}]" if d["n"] >= 2 else "–"
        star = " *" if d["excludes_zero"] else ""
        power = "–" if d["seeds_for_power"] is None else str(d["seeds_for_power"])
        lines.append(f"| {d['method']} | {head} | {d['n']} | {fixed(d['mean'], signed=True)}{star} | {ci} | {fixed(d['d_z'], 2, True)} | {power} | "
                     f"{fixed(d.get('p'))} |")
    lines += ["", "## (c) Tuning sensitivity", "",
              f"The fraction of the {report.axis} values where the method's mean final accuracy is within {a['within_points']:g} points "
              f"of the best method's there, with a {report.confidence:.0%} percentile bootstrap interval ({report.bootstrap['resamples']} "
              "resamples of the seeds with replacement, the same resampled seeds for every method and value; generator seed "
              f"{report.bootstrap['seed']}). A value where no method's mean final accuracy is above the runs' mean initial accuracy "
              f"({fixed(a.get('sensitivity_floor'))}) works for none and counts against every method. Higher: the method works over "
              "more of the range without retuning.", "",
              "| method | within range | 95% CI |", "|---|---|---|"]
    for s in report.sensitivity:
        k = "–" if s["fraction"] is None else f"{s['fraction']:.2f} ({round(s['fraction'] * s['columns'])}/{s['columns']})"
        lines.append(f"| {s['method']} | {k} | [{fixed(s['lo'], 2)}, {fixed(s['hi'], 2)}] |")
    lines += ["", "## (d) Collapse boundary", "",
              f"The smallest {report.axis} (in the grid's order) at which at least half of the method's runs collapsed.", "",
              "| method | collapse boundary |", "|---|---|"]
    lines += [f"| {b['method']} | {boundary_text(report, b)} |" for b in report.boundary]
    lines += ["", "## (e) Power", "",
              "For each paired comparison of (b): d_z = mean / sd of the per-seed differences, and the number of seeds a two-sided "
              "paired t-test at level 5% needs to detect that effect with 80% power, by the normal approximation with Guenther's "
              "one-step t-correction:", "",
              "    n = ceil(((z_0.975 + z_0.80) / d_z)^2 + z_0.975^2 / 2) = ceil(7.849 / d_z^2 + 1.921)", "",
              "So an interval that includes 0 with a small |d_z| says how many seeds a real difference of that size would take; "
              "d_z from few seeds is itself uncertain (read n as an order of magnitude)."]
    return "\n".join(lines + runs_section(report.runs)) + "\n"


def write(out: Path, report: Report) -> list[Path]:
    """Write stability.md and stability.json into the sweep folder; return their paths."""
    return write_report_files(out, STABILITY_MD, STABILITY_JSON, markdown(report), report)
