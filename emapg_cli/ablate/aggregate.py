"""Collect the runs of a sweep into `results.csv` (one row per run) and `summary.md` (one row per
configuration: mean ± std and the 95% t interval over seeds, ranked by final eval accuracy).

Reads only files: `study.yaml` and `plan.jsonl` of the sweep, and each run's `summary.json`,
`metrics.jsonl` and status record, so a sweep run elsewhere (a cluster) aggregates the same way.
Every file is checked where it is read (issue 32: a sweep folder may be tampered with or broken):
a plan row that is not a run of the recorded sweep (a config_id that is no folder name, such as
`../../outside`, a seed the sweep does not have, values without the sweep's grid keys) is one
line naming plan.jsonl and the line; a run whose summary.json cannot be read as a JSON object is
recorded as failed, and metrics.jsonl rows that cannot be drawn are skipped, each with a warning
(`plots.rows.read_metric_rows`, the reader `emapg plot` uses).
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from emapg_cli.ablate.grid import VOCAB, RunSpec, format_value
from emapg_cli.ablate.runner import SUMMARY, read_record, read_status, run_dir
from emapg_cli.ablate.study import Sweep, read_sweep
from emapg_cli.errors import UserError
from emapg_cli.paths import write_text_atomic
from emapg_cli.stats import Interval, finite, format_ci, format_mean_std, mean_ci, sig3
from emapg_cli.train.loggers import METRICS_FILE
from emapg_cli.train.status import STATUS_FILE

PLAN_FILE = "plan.jsonl"
RESULTS_FILE = "results.csv"
SUMMARY_FILE = "summary.md"
CONFIDENCE = 0.95

#: Per-step metrics kept as curves for the plots (and the distillation analysis, ablate/distill.py).
CURVES = ("eval/accuracy", "reward/mean", "kl/value", "ema/distance", "eval/teacher_accuracy", "distill/kl",
          "distill/entropy", "distill/tail_mass", "grad/norm", "time/rollout", "time/update", "kl/to_initial", "entropy",
          "rollout/response_len")
#: results.csv columns after the grid keys.
METRIC_COLUMNS = (
    "eval_accuracy_initial", "eval_accuracy_final", "eval_accuracy_best",
    "kl_mean", "ema_distance_final", "steps", "wall_time_s",
)


@dataclass
class RunRecord:
    """One run as found on disk."""

    spec: RunSpec
    status: str  # done | failed | running | interrupted | pending
    metrics: dict[str, Optional[float]] = field(default_factory=dict)
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    error: str = ""
    returncode: Optional[int] = None  # the `train` process's exit code (failed runs)
    reason: str = ""  # why the trainer says it ended: `reason` of the run's own status.json (failed runs)


@dataclass
class ConfigSummary:
    """One configuration over its finished seeds."""

    config_id: str
    label: str
    values: dict[str, Any]
    runs: int
    failed: int
    stats: dict[str, Interval]
    order: int = 0  # position in the sweep's natural order (`natural_order`): variants as planned, numbers by value


def save_plan(out: Path, runs: list[RunSpec]) -> None:
    """Write the planned runs (id, seed, typed grid values, overrides) as `plan.jsonl`."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / PLAN_FILE, "w") as f:
        for r in runs:
            f.write(json.dumps({"config_id": r.config_id, "seed": r.seed, "values": r.values, "overrides": list(r.overrides),
                                "grid": r.grid}) + "\n")


#: A configuration's folder name (ablate/grid.py `config_id`): one path component, never `.` or `..`.
CONFIG_ID = re.compile(r"[A-Za-z0-9._=+-]+")


