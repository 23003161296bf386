"""The anchor study's analysis (`analysis: {kind: anchors}`; docs/ablate.md "The anchor study").

Rows are the study's variants (anchor rules: none, fixed, ema, reset, mixup, bema, adaptive-eta), cells the
combinations of its grid axes (the learning rate, and on the toy kl.coef, as multiples of the preset's). Per run:
the held-out accuracy over training, the final, best and initial accuracies, collapse (final more than
collapse_points below the run's best, or diverged: `stability.outcome`), the KL to the initial model (`kl/to_initial`),
the entropy and the response length, each a mean over the last tail_fraction of the run's measurements of it, the mean KL to the anchor, and the final evaluation's
per-item outcomes (evals/step_<N>.jsonl).

Each rule is compared with the baseline in every cell with `stats.paired_compare`, the implementation
`emapg eval --compare` uses, at two levels:

- **seeds**: the final accuracies of the two rules paired by seed: mean difference, percentile bootstrap interval,
  the exact paired permutation test (2^n sign flips; with 3 seeds its smallest two-sided p is 2/8 = 0.25), and the
  seeds a paired t-test would need for 80% power at the observed effect. This is the test of the *rule*: the seed
  is the unit the rule's effect varies over.
- **items**: the final evaluations' per-item outcomes, paired by (seed, item) over the seeds both finished:
  McNemar's exact test on the discordant pairs (greedy 0/1 scores). It asks whether the trained policies differ
  on these items; pooling seeds treats their training noise as fixed, so it is not a test of the rule by itself.

p-values are reported raw and Holm-adjusted within each family (seed tests; item tests) over every rule x cell.
Written as anchors.md and anchors.json; the figures are `plots.plot_anchors`.
"""

from __future__ import annotations

from itertools import product
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from emapg_cli.ablate.aggregate import CONFIDENCE, RunRecord, anchor_numbers, runs_section, write_report_files
from emapg_cli.ablate.distill import last_fraction_mean
from emapg_cli.ablate.grid import format_value
from emapg_cli.ablate.measures import read_base, read_run, summarize_run
from emapg_cli.ablate.plots import mean_band
from emapg_cli.ablate.runner import run_dir
from emapg_cli.ablate.stability import outcome
from emapg_cli.ablate.study import Sweep
from emapg_cli.errors import UserError
from emapg_cli.stats import PairedComparison, finite, fixed, holm, interval, p_text, paired_compare, with_ci

ANCHORS_MD = "anchors.md"
ANCHORS_JSON = "anchors.json"
#: Per-step metrics averaged over the last tail_fraction of a run: (report key, metrics.jsonl key).
TAIL_METRICS = (("kl_to_initial", "kl/to_initial"), ("entropy", "entropy"), ("response_len", "rollout/response_len"))


@dataclass
class AnchorRun:
    """One run of the study."""

    run_id: str
    rule: str
    cell: str
    seed: int
    status: str  # done | diverged | failed | running | interrupted | pending
    initial: Optional[float] = None
    final: Optional[float] = None
    best: Optional[float] = None
    collapsed: Optional[bool] = None
    kl_to_initial: Optional[float] = None  # kl/to_initial over the last tail_fraction of its measurements
    entropy: Optional[float] = None
    response_len: Optional[float] = None
    kl_mean: Optional[float] = None  # mean kl/value: the KL to the anchor
    items: int = 0  # items in its final per-item evaluation (0: none found)
    reason: str = ""
    measured: Optional[dict[str, Any]] = None  # measures.summarize_run (a study with `measure:`)


@dataclass
class Report:
    """Everything anchors.md and anchors.json say (JSON: `asdict`)."""

    study: str
    axes: list[str]
    baseline: str
    analysis: dict[str, Any]
    confidence: float
    rules: list[str]
    cells: list[dict[str, Any]]  # {"label": "lr x4, coef x10", "values": {axis: typed value}}
    rows: list[dict[str, Any]] = field(default_factory=list)  # per rule x cell
    comparisons: list[dict[str, Any]] = field(default_factory=list)  # per non-baseline rule x cell: seeds, items
    curves: list[dict[str, Any]] = field(default_factory=list)  # per rule x cell: eval accuracy {steps, mean, std, runs}
    runs: list[dict[str, Any]] = field(default_factory=list)
    base: dict[str, Any] = field(default_factory=dict)  # measures.read_base: the initial model and the baselines
    curve_metric: str = "eval/accuracy"  # what `curves` hold: reward/mean when the runs evaluate only at the end

    def row(self, rule: str, cell: str) -> dict[str, Any]:
        return next(r for r in self.rows if r["rule"] == rule and r["cell"] == cell)

    def comparison(self, rule: str, cell: str) -> Optional[dict[str, Any]]:
        return next((c for c in self.comparisons if c["rule"] == rule and c["cell"] == cell), None)


