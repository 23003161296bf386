"""Figures of a sweep (matplotlib, Agg backend): curves per configuration with a band over seeds,
and the final-accuracy bars with 95% confidence intervals."""

from __future__ import annotations

from typing import Optional

import math
from pathlib import Path

from emapg_cli.ablate.aggregate import ConfigSummary, RunRecord
from emapg_cli.ablate.stability import column_header
from emapg_cli.plots.common import colors as colormap, pyplot, save

ACCURACY_PNG = "accuracy.png"
FINAL_PNG = "final_accuracy.png"
KL_EMA_PNG = "kl_ema.png"
DPI = 120


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


def _band(ax, steps, mean, std, color, label: str, markers_below: int, lw: float = 1.5, alpha: float = 0.12) -> None:
    """A mean curve (dots where it has fewer than `markers_below` points) with its ± std band."""
    ax.plot(steps, mean, label=label, color=color, lw=lw, marker="o" if len(steps) < markers_below else None, ms=3)
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color=color, alpha=alpha, lw=0)


def _curve_panel(ax, summaries: list[ConfigSummary], records: list[RunRecord], metric: str, title: str, colors) -> None:
    for i, c in enumerate(summaries):
        series = [r.curves.get(metric, []) for r in records if r.spec.config_id == c.config_id and r.status == "done"]
        steps, mean, std = mean_band([s for s in series if s])
        if not steps:
            continue
        if metric == "eval/accuracy":  # in %, as every accuracy emapg prints
            mean, std = [100 * m for m in mean], [100 * s for s in std]
        _band(ax, steps, mean, std, colors(i % colors.N), c.label, 15, lw=1.6, alpha=0.18)
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)


def plot_all(out: Path, summaries: list[ConfigSummary], records: list[RunRecord], title: str) -> list[Path]:
    """Write accuracy.png, final_accuracy.png and kl_ema.png into `out`; return their paths."""
    plt = pyplot()
    summaries = sorted((c for c in summaries if c.runs > 0), key=lambda c: c.order)  # k = 1, 8, 259: the grid's order
    if not summaries:
        return []
    colors = colormap(len(summaries))
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
        fig.savefig(paths[-1], dpi=DPI)  # plot_all's figures are written in place (the analyses' through save)
        plt.close(fig)

    curves(("eval/accuracy", "eval accuracy"), ("reward/mean", "train reward"), ACCURACY_PNG, "eval accuracy (%)")
    paths.append(_final_bars(plt, out, summaries, records, title, colors))
    curves(("kl/value", "KL to the anchor, kl/value"), ("ema/distance", "policy–anchor distance, ema/distance"), KL_EMA_PNG)
    return paths


