"""Figures of a sweep (matplotlib, Agg backend): curves per configuration with a band over seeds,
and the final-accuracy bars with 95% confidence intervals."""

from __future__ import annotations

from typing import Optional

import math
from pathlib import Path

from emapg_cli.ablate.aggregate import ConfigSummary, RunRecord

ACCURACY_PNG = "accuracy.png"
FINAL_PNG = "final_accuracy.png"
KL_EMA_PNG = "kl_ema.png"


def mean_band(series: list[list[tuple[int, float]]]) -> tuple[list[int], list[float], list[float]]:
    """Align runs' (step, value) series by step: steps, mean over the runs that logged each step,
    and the sample std there (0 where only one run did)."""
    by_step: dict[int, list[float]] = {}
    for s in series:
        for step, v in s:
            by_step.setdefault(step, []).append(v)
    steps = sorted(by_step)
    means, stds = [], []
    for step in steps:
        xs = by_step[step]
        m = sum(xs) / len(xs)
        means.append(m)
        stds.append(math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)
    return steps, means, stds


def _curve_panel(ax, summaries: list[ConfigSummary], records: list[RunRecord], metric: str, title: str, colors) -> None:
    for i, c in enumerate(summaries):
        series = [r.curves.get(metric, []) for r in records if r.spec.config_id == c.config_id and r.status == "done"]
        steps, mean, std = mean_band([s for s in series if s])
        if not steps:
            continue
        color = colors(i % colors.N)
        ax.plot(steps, mean, label=c.label, color=color, lw=1.6, marker="o" if len(steps) < 15 else None, ms=3)
        ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color=color, alpha=0.18, lw=0)
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)


def _colors(n: int):
    import matplotlib

    return matplotlib.colormaps["tab10" if n <= 10 else "tab20"]


def plot_all(out: Path, summaries: list[ConfigSummary], records: list[RunRecord], title: str) -> list[Path]:
    """Write accuracy.png, final_accuracy.png and kl_ema.png into `out`; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [c for c in summaries if c.runs > 0]
    if not summaries:
        return []
    colors = _colors(len(summaries))
    band = "mean ± std over seeds"
    paths = []

    def curves(left: tuple[str, str], right: tuple[str, str], name: str, ylabel: Optional[str] = None) -> None:
        """Two side-by-side panels of (metric key, panel title) curves, saved as `out/name`."""
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, (key, panel) in zip(axes, (left, right)):
            _curve_panel(ax, summaries, records, key, f"{panel} ({band})", colors)
        if ylabel:
            axes[0].set_ylabel(ylabel)
        axes[0].legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    curves(("eval/accuracy", "eval accuracy"), ("reward/mean", "train reward"), ACCURACY_PNG, "accuracy")

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(summaries) + 2), 4.5))
    xs = range(len(summaries))
    means = [c.stats["eval_accuracy_final"].mean for c in summaries]
    errs = [c.stats["eval_accuracy_final"].half_width if c.stats["eval_accuracy_final"].n >= 2 else 0.0 for c in summaries]
    ax.bar(xs, means, yerr=errs, capsize=5, color=[colors(i % colors.N) for i in xs], alpha=0.85)
    for i, c in enumerate(summaries):
        seeds = [r.metrics["eval_accuracy_final"] for r in records
                 if r.spec.config_id == c.config_id and r.status == "done" and r.metrics.get("eval_accuracy_final") is not None]
        ax.scatter([i] * len(seeds), seeds, color="black", s=12, zorder=3)
    init = [r.metrics["eval_accuracy_initial"] for r in records if r.status == "done" and r.metrics.get("eval_accuracy_initial") is not None]
    if init:
        ax.axhline(sum(init) / len(init), color="gray", ls="--", lw=1, label="initial accuracy (mean)")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xticks(list(xs), [c.label for c in summaries], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("final eval accuracy")
    ax.set_title(f"{title}: final accuracy (bars: mean, whiskers: 95% CI, dots: seeds)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths.append(out / FINAL_PNG)
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    curves(("kl/value", "KL to the anchor, kl/value"), ("ema/distance", "policy–anchor distance, ema/distance"), KL_EMA_PNG)
    return paths
