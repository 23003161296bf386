"""What every figure shares: a headless pyplot, one colour per run, atomic PNG writes."""

from __future__ import annotations

from pathlib import Path

from emapg_cli.paths import save_figure_atomic

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
    """Save `fig` at `path` atomically (`paths.save_figure_atomic`; its folder created first); close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure_atomic(fig, path, dpi)
    fig.clf()
    pyplot().close(fig)
    return path
