"""Heat map of `kl-check --stability` results (matplotlib, Agg; writes one image file)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

from emapg_cli.paths import save_figure_atomic

from emapg_cli.klcheck.stability import OUTCOMES, StabilityResult, theory_radius

_COLORS = {"converges": "#4daf4a", "oscillates": "#ffd92f", "diverges": "#e41a1c"}
_FINE = 400  # alpha samples per row for the theoretical boundary


def plot_stability(results: Union[StabilityResult, Sequence[StabilityResult]], path: Union[str, Path]) -> Path:
    """Save a heat map of simulated outcomes with the theoretical boundary (radius = 1) overlaid.

    One panel per result (e.g. P = 10 and P = 1 side by side). x: alpha (log scale), y: eta (one
    row per grid value). The black contour is where the linearised spectral radius crosses 1,
    computed on a fine alpha grid per row; x marks cells where simulation and theory disagree.
    Returns the path written.
    """
    import numpy as np
    import torch
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    results = [results] if isinstance(results, StabilityResult) else list(results)
    fig = Figure(figsize=(6.0 * len(results), 4.2), layout="constrained")
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    cmap = ListedColormap([_COLORS[o] for o in OUTCOMES])
    for ax, r in zip(axes, results):
        alphas = np.asarray(r.alphas)
        n_eta = len(r.etas)
        # cell edges: geometric midpoints in alpha, integer rows in eta
        la = np.log10(alphas)
        mid = (la[1:] + la[:-1]) / 2 if len(la) > 1 else np.array([])
        step = (la[1] - la[0]) / 2 if len(la) > 1 else 0.5
        x_edges = 10.0 ** np.concatenate([[la[0] - step], mid, [la[-1] + step]])
        y_edges = np.arange(n_eta + 1) - 0.5
        codes = np.array([[OUTCOMES.index(o) for o in row] for row in r.outcome])  # [E, N]
        ax.pcolormesh(x_edges, y_edges, codes, cmap=cmap, vmin=-0.5, vmax=len(OUTCOMES) - 0.5)

        # theory: radius on a fine alpha grid, constant within each eta row -> a staircase contour
        fine = torch.logspace(np.log10(x_edges[0]), np.log10(x_edges[-1]), _FINE, dtype=torch.float64)  # [F]
        rad = theory_radius(
            fine, torch.tensor(r.etas, dtype=torch.float64), torch.tensor(r.fisher_eigenvalues, dtype=torch.float64),
            period=r.period, beta=r.beta, tau=r.tau,
        ).numpy()  # [E, F]
        y_fine = np.stack([np.arange(n_eta) - 0.499, np.arange(n_eta) + 0.499], 1).reshape(-1)  # [2E]
        ax.contour(fine.numpy(), y_fine, np.repeat(rad, 2, axis=0), levels=[1.0], colors="black", linewidths=2)

        for i in range(n_eta):
            for j in range(len(alphas)):
                if not r.agrees(i, j):
                    ax.plot(alphas[j], i, marker="x", color="black", markersize=8)
        ax.set_xscale("log")
        ax.set_yticks(range(n_eta), [f"{e:g}" for e in r.etas])
        ax.set_xlabel("learning rate alpha")
        ax.set_ylabel("EMA decay eta")
        ax.set_title(f"P = {r.period}  (beta={r.beta:g}, tau={r.tau:g}, A={r.actions}; agree {r.agreement:.0%})")
    handles = [Patch(color=_COLORS[o], label=o) for o in OUTCOMES]
    handles.append(Patch(facecolor="none", edgecolor="black", label="theory: radius = 1"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_figure_atomic(fig, out, dpi=120)
