"""What every figure shares: a headless pyplot, one colour per run, atomic PNG writes."""

from __future__ import annotations

import os
from pathlib import Path

PLOTS_DIR = "plots"


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def colors(n: int):
    """A qualitative colour map with at least `n` distinct colours."""
    import matplotlib

    return matplotlib.colormaps["tab10" if n <= 10 else "tab20"]


def save(fig, path: Path, dpi: int = 110) -> Path:
    """Save `fig` as a PNG at `path` through a temporary name and a rename; close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=dpi)
    os.replace(tmp, path)
    fig.clf()
    pyplot().close(fig)
    return path
