"""`emapg plot`'s core: tell training runs (metrics.jsonl) from evaluations (summary.json of
`emapg eval`), read them, and write their figures."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from emapg_cli.errors import UserError
from emapg_cli.plots.common import PLOTS_DIR

METRICS, EVAL_SUMMARY = "metrics.jsonl", "summary.json"


def kind_of(folder: Path) -> str:
    """'train' (a run directory), 'eval' (an `emapg eval` output folder); UserError otherwise."""
    if (folder / METRICS).is_file():
        return "train"
    if (folder / EVAL_SUMMARY).is_file() and (folder / "results.jsonl").is_file():
        return "eval"
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder")
    raise UserError(f"{folder}: neither a training run (no {METRICS}) nor an `emapg eval` output (no {EVAL_SUMMARY} + results.jsonl)")


def labels(folders: list[Path]) -> list[str]:
    """Short distinct labels: folder names, with the parent's name where two names collide."""
    names = [f.resolve().name for f in folders]
    return [f"{f.resolve().parent.name}/{n}" if names.count(n) > 1 else n for f, n in zip(folders, names)]


def plot_folders(folders: list[Path], out: Optional[Path] = None) -> tuple[str, Path, list[Path]]:
    """Plot `folders` (all training runs, or all evaluations) overlaid into `out` (default: ./plots, for one folder as
    for several; `train` passes its run's own plots/).

    Returns (kind, output folder, PNG paths). Every folder is checked before anything is drawn.
    """
    from emapg_cli.plots.rows import read_metric_rows, read_summary

    if not folders:
        raise UserError("give at least one run or eval folder")
    kinds = [kind_of(f) for f in folders]
    if len(set(kinds)) > 1:
        raise UserError("plot training runs and evaluations separately (their figures differ): "
                        + ", ".join(f"{f} is {k}" for f, k in zip(folders, kinds)))
    # issue 32: one run's figures went into the run's own `plots/`, overwriting what `train` drew there, while the
    # README said `./plots`
    out = out or Path(PLOTS_DIR)
    names = labels(folders)
    if kinds[0] == "train":
        from emapg_cli.plots.train import plot_runs

        runs = []
        for name, f in zip(names, folders):
            read = read_metric_rows(f / METRICS)
            if (note := read.note(f / METRICS)) is not None:
                print(f"warning: {note}", file=sys.stderr)
            runs.append((name, read.rows))
        paths = plot_runs(runs, out)
        if not paths:
            raise UserError(f"nothing to plot: no step logged yet in {', '.join(map(str, folders))}")
        return "train", out, paths
    from emapg_cli.plots.eval import no_curve, plot_evals

    evals = [(name, read_summary(f / EVAL_SUMMARY)) for name, f in zip(names, folders)]
    paths = plot_evals(evals, out)
    if not paths:
        raise UserError(f"nothing to plot: {no_curve(evals)}, and no subsets or data sources to compare")
    return "eval", out, paths
