"""`emapg eval --compare A B`: two evaluations of the same items, compared item by item (docs/evaluation.md,
"Paired comparison").

A and B are each an `emapg eval` output folder (its results.jsonl) or an `emapg train` run folder (its final
evaluation: evals/step_<N>.jsonl with the largest N). The score of an item is the fraction of its samples judged
correct (avg@n of that item; 0 or 1 with one sample). Items are matched by id; two evaluations of different item
sets are refused. The statistics are `stats.paired_compare`, the one implementation `emapg ablate`'s reports use.
Nothing is written but the --json file.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from emapg_cli.errors import UserError
from emapg_cli.evaluation.store import RESULTS
from emapg_cli.stats import PairedComparison, paired_compare

#: A training run's per-item outcomes of each policy evaluation (train/evaluate.py EVALS_DIR).
RUN_EVALS = "evals"
#: Bounded work: at most this many items (rows) per evaluation.
MAX_ITEMS = 1_000_000
_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")


def outcomes_file(folder: Path) -> Path:
    """The per-item outcomes of `folder`: results.jsonl of an eval folder, or a run's last evals/step_<N>.jsonl."""
    if not folder.is_dir():
        raise UserError(f"--compare {folder}: no such folder (give an `emapg eval` output folder or an `emapg train` run folder)")
    if (folder / RESULTS).is_file():
        return folder / RESULTS
    steps = sorted((int(m.group(1)), p) for p in (folder / RUN_EVALS).glob("step_*.jsonl")
                   if (m := _STEP_FILE.match(p.name)) and p.is_file()) if (folder / RUN_EVALS).is_dir() else []
    if steps:
        return steps[-1][1]
    raise UserError(f"--compare {folder}: neither an evaluation ({RESULTS}) nor a run with per-item evaluations "
                    f"({RUN_EVALS}/step_N.jsonl, written by runs of this version)")


def item_scores(path: Path) -> dict[str, float]:
    """{item id: fraction of its samples correct} from a results file (rows with `id` and a list `correct` of
    booleans); one line (UserError) on a row that is not one, a repeated id, or more than MAX_ITEMS rows."""
    scores: dict[str, float] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if len(scores) >= MAX_ITEMS:
                    raise UserError(f"{path}: more than {MAX_ITEMS:,} items")
                scores.update(_row_score(line, f"{path}:{i}", scores))
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None
    if not scores:
        raise UserError(f"{path}: no items")
    return scores


def _row_score(line: str, where: str, seen: dict[str, float]) -> dict[str, float]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        raise UserError(f"{where}: not a JSON line") from None
    ok = isinstance(row, dict) and isinstance(row.get("id"), (str, int)) and not isinstance(row.get("id"), bool)
    correct = row.get("correct") if ok else None
    if not (isinstance(correct, list) and correct and all(isinstance(c, bool) for c in correct)):
        raise UserError(f"{where}: not a result row (needs an id and a non-empty list `correct` of true/false)")
    key = str(row["id"])
    if key in seen:
        raise UserError(f"{where}: repeated id {key!r}")
    return {key: sum(correct) / len(correct)}


def check_same_items(a: dict[str, float], b: dict[str, float], name_a: str, name_b: str) -> None:
    """The two evaluations hold the same item ids, or one line naming how they differ."""
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        first = f"first: {only_a[0]!r} only in {name_a}" if only_a else f"first: {only_b[0]!r} only in {name_b}"
        raise UserError(f"--compare: the evaluations hold different items ({len(a)} in {name_a}, {len(b)} in {name_b}; "
                        f"{len(only_a)} only in {name_a}, {len(only_b)} only in {name_b}; {first}): compare evaluations of the same items")


def compare(folder_a: Path, folder_b: Path) -> tuple[PairedComparison, dict[str, Any]]:
    """The paired comparison of two evaluations and its JSON record."""
    file_a, file_b = outcomes_file(folder_a), outcomes_file(folder_b)
    a, b = item_scores(file_a), item_scores(file_b)
    check_same_items(a, b, "A", "B")
    result = paired_compare(a, b)
    return result, record(result, file_a, file_b)


def record(result: PairedComparison, file_a: Path, file_b: Path) -> dict[str, Any]:
    """What --json writes: the files compared, every number of the comparison, and the verdict."""
    fields = asdict(result)
    return {"a": str(file_a), "b": str(file_b), "items": result.n, **{k: fields[k] for k in ("mean_a", "mean_b", "diff")},
            "ci": [result.lo, result.hi], "confidence": result.confidence, "test": result.test, "method": result.method,
            "p": result.p, "discordant": {"a_better": result.a_better, "b_better": result.b_better}, "ties": result.ties,
            "bootstrap": {"resamples": result.resamples, "seed": result.seed, "unit": "item"},
            "permutation": None if result.binary else {"flips": result.flips, "seed": result.seed},
            "pairs_for_power": result.pairs_for_power, "verdict": result.verdict()}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """The --json record, written under a temporary name and renamed."""
    from emapg_cli.paths import write_text_atomic

    if path.is_dir():
        raise UserError(f"--json {path}: is a folder; give a file name")
    if not path.parent.is_dir():
        raise UserError(f"--json {path}: no folder {path.parent}")
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def summary_lines(result: PairedComparison, file_a: Optional[Path] = None, file_b: Optional[Path] = None) -> list[str]:
    """The console report: what was compared, the two means, the difference with its interval, the test, the verdict."""
    lines = []
    if file_a is not None and file_b is not None:
        lines += [f"A: {file_a}", f"B: {file_b}"]
    lines.append(f"items {result.n}: A {result.mean_a:.4f}, B {result.mean_b:.4f}; A better on {result.a_better}, "
                 f"B better on {result.b_better}, tied on {result.ties}")
    lines.append(f"paired difference A − B: {result.diff:+.4f}, {result.confidence:.0%} percentile bootstrap interval "
                 f"[{result.lo:+.4f}, {result.hi:+.4f}] ({result.resamples} resamples of the items, seed {result.seed})")
    lines.append(result.verdict())
    return lines
