"""Write an evaluation's `summary.json` and its markdown table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from emapg_cli.evaluation.store import SUMMARY, TABLE
from emapg_cli.paths import write_text_atomic

_HEAD = ("maj@n", "maj@n_strict", "strict")  # after the pass@k columns (avg@n is pass@1, not repeated)


def _metric_columns(summary: dict[str, Any]) -> list[str]:
    passes = [k for k in summary if k.startswith("pass@")]
    return passes + [k for k in _HEAD if k in summary]


def _pct(value: Any) -> str:
    """A score in %, or "-" when it is not defined (maj@n of a reward without answers, a missing subset column)."""
    return "-" if value is None else f"{100 * value:.1f}"


def markdown(summary: dict[str, Any]) -> str:
    """The headline table (one row) and, when the bench has subsets, a per-subset table."""
    cols = _metric_columns(summary)
    n = summary.get("n", "?")
    names = " | ".join(c.replace("maj@n", f"maj@{n}") for c in cols)
    lines = [
        f"| bench | model | items | n | {names} |",
        "|" + "---|" * (4 + len(cols)),
        f"| {summary['bench']} | {summary['model']} | {summary['num_items']} | {n} | "
        + " | ".join(_pct(summary[c]) for c in cols) + " |",
    ]
    subsets = summary.get("subsets") or {}
    if subsets:
        lines += ["", f"| subset | items | {names} |", "|" + "---|" * (2 + len(cols))]
        for name, s in subsets.items():
            lines.append(f"| {name} | {s['num_items']} | " + " | ".join(_pct(s.get(c)) for c in cols) + " |")
    if summary.get("mean_score") is not None:
        lines += ["", f"mean {summary['reward']}: {100 * summary['mean_score']:.1f} (avg@n counts full scores only)"]
    if summary.get("search"):
        from emapg_cli.evaluation.search import search_markdown

        lines += ["", search_markdown(summary["search"]).rstrip("\n")]
    lines += ["", "Scores in %. pass@1 = avg@n; pass@k unbiased (Chen et al. 2021); maj@n votes on mathematically equivalent answers, maj@n_strict on normalised strings; strict = exact match of the normalised boxed answer."]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, summary: dict[str, Any]) -> None:
    write_text_atomic(out_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    write_text_atomic(out_dir / TABLE, markdown(summary))