def read_plan(out: Path, sweep: Sweep) -> list[RunSpec]:
    """The planned runs of `plan.jsonl`, each row checked against the recorded `sweep` (one UserError line naming
    the line): an object with a `config_id` that names one folder under runs/, a seed of the sweep's, `values`
    holding every column (`variant` one of the sweep's, each grid value one the sweep lists), `overrides` strings."""
    path = out / PLAN_FILE
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{out}: no {PLAN_FILE} (not a sweep folder, or one whose runs were never planned)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot be read as UTF-8 text ({type(e).__name__})") from None
    runs: list[RunSpec] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            runs.append(_plan_row(line, f"{path}:{lineno}", sweep))
            if any((r.config_id, r.seed) == (runs[-1].config_id, runs[-1].seed) for r in runs[:-1]):
                raise UserError(f"{path}:{lineno}: run {runs[-1].run_id} is planned twice")
    if not runs:
        raise UserError(f"{path}: no planned runs")
    return runs


def _plan_row(line: str, where: str, sweep: Sweep) -> RunSpec:
    """One plan.jsonl row as a RunSpec (see read_plan)."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        raise UserError(f"{where}: not a JSON row of the plan") from None
    if not isinstance(row, dict):
        raise UserError(f"{where}: a plan row is a JSON object, not {type(row).__name__}")
    cid, seed, values, overrides, grid = (row.get(k) for k in ("config_id", "seed", "values", "overrides", "grid"))
    if not isinstance(cid, str) or not CONFIG_ID.fullmatch(cid) or cid in (".", ".."):
        raise UserError(f"{where}: config_id {json.dumps(cid)[:80]} is not a configuration's folder name")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < sweep.seeds:
        raise UserError(f"{where}: seed {json.dumps(seed)[:40]} is not one of the sweep's seeds 0..{sweep.seeds - 1}")
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise UserError(f"{where}: overrides must be a list of strings")
    grid = {} if grid is None else grid
    if not isinstance(values, dict) or not isinstance(grid, dict) or not all(isinstance(v, str) for v in grid.values()):
        raise UserError(f"{where}: values (and grid) must be objects")
    missing = [c for c in sweep.columns if c not in values]
    if missing:
        raise UserError(f"{where}: values lack {', '.join(missing)} (the sweep's columns)")
    if sweep.variants and values["variant"] not in sweep.variants:
        raise UserError(f"{where}: variant {json.dumps(values['variant'])[:60]} is not one of the sweep's")
    for key, choices in sweep.grid.items():
        try:  # as ablate/stability.py labels a run's column
            label = grid.get(key) or format_value(values[key])
        except RecursionError:  # a string nested too deeply for YAML
            label = "(nested too deeply)"
        if label not in [format_value(v) for v in choices]:
            raise UserError(f"{where}: {key} = {label[:60]} is not one of the sweep's values for it")
    return RunSpec(cid, seed, values, tuple(overrides), grid)


def _finite(x: Any) -> Optional[float]:
    """`x` as a finite float (a number, or a numeric string); None for anything else (a boolean, 1e999, an object)."""
    if isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if math.isfinite(v) else None


def curves_of(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) series of the CURVES metrics, skipping steps without the metric; `rows` as `_metric_rows` reads
    them (`plots.rows.read_metric_rows`: each with an integer step, in step order, no step twice), so in step order."""
    out: dict[str, list[tuple[int, float]]] = {name: [] for name in CURVES}
    for row in rows:
        for name in CURVES:
            v = _finite(row.get(name))
            if v is not None:
                out[name].append((row["step"], v))
    return out


def run_metrics(summary: dict[str, Any], curves: dict[str, list[tuple[int, float]]]) -> dict[str, Optional[float]]:
    """The per-run numbers of results.csv.

    best eval accuracy = max over every evaluation of the run (initial, periodic, final);
    mean KL = mean of `kl/value` over the logged steps; final EMA distance = the last `ema/distance`.
    """
    init = _finite(summary.get("eval_accuracy_initial"))
    final = _finite(summary.get("eval_accuracy_final"))
    evals = [v for _, v in curves.get("eval/accuracy", [])] + [x for x in (init, final) if x is not None]
    return {
        "eval_accuracy_initial": init,
        "eval_accuracy_final": final,
        "eval_accuracy_best": max(evals) if evals else None,
        **anchor_numbers(curves),
        "steps": int(summary["steps"]) if _finite(summary.get("steps")) is not None else None,
        "wall_time_s": _finite(summary.get("wall_time_s")),
        "teacher_accuracy": _finite(summary.get("teacher_accuracy")),  # a distillation run's (not in results.csv)
    }


