"""`emapg ablate`: sweeps of `emapg train` runs (grids x variants x seeds), run locally or printed
for a cluster, then aggregated into results.csv, summary.md and plots.

The analyses of a study (its `analysis:` section, ablate/study.py `StudyAnalysis`) are registered here by
`analysis.kind`; each has analyze(sweep, records, out) -> report, write(out, report) (its .md and .json),
console_table(report) -> (title, headers, rows), and its figures in ablate/plots.py."""

from __future__ import annotations

from pathlib import Path


def analyses() -> dict:
    """The registry: `analysis.kind` -> (its module, its plot function)."""
    from emapg_cli.ablate import anchors, distill, stability
    from emapg_cli.ablate.plots import plot_anchors, plot_distill, plot_stability

    return {"stability": (stability, plot_stability), "distill": (distill, plot_distill), "anchors": (anchors, plot_anchors)}


def run_analysis(out: Path, sweep, records) -> tuple[list[Path], tuple[str, list[str], list[list[str]]]]:
    """The study's analysis of the aggregated runs in `out`: the paths of its report files and figures, and its
    console table (title, headers, rows)."""
    module, plot = analyses()[sweep.analysis.kind]
    report = module.analyze(sweep, records, out)
    return [*module.write(out, report), *plot(out, report)], module.console_table(report)
