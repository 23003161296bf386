"""`emapg eval --compare A B`: two evaluations of the same items, compared item by item (docs/eval.md,
"Paired comparison").

A and B are each an `emapg eval` output folder (its results.jsonl) or an `emapg train` run folder (its final
evaluation: evals/step_<N>.jsonl with the largest N). The score of an item is the fraction of its samples judged
correct (avg@n of that item; 0 or 1 with one sample). Items are matched by id; two evaluations of different item
sets are refused; two evaluations made with different settings (`SETTINGS`) are compared with a warning naming them.
The statistics are `stats.paired_compare`, the one implementation `emapg ablate`'s reports use. Nothing is written
but the --json file, and never over a file that is not an earlier comparison record.
"""

from __future__ import annotations

import json
import re
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
#: The settings compared between A and B: run.json's names of an eval folder, and a run's config keys for them.
SETTINGS = {"n": "eval.n", "temperature": "eval.temperature", "top_p": "eval.top_p", "max_tokens": "eval.max_new_tokens",
            "reward": "rollout.reward", "think": "grading.think", "truncated": "reward.truncated"}
#: The settings of an `emapg eval --responses` folder that say how it was graded (it sampled nothing).
GRADING = ("reward", "think", "truncated")


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
                key, score = _row_score(line, path, i)
                if key in scores:
                    raise UserError(f"{path}:{i}: repeated id {key!r}")
                scores[key] = score
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None
    if not scores:
        raise UserError(f"{path}: no items")
    return scores


def _row_score(line: str, path: Path, i: int) -> tuple[str, float]:
    try:
        row = json.loads(line)
        key, correct = row["id"], row["correct"]
    except (ValueError, RecursionError):  # JSONDecodeError, an integer past Python's digit limit, deep nesting
        raise UserError(f"{path}:{i}: not a JSON line") from None
    except (TypeError, KeyError, IndexError):
        key = correct = None
    if type(key) not in (str, int) or type(correct) is not list or not correct or any(type(c) is not bool for c in correct):
        raise UserError(f"{path}:{i}: not a result row (needs an id and a non-empty list `correct` of true/false)")
    return str(key), correct.count(True) / len(correct)


def check_same_items(a: dict[str, float], b: dict[str, float], name_a: str, name_b: str) -> None:
    """The two evaluations hold the same item ids, or one line naming how they differ."""
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    if only_a or only_b:
        first = f"first: {only_a[0]!r} only in {name_a}" if only_a else f"first: {only_b[0]!r} only in {name_b}"
        raise UserError(f"--compare: the evaluations hold different items ({len(a)} in {name_a}, {len(b)} in {name_b}; "
                        f"{len(only_a)} only in {name_a}, {len(only_b)} only in {name_b}; {first}): compare evaluations of the same items")


def settings(file: Path) -> dict[str, Any]:
    """The `SETTINGS` the outcomes `file` were made with: its eval folder's run.json (only `GRADING` when it graded
    given responses), or its run's config.yaml; {} when they cannot be read."""
    from emapg_cli.fileio import read_yaml_mapping

    try:
        if file.name == RESULTS:
            run = json.loads((file.parent / "run.json").read_text(encoding="utf-8"))
            return {k: run.get(k) for k in SETTINGS if run.get("model") is not None or k in GRADING}
        config = read_yaml_mapping(file.parent.parent / "config.yaml", "config")
    except (OSError, ValueError, UserError, AttributeError):
        return {}
    sections = {k: v for k, v in config.items() if isinstance(v, dict)}
    return {name: sections.get(key.partition(".")[0], {}).get(key.partition(".")[2]) for name, key in SETTINGS.items()}


def differing_settings(file_a: Path, file_b: Path) -> dict[str, list[Any]]:
    """{setting: [A's, B's]} for each of `SETTINGS` both sides record with different values."""
    a, b = settings(file_a), settings(file_b)
    return {k: [a[k], b[k]] for k in SETTINGS if a.get(k) is not None and b.get(k) is not None and a[k] != b[k]}


def compare(folder_a: Path, folder_b: Path) -> tuple[PairedComparison, dict[str, Any]]:
    """The paired comparison of two evaluations and its JSON record (with `differing_settings`)."""
    file_a, file_b = outcomes_file(folder_a), outcomes_file(folder_b)
    a, b = item_scores(file_a), item_scores(file_b)
    check_same_items(a, b, "A", "B")
    result = paired_compare(a, b)
    return result, {**record(result, file_a, file_b), "differing_settings": differing_settings(file_a, file_b)}


def settings_warning(differ: dict[str, list[Any]]) -> Optional[str]:
    """One line naming the settings A and B differ in, None when they do not."""
    if not differ:
        return None
    what = ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in differ.items())
    return f"warning: A and B were evaluated with different settings ({what}): the difference mixes them with the models'"


def record(result: PairedComparison, file_a: Path, file_b: Path) -> dict[str, Any]:
    """What --json writes: the files compared, every number of the comparison, and the verdict."""
    return {"a": str(file_a), "b": str(file_b), "items": result.n, "mean_a": result.mean_a, "mean_b": result.mean_b,
            "diff": result.diff, "ci": [result.lo, result.hi], "confidence": result.confidence, "test": result.test,
            "method": result.method, "p": result.p,
            "discordant": {"a_better": result.a_better, "b_better": result.b_better}, "ties": result.ties,
            "bootstrap": {"resamples": result.resamples, "seed": result.seed, "unit": "item"},
            "permutation": None if result.binary else {"flips": result.flips, "seed": result.seed},
            "pairs_for_power": result.pairs_for_power, "verdict": result.verdict()}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """The --json record, written under a temporary name and renamed."""
    from emapg_cli.paths import write_text_atomic

    check_json_out(path)
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def check_json_out(path: Path) -> None:
    """--json `path` may be written: a file name in a folder that exists, new or an earlier comparison record."""
    if path.is_dir():
        raise UserError(f"--json {path}: is a folder; give a file name")
    if path.exists() and not _is_record(path):
        raise UserError(f"--json {path}: exists and is not an earlier comparison record; nothing is written over it "
                        "(give a new file name)")
    if not path.parent.is_dir():
        raise UserError(f"--json {path}: no folder {path.parent}")


def _is_record(path: Path) -> bool:
    """`path` holds a comparison record --json wrote (a JSON object with its keys)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and {"a", "b", "items", "verdict", "bootstrap"} <= data.keys()


def summary_lines(result: PairedComparison, file_a: Path, file_b: Path) -> list[str]:
    """The console report: what was compared, the two means, the difference with its interval, the test, the verdict."""
    lines = [f"A: {file_a}", f"B: {file_b}"]
    lines.append(f"items {result.n}: A {result.mean_a:.4f}, B {result.mean_b:.4f}; A better on {result.a_better}, "
                 f"B better on {result.b_better}, tied on {result.ties}")
    lines.append(f"paired difference A − B: {result.diff:+.4f}, {result.confidence:.0%} percentile bootstrap interval "
                 f"[{result.lo:+.4f}, {result.hi:+.4f}] ({result.resamples} resamples of the items, seed {result.seed})")
    lines.append(result.verdict())
    return lines
