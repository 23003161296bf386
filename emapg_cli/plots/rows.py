"""What `emapg plot` reads, checked: the rows of a run's metrics.jsonl and an evaluation's summary.json.

metrics.jsonl is a log a run appends to (its last line may be cut, the run may still be going): a row
that cannot be drawn is skipped and counted, and the plot says how many (`MetricRows.note`). A row is
drawn when it is a JSON object whose `step` is a non-negative integer; of its other fields only finite
numbers are drawn (booleans, strings, null, NaN and +-inf are left out). Rows repeating a step: the last
one is drawn (a resumed run logs the steps after its checkpoint again).

summary.json is one file `emapg eval` writes whole: anything else than its shape is refused (UserError,
one line naming the file and the field).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emapg_cli.errors import UserError


def _number(v: Any) -> bool:
    """A finite JSON number (not a boolean)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class MetricRows:
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    first_skipped: int = 0  # line number of the first skipped row
    repeated: int = 0  # rows whose step an earlier row already had (the later one is kept)

    def note(self, path: Path) -> str | None:
        """One warning line about what was not drawn; None when everything was."""
        parts = []
        if self.skipped:
            n = sum(self.skipped.values())
            why = ", ".join(f"{c} {reason}" for reason, c in self.skipped.most_common())
            parts.append(f"skipped {n} unreadable row(s) ({why}; first at line {self.first_skipped})")
        if self.repeated:
            parts.append(f"{self.repeated} row(s) repeat an earlier step (the last one of each step is drawn)")
        return f"{path}: {'; '.join(parts)}" if parts else None


def _problem(raw: bytes) -> tuple[str | None, Any]:
    """(why the line is skipped or None, the row)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8", None
    if not line.strip():
        return "", None
    try:
        row = json.loads(line)
    except RecursionError:
        return "nested too deeply", None
    except ValueError:  # not JSON (a cut last line), or an integer of more than 4300 digits
        return "not JSON", None
    if not isinstance(row, dict):
        return "not a JSON object", None
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return "no integer step >= 0", None
    return None, row


def read_metric_rows(path: Path) -> MetricRows:
    """The drawable rows of a metrics.jsonl file, in step order (module docstring); UserError if it cannot be read."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if data.startswith(b"\xef\xbb\xbf"):  # a byte-order mark (an editor's save): not part of the first row
        data = data[3:]
    out = MetricRows()
    by_step: dict[int, dict[str, Any]] = {}
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        why, row = _problem(raw)
        if why == "":
            continue
        if why is not None:
            out.skipped[why] += 1
            out.first_skipped = out.first_skipped or lineno
            continue
        step = row["step"]
        if step in by_step:
            out.repeated += 1
            del by_step[step]  # the later row takes the step's place
        by_step[step] = {k: v for k, v in row.items() if k == "step" or _number(v)}
    out.rows = [by_step[s] for s in sorted(by_step)]
    return out


def _bad(path: Path, what: str) -> UserError:
    return UserError(f"{path}: not an `emapg eval` summary: {what}")


def _fraction(path: Path, key: str, v: Any) -> None:
    if not _number(v) or not 0 <= v <= 1:
        raise _bad(path, f"{key} must be a number in [0, 1], got {json.dumps(v)[:40]}")


def read_summary(path: Path) -> dict[str, Any]:
    """An evaluation's summary.json, checked field by field where the figures use it (UserError, one line)."""
    try:
        s = json.loads(path.read_bytes().decode("utf-8-sig"))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except ValueError:
        raise UserError(f"{path}: holds an integer too long to read") from None
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply") from None
    if not isinstance(s, dict):
        raise _bad(path, f"a JSON object expected, got {type(s).__name__}")
    for key, v in s.items():
        if key.startswith("pass@"):
            k = key.split("@", 1)[1]
            if not (k.isascii() and k.isdigit() and 0 < int(k) < 2**31):
                raise _bad(path, f"key {key[:40]!r}: k must be a positive integer")
            _fraction(path, key, v)
    if s.get("maj@n") is not None:
        _fraction(path, "maj@n", s["maj@n"])
    for group in ("subsets", "sources"):
        table = s.get(group)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise _bad(path, f"{group} must be an object, got {type(table).__name__}")
        for name, entry in table.items():
            if not isinstance(entry, dict):
                raise _bad(path, f"{group}[{name[:40]!r}] must be an object, got {type(entry).__name__}")
            _fraction(path, f"{group}[{name[:40]!r}].avg@n", entry.get("avg@n"))
            items = entry.get("num_items")
            if isinstance(items, bool) or not isinstance(items, int) or items < 0:
                raise _bad(path, f"{group}[{name[:40]!r}].num_items must be an integer >= 0")
    return s