def cell_label(axes: list[str], labels: dict[str, str]) -> str:
    """`lr x4, coef x10`: each axis by its last key component and the value as written; `all` without axes."""
    return ", ".join(f"{a.rsplit('.', 1)[-1]} {labels[a]}" for a in axes) or "all"


def final_items(folder: Path) -> dict[str, float]:
    """The per-item scores of a run's final evaluation ({} when the run wrote none: an older run)."""
    from emapg_cli.evaluation.compare import item_scores, outcomes_file

    try:
        return item_scores(outcomes_file(folder))
    except UserError:
        return {}


def run_numbers(rec: RunRecord, rule: str, cell: str, sweep: Sweep, out: Path,
                base: Optional[dict[str, Any]] = None) -> tuple[AnchorRun, dict[str, float]]:
    """The AnchorRun of one record and its final per-item scores; with `base` (a study with `measure:`), its
    measurements against the initial model's, and the initial model's accuracy where the run did not evaluate it."""
    o = outcome(rec, rule, cell, sweep.analysis)
    run = AnchorRun(rec.spec.run_id, rule, cell, rec.spec.seed, o.status, o.initial, o.final, o.best, o.collapsed,
                    reason=o.reason)
    if not o.counted:
        return run, {}
    if base is not None:
        if run.initial is None and base["heldout"]:
            start = base["heldout"].values()
            run.initial = sum(t["accuracy"] * t["items"] for t in start) / sum(t["items"] for t in start)
        if o.status == "done":
            run.measured = summarize_run(read_run(run_dir(out, rec.spec)), base)
    for key, metric in TAIL_METRICS:
        setattr(run, key, last_fraction_mean(rec.curves.get(metric, []), sweep.analysis.tail_fraction))
    run.kl_mean = anchor_numbers(rec.curves)["kl_mean"]
    items = final_items(run_dir(out, rec.spec)) if o.status == "done" else {}
    run.items = len(items)
    return run, items


def _comparison(result: PairedComparison, unit: str) -> dict[str, Any]:
    return {"unit": unit, "n": result.n, "diff": finite(result.diff), "lo": finite(result.lo), "hi": finite(result.hi),
            "test": result.test, "method": result.method, "p": result.p, "a_better": result.a_better,
            "b_better": result.b_better, "ties": result.ties, "pairs_for_power": result.pairs_for_power,
            "excludes_zero": result.n >= 2 and (result.lo > 0 or result.hi < 0)}