def anchor_numbers(curves: dict[str, list[tuple[int, float]]]) -> dict[str, Optional[float]]:
    """`kl_mean` = the mean of `kl/value` over the logged steps, `ema_distance_final` = the last `ema/distance`
    (None without them: no KL term, no anchor); also for a run that stopped early (ablate/stability.py)."""
    kl = [v for _, v in curves.get("kl/value", [])]
    ema = curves.get("ema/distance", [])
    return {"kl_mean": sum(kl) / len(kl) if kl else None, "ema_distance_final": ema[-1][1] if ema else None}


def with_endpoints(evals: list[tuple[int, float]], metrics: dict[str, Optional[float]]) -> list[tuple[int, float]]:
    """The eval-accuracy curve with the initial evaluation at step 0 and the final one at the last
    step, where metrics.jsonl does not already log them."""
    out = list(evals)
    init, final, steps = metrics["eval_accuracy_initial"], metrics["eval_accuracy_final"], metrics["steps"]
    if init is not None and not any(step == 0 for step, _ in out):
        out.insert(0, (0, init))
    if final is not None and steps is not None and (not out or out[-1][0] < steps):
        out.append((int(steps), final))
    return out


def collect(out: Path, runs: list[RunSpec]) -> list[RunRecord]:
    """Read every planned run's state and numbers from disk; what cannot be read is a warning on stderr (a run
    whose summary.json is not a JSON object counts as failed; metric rows that cannot be drawn are skipped)."""
    records = []
    for spec in runs:
        rdir = run_dir(out, spec)
        curves = curves_of(_metric_rows(rdir / METRICS_FILE))
        summary_path = rdir / SUMMARY
        if summary_path.is_file():
            summary = read_record(summary_path)
            if summary is None:
                _warn(f"{summary_path} is not a readable JSON object: run {spec.run_id} counts as failed")
                records.append(RunRecord(spec, "failed", curves=curves, error=f"unreadable {SUMMARY}"))
                continue
            metrics = run_metrics(summary, curves)
            curves["eval/accuracy"] = with_endpoints(curves["eval/accuracy"], metrics)
            records.append(RunRecord(spec, "done", metrics, curves))
        else:
            status, trainer = read_status(out, spec), read_record(rdir / STATUS_FILE) or {}
            # a run launched elsewhere (a cluster, from --dry-run lines) has no record of ours, only the trainer's
            state = _text(status.get("status")) or ("failed" if trainer.get("status") == "failed" else "pending")
            failed, code = state == "failed", status.get("returncode")
            records.append(RunRecord(spec, state if state in ("failed", "running", "interrupted") else "pending", curves=curves,
                                     error=(_text(status.get("error")) or _text(trainer.get("reason"))) if failed else "",
                                     returncode=code if failed and type(code) is int else None,
                                     reason=_text(trainer.get("reason")) if failed else ""))
    return records


def _text(value: Any) -> str:
    """A status record's text field ("" for anything that is not a string)."""
    return value if isinstance(value, str) else ""


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _metric_rows(path: Path) -> list[dict[str, Any]]:
    """The drawable rows of a run's metrics.jsonl (`plots.rows.read_metric_rows`: an integer step >= 0, finite
    numbers); none when there is no file; what was skipped, or an unreadable file, is a warning."""
    from emapg_cli.plots.rows import read_metric_rows

    if not path.is_file():
        return []
    try:
        read = read_metric_rows(path)
    except UserError as e:
        _warn(str(e))
        return []
    if (note := read.note(path)) is not None:
        _warn(note)
    return read.rows


