"""`emapg plot`: figures of training runs (several overlaid) or of evaluations."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from emapg_cli.cli.common import console


def plot(
    folders: Annotated[list[Path], typer.Argument(metavar="DIR...", help="Training run directories (metrics.jsonl), overlaid one colour each; or `emapg eval` output folders (summary.json).")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Folder for the PNGs (default: ./plots, for one folder as for several; `train` and `eval` draw their own into the run's plots/).")] = None,
) -> None:
    """Plot training curves (eval accuracy, reward, KL to the anchor, EMA distance, entropy, clip fraction,
    throughput vs step; metrics a run did not log are skipped) or evaluations (pass@k, accuracy per subset / source).

    Rows of metrics.jsonl that cannot be drawn (not JSON, not an object, no integer step >= 0) are skipped and
    counted in a warning; a summary.json of another shape than `emapg eval` writes is an error (docs/reliability.md)."""
    from rich.markup import escape

    from emapg_cli.plots.folders import plot_folders

    _, out_dir, paths = plot_folders(folders, out)
    console.print(f"wrote {len(paths)} plots to {escape(str(out_dir))}: {escape(', '.join(p.name for p in paths))}", highlight=False)
