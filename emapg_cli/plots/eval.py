"""Figures of one or several evaluations (their `summary.json`): the pass@k curve, and accuracy
(pass@1 = avg@n) per subset (e.g. OlympiadBench's subfields) and per data source when the bench has them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from emapg_cli.plots.common import colors, pyplot, save

PASS_AT_K_PNG = "pass_at_k.png"
SUBSETS_PNG = "accuracy_by_subset.png"
SOURCES_PNG = "accuracy_by_source.png"


def pass_at_k(summary: dict[str, Any]) -> list[tuple[int, float]]:
    """(k, pass@k) pairs of a summary, by k."""
    return sorted((int(key.split("@", 1)[1]), float(v)) for key, v in summary.items()
                  if key.startswith("pass@") and isinstance(v, (int, float)))


def _bars(evals: list[tuple[str, dict[str, Any]]], field: str, what: str, out: Path, palette):
    """Grouped bars of pass@1 per group (`field` of each summary: 'subsets' or 'sources'); None when no eval has groups."""
    groups = sorted({g for _, s in evals for g in (s.get(field) or {})})
    if not groups:
        return None
    plt = pyplot()
    width = 0.8 / len(evals)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) * max(1, len(evals)) ** 0.5 + 2), 4.5))
    for i, (label, s) in enumerate(evals):
        table = s.get(field) or {}
        xs = [j + (i - (len(evals) - 1) / 2) * width for j in range(len(groups))]
        ys = [100 * table[g]["avg@n"] if g in table else 0.0 for g in groups]
        bars = ax.bar(xs, ys, width=width, color=palette(i % palette.N), label=label)
        for bar, g in zip(bars, groups):
            if g in table:
                ax.annotate(f"{table[g]['num_items']}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7, color="0.35")
    ax.set_xticks(range(len(groups)), groups, rotation=25 if len(groups) > 4 else 0, ha="right" if len(groups) > 4 else "center", fontsize=8)
    ax.set_ylabel("accuracy, pass@1 = avg@n (%)")
    ax.set_title(f"accuracy per {what} (numbers above bars: items)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if len(evals) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, out)


def no_curve(evals: list[tuple[str, dict[str, Any]]]) -> str | None:
    """Why there is no pass@k curve (every evaluation drew one sample per problem: pass@1 alone is one dot, and it
    is the accuracy the summary prints), or None when there is one."""
    if any(len(pass_at_k(s)) > 1 for _, s in evals):
        return None
    return "no pass@k curve: one sample per problem (n = 1), so pass@1 is the accuracy in summary.md"


def plot_evals(evals: list[tuple[str, dict[str, Any]]], out: Path) -> list[Path]:
    """Write pass_at_k.png (unless `no_curve`) and the per-subset / per-source bars where the benches have them into
    `out` for `evals` ((label, summary.json contents) pairs); returns the paths written (maybe none)."""
    palette = colors(len(evals))
    paths = []
    if no_curve(evals) is None:
        paths.append(_pass_at_k_curve(evals, out / PASS_AT_K_PNG, palette))
    for field, what, name in (("subsets", "subset", SUBSETS_PNG), ("sources", "data source", SOURCES_PNG)):
        path = _bars(evals, field, what, out / name, palette)
        if path is not None:
            paths.append(path)
    return paths


def _pass_at_k_curve(evals: list[tuple[str, dict[str, Any]]], path: Path, palette) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, (label, s) in enumerate(evals):
        pts = pass_at_k(s)
        if not pts:
            continue
        color = palette(i % palette.N)
        ax.plot([k for k, _ in pts], [100 * v for _, v in pts], marker="o", color=color, lw=1.6,
                label=f"{label} (n={s.get('n', '?')})")
        if isinstance(s.get("maj@n"), (int, float)):
            ax.axhline(100 * s["maj@n"], color=color, ls="--", lw=1, alpha=0.7)
    ax.set_xscale("log", base=2)
    ks = sorted({k for _, s in evals for k, _ in pass_at_k(s)})
    if ks:
        ax.set_xticks(ks, [str(k) for k in ks])  # 1, 2, 4, ... rather than 2^0, 2^1, ...
        ax.minorticks_off()
    ax.set_xlabel("k (samples per problem)")
    ax.set_ylabel("pass@k (%)")
    ax.set_title("unbiased pass@k (dashed: maj@n)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, path)