def _final_bars(plt, out: Path, summaries: list[ConfigSummary], records: list[RunRecord], title: str, colors) -> Path:
    """final_accuracy.png: per configuration (in the grid's order) the mean final accuracy in %, the 95% CI as a
    whisker where it has ≥ 2 seeds, each seed as a dot; the title says when no configuration has a CI to draw."""
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(summaries) + 2), 4.5))
    xs = range(len(summaries))
    finals = [c.stats["eval_accuracy_final"] for c in summaries]
    whiskers = [100 * iv.half_width if iv.n >= 2 and math.isfinite(iv.half_width) else 0.0 for iv in finals]
    ax.bar(xs, [100 * iv.mean for iv in finals], color=[colors(i % colors.N) for i in xs], alpha=0.85)
    if any(whiskers):
        ax.errorbar(xs, [100 * iv.mean for iv in finals], yerr=whiskers, fmt="none", ecolor="black", elinewidth=1.4,
                    capsize=6, capthick=1.4, zorder=4)
    for i, c in enumerate(summaries):
        seeds = [100 * r.metrics["eval_accuracy_final"] for r in records
                 if r.spec.config_id == c.config_id and r.status == "done" and r.metrics.get("eval_accuracy_final") is not None]
        ax.scatter([i] * len(seeds), seeds, color="black", s=12, zorder=5)
    init = [r.metrics["eval_accuracy_initial"] for r in records if r.status == "done" and r.metrics.get("eval_accuracy_initial") is not None]
    if init:
        ax.axhline(100 * sum(init) / len(init), color="gray", ls="--", lw=1, label="initial accuracy (mean)")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xticks(list(xs), [c.label for c in summaries], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("final eval accuracy (%)")
    what = "bars: mean, whiskers: 95% CI, dots: seeds" if any(whiskers) else "one seed each: no CI to draw, dots: seeds"
    ax.set_title(f"{title}: final accuracy ({what})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / FINAL_PNG, dpi=DPI)
    plt.close(fig)
    return out / FINAL_PNG


# --- the stability study (ablate/stability.py) ---------------------------------------------------

STABILITY_HEATMAP_PNG = "stability_heatmap.png"
STABILITY_DIFFERENCE_PNG = "stability_difference.png"


def plot_stability(out: Path, report) -> list[Path]:
    """stability_heatmap.png (rows: methods, columns: the grid values; left: mean final accuracy, right: collapse
    rate, each cell annotated) and stability_difference.png (method - baseline per value, diverging colours centred
    at 0, each cell annotated with the mean paired difference; a thick border and `*` where its 95% interval
    excludes 0). `report`: a stability.Report. Returns the paths written."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    plt = pyplot()
    methods, cols = report.methods, report.columns
    heads = [column_header(c) for c in cols]

    def grid_of(rows, value):
        return np.array([[float("nan") if (x := value(m, c["label"])) is None else x for c in cols] for m in rows], dtype=float)

    def heatmap(ax, rows, data, note, label: str = "", **scale) -> None:
        """rows x grid values of `data` in colour; note(x, row, column) -> (text, colour, bold) annotates each cell, a
        bold one framed."""
        im = ax.imshow(np.ma.masked_invalid(data), aspect="auto", **scale)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=label)
        for i, m in enumerate(rows):
            for j, c in enumerate(cols):
                text, color, bold = note(data[i, j], m, c["label"])
                ax.text(j, i, text, ha="center", va="center", fontsize=9, fontweight="bold" if bold else "normal", color=color)
                if bold:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", lw=3))
        ax.set_xticks(range(len(cols)), heads, fontsize=8)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xlabel(report.axis)

    def collapsed(x, m, c):
        cell = report.cell(m, c)
        return f"{cell['collapsed']}/{cell['runs']}" if cell["runs"] else "–", "black" if not np.isfinite(x) or x < 0.6 else "white", False

    size = (max(6.0, 1.3 * len(cols) + 2.5), max(2.5, 0.6 * len(methods) + 1.5))
    fig, axes = plt.subplots(1, 2, figsize=(2 * size[0], size[1]))
    heatmap(axes[0], methods, grid_of(methods, lambda m, c: report.cell(m, c)["final"]["mean"]),
            lambda x, m, c: ("–" if not np.isfinite(x) else f"{x:.3f}", "white" if np.isfinite(x) and x < 0.5 else "black", False),
            cmap="viridis", vmin=0.0, vmax=1.0)
    heatmap(axes[1], methods, grid_of(methods, lambda m, c: report.cell(m, c)["collapse_rate"]), collapsed, cmap="Reds", vmin=0.0, vmax=1.0)
    axes[0].set_title("mean final accuracy")
    axes[1].set_title("collapse rate (collapsed / runs)")
    fig.suptitle(f"{report.study}: per method and {report.axis}")
    fig.tight_layout()
    paths = [save(fig, out / STABILITY_HEATMAP_PNG, DPI)]

    others = [m for m in methods if m != report.baseline]
    if others:
        diff = grid_of(others, lambda m, c: (report.difference(m, c) or {}).get("mean"))
        lim = max(float(np.nanmax(np.abs(diff))) if np.isfinite(diff).any() else 0.0, 0.01)

        def difference(x, m, c):
            d = report.difference(m, c) or {}
            if d.get("mean") is None:
                return "–", "black", False
            star = bool(d.get("excludes_zero"))
            return f"{d['mean']:+.3f}" + ("*" if star else ""), "white" if abs(d["mean"]) > 0.6 * lim else "black", star

        fig, ax = plt.subplots(figsize=size)
        heatmap(ax, others, diff, difference, f"final accuracy: method − {report.baseline}", cmap="RdBu", norm=TwoSlopeNorm(0.0, -lim, lim))
        ax.set_title(f"{report.study}: method − {report.baseline}, paired over seeds (*, border: 95% CI excludes 0)", fontsize=10)
        fig.tight_layout()
        paths.append(save(fig, out / STABILITY_DIFFERENCE_PNG, DPI))
    return paths


# --- the distillation study (ablate/distill.py) --------------------------------------------------

DISTILL_ACCURACY_PNG = "distill_accuracy.png"
DISTILL_ENTROPY_PNG = "distill_entropy.png"
DISTILL_TAIL_PNG = "distill_tail_mass.png"


def plot_distill(out: Path, report) -> list[Path]:
    """distill_accuracy.png (eval accuracy vs step per variant, mean over seeds with a ± std band; the teachers' mean
    accuracy and teacher_fraction of it as horizontal lines), distill_entropy.png (the student's distill/entropy vs
    step) and distill_tail_mass.png (distill/tail_mass vs step; only when some run logged it). `report`: a
    distill.Report. Returns the paths written."""
    plt = pyplot()
    variants = [v for v in report.variants if report.curves.get(v)]
    if not variants:
        return []
    colors = colormap(len(variants))
    teachers = [r["teacher"] for r in report.runs if r["status"] == "done" and r["teacher"] is not None]
    frac = report.analysis["teacher_fraction"]
    paths = []
    for key, name, ylabel in (("accuracy", DISTILL_ACCURACY_PNG, "eval accuracy"), ("entropy", DISTILL_ENTROPY_PNG, "student entropy (nats/token)"),
                              ("tail_mass", DISTILL_TAIL_PNG, "student tail mass 1 − P(top-k)")):
        if not any(key in report.curves[v] for v in variants):
            continue
        fig, ax = plt.subplots(figsize=(9, 5))
        for i, v in enumerate(variants):
            c = report.curves[v].get(key)
            if not c:
                continue
            _band(ax, c["steps"], c["mean"], c["std"], colors(i % colors.N), v, 25)
        if key == "accuracy" and teachers:
            t = sum(teachers) / len(teachers)
            ax.axhline(t, color="black", ls="-", lw=1.2, label=f"teacher ({t:.3f})")
            ax.axhline(frac * t, color="black", ls="--", lw=1, label=f"{frac:g} x teacher ({frac * t:.3f})")
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{report.study}: {ylabel} (mean ± std over seeds)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        paths.append(save(fig, out / name, DPI))
    return paths


# --- the anchor study (ablate/anchors.py) ----------------------------------------------------------

ANCHORS_ACCURACY_PNG = "anchors_accuracy.png"
ANCHORS_KL_PNG = "anchors_kl_accuracy.png"
ANCHORS_GAIN_PNG = "anchors_gain_forgetting.png"


def _cell_panels(report, draw, xlabel: str, ylabel: str, heading: str, path: Path, **legend) -> Path:
    """One figure with a panel per cell of an anchors.Report: `draw(ax, cell)` fills each; saved to `path`."""
    plt = pyplot()
    cells = [c["label"] for c in report.cells]
    cols = len(cells) if len(cells) <= 3 else min(3, math.ceil(math.sqrt(len(cells))))  # up to 3 a row; 4 cells: 2 x 2
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(5.2 * cols, 7.5), 3.8 * rows + 0.4), squeeze=False, sharey=True)
    for ax, cell in zip(axes.flat, cells):
        draw(ax, cell)
        ax.set_title(cell, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(cells):]:
        ax.axis("off")
    axes.flat[0].set_ylabel(ylabel)
    axes.flat[0].legend(fontsize=7, ncol=2, **legend)
    fig.suptitle(f"{report.study}: {heading}", fontsize=11)
    fig.tight_layout()
    return save(fig, path, DPI)


def plot_anchors(out: Path, report) -> list[Path]:
    """anchors_accuracy.png: one panel per cell, eval accuracy vs RL step per rule (mean over seeds, a ± std band);
    anchors_kl_accuracy.png: one panel per cell, final accuracy against the KL to the initial model (over the last
    tail_fraction of its measurements), a dot per run and a larger marker at each rule's means (rules without
    kl/to_initial are left out there). `report`: an anchors.Report. Returns the paths written."""
    if not report.cells:
        return []
    colors = colormap(len(report.rules))
    color = {r: colors(i % colors.N) for i, r in enumerate(report.rules)}

    def curves(ax, cell):
        for c in (c for c in report.curves if c["cell"] == cell and c["steps"]):
            _band(ax, c["steps"], c["mean"], c["std"], color[c["rule"]], f"{c['rule']} ({c['runs']})", 15)

    def points(ax, cell, xy):
        """A dot per run of the cell at `xy(run)` (both numbers known), a diamond at each rule's means."""
        for rule in report.rules:
            pts = [p for p in (xy(r) for r in report.runs if r["rule"] == rule and r["cell"] == cell) if None not in p]
            if pts:
                xs, ys = zip(*pts)
                ax.scatter(xs, ys, color=color[rule], s=14, alpha=0.6)
                ax.scatter([sum(xs) / len(xs)], [sum(ys) / len(ys)], color=color[rule], s=90, marker="D", edgecolor="black", label=rule)

    def scatter(ax, cell):
        points(ax, cell, lambda r: (r["kl_to_initial"], r["final"]))

    def gain(ax, cell):
        pct = lambda x: None if x is None else 100 * x  # noqa: E731
        points(ax, cell, lambda r: (pct(r["measured"]["forgetting"]), pct(r["measured"]["gain"])) if r.get("measured") else (None, None))
        ax.axhline(0, color="grey", lw=0.6)
        ax.axvline(0, color="grey", lw=0.6)

    tail = f"the last {report.analysis['tail_fraction']:.0%} of the run"
    sampled = report.curve_metric == "reward/mean"
    paths = [_cell_panels(report, curves, "RL step", "share solved on the step's fresh prompts" if sampled else "held-out accuracy",
                          "sampled accuracy on each step's new prompts over training (mean ± std over seeds)" if sampled
                          else "held-out accuracy over training (mean ± std over seeds)",
                          out / ANCHORS_ACCURACY_PNG, title="rule (seeds)", title_fontsize=7),
            _cell_panels(report, scatter, f"KL to the initial model (kl/to_initial over {tail})", "final held-out accuracy",
                         "final accuracy against KL to the initial model (dots: runs; diamonds: rule means)", out / ANCHORS_KL_PNG)]
    if report.base:
        paths.append(_cell_panels(report, gain, "forgetting on untrained tasks (points; > 0: lost)",
                                  "gain above the better baseline\n(best constant, format only; points)",
                                  "gain against forgetting (dots: runs; diamonds: rule means)", out / ANCHORS_GAIN_PNG))
    return paths
