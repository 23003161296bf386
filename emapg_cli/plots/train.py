"""Training curves from one or several runs' `metrics.jsonl`, overlaid (one colour per run).

One PNG per metric that any run logged (absent metrics are skipped) plus `training.png`, every
panel on one page. Per-step metrics are noisy: each is drawn faint, with a centred moving average
over ~5% of the run on top; evaluations (every `eval.every` steps) are drawn as they are, with markers.
A distillation run's teacher accuracy (`eval/teacher_accuracy`, step 0) is a dashed reference line on the eval
accuracy panel (`drawn_series` says which series are left out).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from emapg_cli.plots.common import colors, pyplot, save

#: (metric key, panel title, file name, smoothed) in page order.
PANELS = (
    ("eval/accuracy", "greedy eval accuracy (%), eval/accuracy", "eval_accuracy.png", False),
    # what each toy is about (drawn when a run logged it): the search agent's searches, a tool environment's calls
    # (a distillation run's KL to the teacher is kl/value: its anchor is the teacher)
    ("search/calls_per_episode", "searches per episode, search/calls_per_episode", "searches.png", True),
    ("env/calls", "tool calls per episode, env/calls", "tool_calls.png", True),
    ("reward/mean", "train reward, reward/mean", "reward.png", True),
    ("kl/value", "KL to the anchor, kl/value", "kl.png", True),
    ("ema/distance", "policy-anchor distance ||θ-θ_ema||/||θ||, ema/distance", "ema_distance.png", True),
    ("entropy", "policy entropy, entropy", "entropy.png", True),
    ("clip/frac", "clipped fraction, clip/frac", "clip_fraction.png", True),
    ("throughput/tokens_per_s", "throughput, throughput/tokens_per_s", "throughput.png", True),
)
OVERVIEW_PNG = "training.png"
#: A distillation run's teacher accuracy (logged at step 0): a reference line on the eval accuracy panel.
TEACHER = "eval/teacher_accuracy"
#: Metrics logged as fractions and drawn in %, as every accuracy emapg prints.
PERCENT = frozenset({"eval/accuracy"})


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` in metrics rows, in step order, skipping rows without a finite value."""
    out = []
    for row in rows:
        v, step = row.get(key), row.get("step")
        if step is not None and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append((int(step), float(v)))
    return sorted(out)


def drawn_series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """`series(rows, key)`, except where it would only repeat or mislead: `env/calls` of the search agent (the same
    number as its `search/calls_per_episode`) and the reward of a distillation run without a verifier (every
    reward 0: `distill/kl` logged, no reward above 0)."""
    if key == "env/calls" and series(rows, "search/calls_per_episode"):
        return []
    pts = series(rows, key)
    if key == "reward/mean" and series(rows, "distill/kl") and not any(v for _, v in pts):
        return []
    return pts


def moving_average(values: list[float], window: int) -> list[float]:
    """Centred moving average; the window shrinks at both ends (so the curve keeps its length)."""
    half = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half): i + half + 1]
        out.append(sum(part) / len(part))
    return out


def _draw(ax, runs: list[tuple[str, list[dict]]], key: str, title: str, smoothed: bool, palette) -> bool:
    drawn = False
    for i, (label, rows) in enumerate(runs):
        pts = drawn_series(rows, key)
        if not pts:
            continue
        teacher = series(rows, TEACHER) if key == "eval/accuracy" else []
        scale = 100.0 if key in PERCENT else 1.0
        if teacher:
            ax.axhline(scale * teacher[0][1], color=palette(i % palette.N), ls="--", lw=1.2,
                       label=f"teacher {100 * teacher[0][1]:.1f}%" + (f" ({label})" if len(runs) > 1 else ""))
        drawn = True
        steps, values = [s for s, _ in pts], [scale * v for _, v in pts]
        color = palette(i % palette.N)
        if smoothed and len(pts) > 10:
            ax.plot(steps, values, color=color, alpha=0.25, lw=0.8)
            ax.plot(steps, moving_average(values, max(3, len(pts) // 20)), color=color, lw=1.6, label=label)
        else:
            ax.plot(steps, values, color=color, lw=1.6, marker="o" if len(pts) <= 40 else None, ms=3, label=label)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    return drawn


def plot_runs(runs: list[tuple[str, list[dict]]], out: Path, title: Optional[str] = None) -> list[Path]:
    """Write one PNG per metric present in any of `runs` ((label, metrics rows) pairs) and the
    one-page overview into `out`; returns the paths written (none when no run logged a step)."""
    plt = pyplot()
    palette = colors(len(runs))
    present = [p for p in PANELS if any(drawn_series(rows, p[0]) for _, rows in runs)]
    if not present:
        return []
    if title is None:  # the run names, or their count when they would not fit on one line (the legend names them)
        names = ", ".join(label for label, _ in runs)
        title = names if len(names) <= 80 else f"{len(runs)} runs"
    paths = []
    for key, panel, name, smoothed in present:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _draw(ax, runs, key, panel, smoothed, palette)
        if len(runs) > 1 or (key == "eval/accuracy" and ax.get_legend_handles_labels()[1]):  # several runs, a teacher
            ax.legend(fontsize=8)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        paths.append(save(fig, out / name))
    cols = 2 if len(present) > 1 else 1
    rows_n = math.ceil(len(present) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 3.4 * rows_n), squeeze=False)
    for ax, (key, panel, _, smoothed) in zip(axes.flat, present):
        _draw(ax, runs, key, panel, smoothed, palette)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    paths.append(save(fig, out / OVERVIEW_PNG))
    return paths
