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


#: Width of the summary `emapg eval` prints (a terminal's default; summary.md keeps the wide tables).
TEXT_WIDTH = 80


def _cells(cells: list[str], indent: str = "  ", width: int = TEXT_WIDTH) -> list[str]:
    """`cells` ("pass@1 67.7%") in aligned columns, as many per line as fit in `width`."""
    if not cells:
        return []
    size = max(len(c) for c in cells) + 3
    per_line = max(1, (width - len(indent)) // size)
    return [indent + "".join(c.ljust(size) for c in cells[i:i + per_line]).rstrip() for i in range(0, len(cells), per_line)]


def _scores(scores: dict[str, Any], cols: list[str], n: Any) -> list[str]:
    return [f"{c.replace('maj@n_strict', f'maj@{n} strict').replace('maj@n', f'maj@{n}')} {_pct(scores.get(c))}"
            + ("%" if scores.get(c) is not None else "") for c in cols]


def text_summary(summary: dict[str, Any]) -> str:
    """What `emapg eval` prints: the same numbers as summary.md, as short lines that read at 80 columns (a wide
    markdown table wraps into noise on a terminal): the bench, the model, each score as `name value`, then per
    subset, per environment and per data source of the search agent."""
    cols = _metric_columns(summary)
    n = summary.get("n", "?")
    lines = [f"{summary['bench']}: {summary['num_items']} items x {n} sample{'s' if n != 1 else ''}, model {summary['model']}"]
    lines += _cells(_scores(summary, cols, n))
    if summary.get("mean_score") is not None:
        lines.append(f"  mean {summary['reward']} {100 * summary['mean_score']:.1f}% (avg@n counts full scores only)")
    for name, sub in (summary.get("subsets") or {}).items():
        lines += [f"subset {name} ({sub['num_items']} items)", *_cells(_scores(sub, cols, n), "    ")]
    env = summary.get("env")
    if env:
        lines.append(f"env {env['name']}: {env['calls']:.2f} calls and {env['turns']:.2f} turns per episode, "
                     f"{100 * env['invalid_rate']:.1f}% invalid turns")
    search = summary.get("search")
    if search:
        for name, x in [("all", search), *search.get("sources", {}).items()]:
            what = [f"EM {100 * x['exact_match']:.1f}%", f"F1 {100 * x['f1']:.1f}%"]
            if "searches_per_question" in x:
                what += [f"{x['searches_per_question']:.2f} searches/question", f"{100 * x['invalid_action_rate']:.1f}% invalid"]
            lines.append(f"search, {name} ({x['num_items']} items): " + ", ".join(what))
    lines.append("Scores in %: pass@1 = avg@n, pass@k unbiased; table and notes: summary.md")
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, summary: dict[str, Any]) -> None:
    write_text_atomic(out_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    write_text_atomic(out_dir / TABLE, markdown(summary))