def analyze(sweep: Sweep, records: list[RunRecord], out: Path) -> Report:
    """The anchor study's report of the sweep in `out` (sweep.analysis of kind anchors)."""
    a = sweep.analysis
    assert a is not None
    axes = list(sweep.grid)
    rules = list(sweep.variants)
    cells: dict[str, dict[str, Any]] = {}
    runs: list[AnchorRun] = []
    items: dict[tuple[str, str, int], dict[str, float]] = {}
    curves: dict[tuple[str, str], list[list[tuple[int, float]]]] = {}
    base = read_base(out) if sweep.measure is not None else None
    # the curve over training: the evaluations, or each step's share solved on its fresh prompts when the runs
    # evaluate only at the end (a study that measures the initial model once: eval.every 0)
    evaluated = [len(r.curves.get("eval/accuracy", [])) for r in records if r.status == "done"]
    metric = "eval/accuracy" if not evaluated or max(evaluated) > 2 else "reward/mean"
    for rec in records:
        rule = str(rec.spec.values.get("variant"))
        if rule not in rules:
            continue
        labels = {k: rec.spec.grid.get(k) or format_value(rec.spec.values.get(k)) for k in axes}
        label = cell_label(axes, labels)
        cells.setdefault(label, {"label": label, "values": {k: rec.spec.values.get(k) for k in axes}})
        run, its = run_numbers(rec, rule, label, sweep, out, base)
        runs.append(run)
        items[(rule, label, run.seed)] = its
        if run.status == "done":
            curves.setdefault((rule, label), []).append(rec.curves.get(metric, []))
    order = [cell_label(axes, dict(zip(axes, combo))) for combo in product(*([format_value(v) for v in sweep.grid[k]] for k in axes))]
    ordered = [cells[c] for c in order if c in cells] + [c for label, c in cells.items() if label not in order]
    report = Report(sweep.name, axes, a.baseline, a.settings(), CONFIDENCE, rules, ordered, runs=[asdict(r) for r in runs],
                    base=base or {}, curve_metric=metric)
    for rule in rules:
        for label in (c["label"] for c in ordered):
            mine = [r for r in runs if r.rule == rule and r.cell == label]
            done = [r for r in mine if r.status in ("done", "diverged")]
            judged = [r for r in done if r.collapsed is not None]
            report.rows.append({
                "rule": rule, "cell": label, "runs": len(done), "failed": sum(r.status == "failed" for r in mine),
                "unfinished": sum(r.status not in ("done", "diverged", "failed") for r in mine),
                "diverged": sum(r.status == "diverged" for r in mine),
                **{k: interval([getattr(r, k) for r in done]) for k in ("final", "best", "initial")},
                "collapsed": sum(bool(r.collapsed) for r in judged), "judged": len(judged),
                **{k: interval([getattr(r, k) for r in done]) for k in ("kl_to_initial", "entropy", "response_len", "kl_mean")},
                **({"measured": _measured_row([r.measured for r in done if r.measured])} if base is not None else {}),
            })
            steps, mean, std = mean_band(curves.get((rule, label), []))
            report.curves.append({"rule": rule, "cell": label, "steps": steps, "mean": mean, "std": std,
                                  "runs": len(curves.get((rule, label), []))})
    _compare_rules(report, runs, items)
    return report


MEASURED = ("gain", "pass_n", "distinct", "distinct_items", "forgetting", "untrained_distinct_items", "kl_heldout")


