"""kl-check figure (matplotlib, Agg backend): bias per estimator and Top-k gradient variance vs k."""

from __future__ import annotations

from pathlib import Path

from emapg_cli.klcheck.measure import CheckResult
from emapg_cli.plots.common import pyplot, save
from emapg_cli.stats import t_quantile


def variance_panel(ax, rows) -> None:
    """Panel (c): the gradient variance of topk / topk_paper / topk_mass against k, one line per direction. Estimators
    whose points agree to 6 significant digits are one line with one legend entry (`topk = topk_paper (reverse)`), not
    lines drawn on top of each other under several entries."""
    lines: dict[tuple, list[str]] = {}  # (direction, points) -> the estimators that have them
    for direction in ("reverse", "forward"):
        for name in ("topk", "topk_paper", "topk_mass"):
            pts = sorted((r.spec.k, r.grad_variance) for r in rows if r.spec.name == name and r.spec.direction == direction)
            if pts:
                lines.setdefault((direction, tuple((k, float(f"{v:.6g}")) for k, v in pts)), []).append(name)
    for (direction, pts), names in lines.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o" if direction == "reverse" else "--s",
                label=f"{' = '.join(names)} ({direction})")


def plot_check(result: CheckResult, path: str | Path) -> Path:
    """Three panels: (a) relative value bias (v - KL)/KL with confidence-level error bars and the
    closed-form expectation, (b) relative gradient bias measured vs closed form, (c) gradient
    variance of topk / topk_paper / topk_mass against k (log x)."""
    plt = pyplot()
    rows = [r for r in result.rows if r.spec.name != "exact"]
    labels = [f"{r.spec.label} ({'rev' if r.spec.direction == 'reverse' else 'fwd'})" for r in rows]
    x = list(range(len(rows)))
    tq = t_quantile(result.settings.confidence, result.settings.batches - 1)
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 0.45 * len(rows) + 2), 12), constrained_layout=True)

    ax = axes[0]
    scale = [max(abs(r.exact_kl), 1e-12) for r in rows]
    ax.errorbar(x, [r.value_bias.mean / s for r, s in zip(rows, scale)], yerr=[tq * r.value_bias.se / s for r, s in zip(rows, scale)],
                fmt="o", capsize=3, label=f"measured ± {result.settings.confidence * 100:.4g}% CI")
    ax.plot(x, [r.value_bias_expected / s for r, s in zip(rows, scale)], "x", color="k", label="closed form")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_ylabel("value bias / KL")
    ax.set_title("(a) relative value bias")
    ax.legend(fontsize=8)

    ax = axes[1]
    ax.bar(x, [r.grad_bias_rel for r in rows], color="tab:blue", alpha=0.6, label="measured ||ḡ − ∇KL|| / ||∇KL||")
    ax.plot(x, [r.grad_bias_rel_expected for r in rows], "x", color="k", label="closed form")
    ax.plot(x, [r.grad_noise_rel for r in rows], "_", color="tab:red", markersize=12, label="Monte-Carlo noise level")
    ax.set_ylabel("relative gradient bias")
    ax.set_title("(b) relative gradient bias")
    ax.legend(fontsize=8)
    for a in axes[:2]:
        a.set_xticks(x)
        a.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)

    ax = axes[2]
    variance_panel(ax, rows)
    ax.set_xscale("log")
    ks = sorted({r.spec.k for r in rows if r.spec.k is not None})
    if ks:
        ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k")
    ax.set_ylabel("E||g − ḡ||²")
    ax.set_title("(c) gradient variance of the Top-k family")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.suptitle(f"kl-check: {result.source}, N={result.settings.samples}/position", fontsize=10)
    return save(fig, Path(path), 110)