def label_of(values: dict[str, Any], columns: list[str], written: Optional[dict[str, str]] = None) -> str:
    """Human name of a configuration: the variant, then `key=value` of each grid key; a value written as `|V|` (the
    vocabulary size: the exact KL) reads `kl.k=|V| (259)`, not a bare 259."""

    def value(k: str) -> str:
        as_written = str((written or {}).get(k, "")).strip('"')
        return f"{VOCAB} ({values[k]})" if as_written == VOCAB else str(values[k])

    parts = [str(values["variant"])] if "variant" in columns else []
    parts += [f"{k}={value(k)}" for k in columns if k != "variant"]
    return ", ".join(parts) or "base"


def natural_order(specs: list[RunSpec], columns: list[str]) -> dict[str, int]:
    """config_id -> position: variants in the order the sweep plans them, then each grid key's values by number
    (k = 1, 8, 259, not the strings' 1, 259, 8), other values by their text."""
    first: dict[str, int] = {}
    for spec in specs:
        first.setdefault(str(spec.values.get("variant")), len(first))

    def key(spec: RunSpec) -> tuple:
        grid = [(0, float(v), "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0.0, str(v))
                for v in (spec.values.get(c) for c in columns if c != "variant")]
        return (first[str(spec.values.get("variant"))], *grid)

    ordered = sorted({s.config_id: s for s in specs}.values(), key=key)
    return {spec.config_id: i for i, spec in enumerate(ordered)}


def summarize(records: list[RunRecord], columns: list[str]) -> list[ConfigSummary]:
    """Per configuration: mean/std/CI of every metric over its finished seeds, ranked by mean final
    eval accuracy (highest first; ties in `natural_order`; configurations with no finished run last)."""
    groups: dict[str, list[RunRecord]] = {}
    for rec in records:
        groups.setdefault(rec.spec.config_id, []).append(rec)
    order = natural_order([r.spec for r in records], columns)
    out = []
    for cid, recs in groups.items():
        done = [r for r in recs if r.status == "done"]
        stats = {m: mean_ci([r.metrics.get(m) for r in done], CONFIDENCE) for m in METRIC_COLUMNS}
        values = recs[0].spec.values
        out.append(ConfigSummary(cid, label_of(values, columns, recs[0].spec.grid), values, len(done),
                                 sum(r.status == "failed" for r in recs), stats, order[cid]))
    key = lambda c: -c.stats["eval_accuracy_final"].mean if c.runs and not math.isnan(c.stats["eval_accuracy_final"].mean) else math.inf  # noqa: E731
    return sorted(sorted(out, key=lambda c: c.order), key=key)


def one_seed_caveat(summaries: list[ConfigSummary]) -> Optional[str]:
    """A warning for a ranking with no seed-to-seed spread to judge it by (no configuration has 2 finished seeds),
    None otherwise."""
    if any(c.runs >= 2 for c in summaries):
        return None
    return ("one seed per configuration: the ranking is one draw each, with no confidence interval, and seeds of one "
            "configuration can differ by several points (run --seeds 3 or more before reading an order into it)")


def write_results_csv(path: Path, records: list[RunRecord], columns: list[str]) -> None:
    """results.csv: run, configuration, every grid key, seed, status, the metrics, the error's first line."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run_id", "config", *columns, "seed", "status", *METRIC_COLUMNS, "error"])
        for r in records:
            nums = ["" if r.metrics.get(m) is None else r.metrics[m] for m in METRIC_COLUMNS]
            err = r.error.strip().splitlines()[-1] if r.error.strip() else ""
            w.writerow([r.spec.run_id, r.spec.config_id, *(r.spec.values.get(c) for c in columns), r.spec.seed, r.status, *nums, err])


def _md_cell(text: str) -> str:
    """`text` inside a markdown table cell (a `|`, as in `kl.k=|V|`, would end the cell)."""
    return text.replace("|", "\\|")


def summary_markdown(sweep: Sweep, summaries: list[ConfigSummary], records: list[RunRecord]) -> str:
    """The ranked table of configurations, then the runs that failed or have not finished."""
    lines = [f"# Ablation: {sweep.name}", ""]
    if sweep.description:
        lines += [sweep.description, ""]
    base = f"Base preset `{sweep.preset}`" + (f" with `{sweep.config}`" if sweep.config else "")
    base += f"; {sweep.seeds} seed(s) per configuration (train.seed = 0..{sweep.seeds - 1})"
    if sweep.set:
        base += "; every run also sets " + ", ".join(f"`{s}`" for s in sweep.set)
    lines += [base + ".", ""]
    lines += [
        f"Ranked by mean final eval accuracy. Accuracies in %; `mean ± std` is over seeds (sample std); CI is the "
        f"{CONFIDENCE:.0%} Student-t interval of the mean (needs ≥ 2 finished seeds). "
        "Mean KL is averaged over training steps; EMA distance is the last logged one.",
        "",
    ]
    caveat = one_seed_caveat(summaries)
    if caveat:
        lines += [f"**Caveat**: {caveat}.", ""]
    lines += [
        "| rank | configuration | seeds | final accuracy (%) | 95% CI | initial (%) | best (%) | mean KL | final EMA distance | wall time (s) |",
        "|---:|---|---:|---|---|---|---|---|---|---:|",
    ]
    pct = lambda iv: format_mean_std(iv, percent=True)  # noqa: E731
    for i, c in enumerate(summaries, 1):
        s = c.stats
        seeds = f"{c.runs}" + (f" (+{c.failed} failed)" if c.failed else "")
        wall = "–" if s["wall_time_s"].n == 0 else f"{s['wall_time_s'].mean:.0f}"
        lines.append(
            f"| {i} | {_md_cell(c.label)} | {seeds} | {pct(s['eval_accuracy_final'])} | {format_ci(s['eval_accuracy_final'], percent=True)} | "
            f"{pct(s['eval_accuracy_initial'])} | {pct(s['eval_accuracy_best'])} | {sig3(finite(s['kl_mean'].mean))} | "
            f"{sig3(finite(s['ema_distance_final'].mean))} | {wall} |"
        )
    unfinished = [r for r in records if r.status != "done"]
    if unfinished:
        lines += ["", "## Runs not finished", ""]
        for r in unfinished:
            err = r.error.strip().splitlines()[-1] if r.error.strip() else ""
            lines.append(f"- `{r.spec.run_id}`: {r.status}" + (f" — {err}" if err else ""))
    return "\n".join(lines) + "\n"


def aggregate(out: Path) -> tuple[Sweep, list[RunRecord], list[ConfigSummary]]:
    """Write results.csv and summary.md for the sweep in `out`; return what they were built from."""
    sweep = read_sweep(out)
    records = collect(out, read_plan(out, sweep))
    columns = sweep.columns
    summaries = summarize(records, columns)
    write_results_csv(out / RESULTS_FILE, records, columns)
    (out / SUMMARY_FILE).write_text(summary_markdown(sweep, summaries, records))
    return sweep, records, summaries


def runs_section(runs: list[dict[str, Any]]) -> list[str]:
    """The `## Runs` lines of an analysis's markdown (stability, anchors): the diverged runs, then those left out
    (failed, unfinished); none when every run counted."""
    diverged = [r for r in runs if r["status"] == "diverged"]
    left = [r for r in runs if r["status"] not in ("done", "diverged")]
    return ["", "## Runs", "", *(f"- `{r['run_id']}`: diverged — {r['reason']}" for r in diverged),
            *(f"- `{r['run_id']}`: {r['status']}" + (f" — {r['reason']}" if r["reason"] else "") + " (left out)" for r in left)
            ] if diverged or left else []


def write_report_files(out: Path, md_name: str, json_name: str, markdown: str, report) -> list[Path]:
    """An analysis's two files in the sweep folder: the markdown text and the report dataclass as JSON (`asdict`),
    each written under a temporary name and renamed; returns their paths."""
    md, js = out / md_name, out / json_name
    write_text_atomic(md, markdown)
    write_text_atomic(js, json.dumps(asdict(report), indent=1) + "\n")
    return [md, js]