def _measured_row(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """The seed intervals of a rule's measurements (measures.summarize_run): each scalar, and per trained task."""
    tasks = sorted({t for m in measured for t in m["tasks"]})
    return {**{k: interval([m[k] for m in measured]) for k in MEASURED},
            "tasks": {t: {k: interval([(m["tasks"].get(t) or {}).get(k) for m in measured])
                          for k in ("final", "pass", "distinct", "distinct_items")} for t in tasks}}


def _compare_rules(report: Report, runs: list[AnchorRun], items: dict[tuple[str, str, int], dict[str, float]]) -> None:
    """Every rule but the baseline against it, per cell, by seed and by (seed, item); Holm within each family."""
    finals = {(r.rule, r.cell, r.seed): r.final for r in runs if r.status in ("done", "diverged") and r.final is not None}
    for rule in report.rules:
        if rule == report.baseline:
            continue
        for cell in (c["label"] for c in report.cells):
            mine = {s: v for (ru, c, s), v in finals.items() if ru == rule and c == cell}
            base = {s: v for (ru, c, s), v in finals.items() if ru == report.baseline and c == cell}
            by_seed = paired_compare(mine, base, CONFIDENCE)
            pooled_a: dict[tuple[int, str], float] = {}
            pooled_b: dict[tuple[int, str], float] = {}
            for seed in sorted(set(mine) & set(base)):
                x, y = items.get((rule, cell, seed), {}), items.get((report.baseline, cell, seed), {})
                if x and set(x) == set(y):  # both runs' final evaluations, of the same items
                    pooled_a.update({(seed, k): v for k, v in x.items()})
                    pooled_b.update({(seed, k): v for k, v in y.items()})
            by_item = paired_compare(pooled_a, pooled_b, CONFIDENCE) if pooled_a else None
            report.comparisons.append({"rule": rule, "cell": cell, "seeds": _comparison(by_seed, "seed"),
                                       "items": _comparison(by_item, "seed x item") if by_item else None})
    for unit in ("seeds", "items"):
        family = [c[unit] for c in report.comparisons if c[unit] is not None and c[unit]["n"] > 0]
        for c, p in zip(family, holm([c["p"] for c in family])):
            c["p_holm"] = p


# --- writing ---------------------------------------------------------------------------------------


def _cmp_text(c: Optional[dict[str, Any]], power_unit: str) -> str:
    if c is None or c["n"] == 0:
        return "–"
    power = f"{c['pairs_for_power']} {power_unit}" if c["pairs_for_power"] else "–"
    return (f"{fixed(c['diff'], signed=True)} [{fixed(c['lo'], signed=True)}, {fixed(c['hi'], signed=True)}] · {c['a_better']}:{c['b_better']} · "
            f"p {p_text(c['p'])} (Holm {p_text(c.get('p_holm'))}) · {power}")


def console_table(report: Report) -> tuple[str, list[str], list[list[str]]]:
    """The short table `emapg ablate` prints (title, headers, rows): per rule and cell, mean final accuracy,
    collapsed/runs, and rule − baseline with its seed and item p."""
    rows = []
    for rule in report.rules:
        cells = []
        for cell in report.cells:
            r, c = report.row(rule, cell["label"]), report.comparison(rule, cell["label"])
            text = "–" if r["final"]["mean"] is None else f"{r['final']['mean']:.3f} · {r['collapsed']}/{r['judged']}"
            if c is not None and c["seeds"]["n"]:
                item_p = f"{c['items']['p']:.2g}" if c["items"] else "–"
                text += f" Δ{c['seeds']['diff']:+.3f} (p {c['seeds']['p']:.2g} | {item_p})"
            cells.append(text)
        rows.append([rule, *cells])
    return (f"anchors: mean final accuracy · collapsed/runs; Δ = rule − {report.baseline} (p by seed | p by item, exact tests)",
            ["rule", *(cell["label"] for cell in report.cells)], rows)


def markdown(report: Report) -> str:
    """anchors.md: (a) per rule and cell, (b) the paired comparisons with the baseline by seed, (c) by item, then the
    definitions and the runs not counted."""
    a = report.analysis
    lines = [f"# Anchor study: {report.study}", "",
             f"Rules (the study's variants) × cells ({', '.join(f'`{x}`' for x in report.axes) or 'no grid'}); baseline "
             f"`{report.baseline}`. A run **collapses** when its final accuracy is more than {a['collapse_points']:g} points "
             f"below its own best evaluation, or it diverged. Entropy and response length are means over the last "
             f"{a['tail_fraction']:.0%} of the logged steps, and so is the KL to the initial model (of the steps that measured "
             "`kl/to_initial`); KL to anchor is the mean `kl/value`.", "",
             "## (a) Per rule and cell", "",
             "| rule | cell | seeds | final accuracy [95% t CI] | best | collapsed | KL to initial | entropy | response length | KL to anchor |",
             "|---|---|---:|---|---|---|---|---|---|---|"]
    for r in report.rows:
        lines.append(f"| {r['rule']} | {r['cell']} | {r['runs']} | {with_ci(r['final'])} | {fixed(r['best']['mean'])} | "
                     f"{r['collapsed']}/{r['judged']} | {fixed(r['kl_to_initial']['mean'], 4)} | {fixed(r['entropy']['mean'])} | "
                     f"{fixed(r['response_len']['mean'], 2)} | {fixed(r['kl_mean']['mean'], 4)} |")
    for unit, title, what, power in (
            ("seeds", "(b) Rule − baseline, paired by seed (final accuracy)",
             "Each cell: mean difference [95% percentile bootstrap over seeds] · seeds where the rule was higher : lower · exact "
             "paired permutation p over all 2^n sign flips (Holm over every rule × cell) · seeds for 80% power (paired t, d_z = mean/sd)",
             "seeds"),
            ("items", "(c) Rule − baseline, paired by (seed, item) (final evaluations)",
             "Each cell: mean difference [95% percentile bootstrap over the pairs] · discordant pairs rule-only : baseline-only · "
             "McNemar exact p (a paired permutation test for non-0/1 scores; Holm over every rule × cell) · pairs for 80% power "
             "(Connor 1987). Pools the seeds: a test of the trained policies on these items, not of the rule alone",
             "pairs")):
        lines += ["", f"## {title}", "", what + ".", "",
                  "| rule | " + " | ".join(c["label"] for c in report.cells) + " |", "|---|" + "---|" * len(report.cells)]
        for rule in report.rules:
            if rule == report.baseline:
                continue
            cells = [_cmp_text((report.comparison(rule, c["label"]) or {}).get(unit), power) for c in report.cells]
            lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    if report.base:
        lines += _measured_markdown(report)
    return "\n".join(lines + runs_section(report.runs)) + "\n"


def _measured_markdown(report: Report) -> list[str]:
    """(d) the initial model and the baselines per task, (e) what each rule kept (`measure:`), (f) per task."""
    b = report.base
    const, fmt, start, sampled = b["best_constant"].get("heldout", {}), b["format_only"], b["heldout"], b["sampled"]
    lines = ["", "## (d) The initial model and the baselines a gain must clear (held-out, per trained task)", "",
             "Best constant: the accuracy of answering the task's most common gold answer to every item. Format only: the "
             "initial model shown two demonstrations of the answer format, greedy, no RL. Accuracies in %.", "",
             "| task | best constant (answer) | format only | initial greedy | initial pass@n | initial distinct answers per item | "
             "initial distinct greedy answers across items |", "|---|---|---:|---:|---:|---:|---:|"]
    for task in sorted(set(const) | set(start)):
        c, s_, p = const.get(task) or {}, start.get(task) or {}, sampled.get(task) or {}
        lines.append(f"| {task} | {fixed(100 * c['accuracy'], 1) if c else '–'} (`{c.get('answer', '')}`) | "
                     f"{fixed(100 * fmt[task]['accuracy'], 1) if task in fmt else '–'} | {fixed(100 * s_['accuracy'], 1) if s_ else '–'} | "
                     f"{fixed(100 * p['pass'], 1) if p else '–'} | {fixed(p.get('distinct'), 2) if p else '–'} | "
                     f"{fixed(s_.get('distinct_items'), 0) if s_ else '–'} |")
    untrained, uconst = b["untrained"], b["best_constant"].get("untrained", {})
    if untrained:
        lines += ["", "Untrained tasks (forgetting is measured there): initial greedy accuracy "
                  + ", ".join(f"{t} {100 * u['accuracy']:.1f}% ({u['distinct_items']:.0f} distinct answers; best constant "
                              f"{100 * (uconst.get(t) or {}).get('accuracy', float('nan')):.1f}%)" for t, u in sorted(untrained.items())) + "."]
    lines += ["", "## (e) What each rule kept (mean over seeds [95% t interval])", "",
              "Gain: final greedy accuracy above the better of best constant and format only, in points, mean over the "
              "trained tasks. pass@n and distinct answers per item: n samples at the training temperature on held-out items. "
              "Distinct across items: different greedy answers over a task's held-out items (1: one answer to everything). "
              "Forgetting: the initial model's greedy accuracy minus the run's on the untrained tasks, in points (> 0: lost). "
              "KL to initial, held-out: the exact per-token KL(policy || initial) along the policy's samples on held-out prompts.", "",
              "| rule | cell | seeds | gain (points) | pass@n % | distinct per item | distinct across items | forgetting (points) | "
              "untrained: distinct across items | KL to initial, held-out (per token) |", "|---|---|---:|---|---|---|---|---|---|---|"]
    for r in report.rows:
        m = r.get("measured")
        if not m:
            continue
        lines.append(f"| {r['rule']} | {r['cell']} | {m['gain']['n']} | {with_ci(m['gain'], 1, True, 100)} | {with_ci(m['pass_n'], 1, scale=100)} | "
                     f"{with_ci(m['distinct'])} | {with_ci(m['distinct_items'])} | {with_ci(m['forgetting'], 1, True, 100)} | "
                     f"{with_ci(m['untrained_distinct_items'])} | {fixed(m['kl_heldout']['mean'], 4)} |")
    lines += ["", "## (f) Per trained task (mean over seeds)", "",
              "| rule | cell | task | final greedy % | pass@n % | distinct per item | distinct across items |",
              "|---|---|---|---:|---:|---:|---:|"]
    for r in report.rows:
        for task, t in sorted(((r.get("measured") or {}).get("tasks") or {}).items()):
            lines.append(f"| {r['rule']} | {r['cell']} | {task} | {fixed(t['final']['mean'] and 100 * t['final']['mean'], 1)} | "
                         f"{fixed(t['pass']['mean'] and 100 * t['pass']['mean'], 1)} | {fixed(t['distinct']['mean'], 2)} | "
                         f"{fixed(t['distinct_items']['mean'], 1)} |")
    return lines


def write(out: Path, report: Report) -> list[Path]:
    """Write anchors.md and anchors.json into the sweep folder; return their paths."""
    return write_report_files(out, ANCHORS_MD, ANCHORS_JSON, markdown(report), report)
