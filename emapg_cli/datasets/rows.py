"""Helpers every source-row layout shares: the error a row is dropped with, dotted field lookup, the id
a source row is reported under, and answer values as text. `convert.py` (maths layouts) and `qa.py`
(open-domain QA layouts) both build on them.
"""

from __future__ import annotations

import math
from typing import Any, Optional

ID_FIELDS = ("id", "unique_id", "problem_id", "_id", "question_id")


class RowError(ValueError):
    """A row that cannot be converted; the message is the reason reported in the manifest."""


def lookup(row: Any, path: str) -> Any:
    """row[path], where a dotted path reads nested values (`a.0.b` is row["a"][0]["b"]); None when absent."""
    value = row
    for key in path.split("."):
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    return value


def first_field(row: dict[str, Any], preferred: Optional[str], common: tuple[str, ...]) -> Optional[str]:
    """The first field name present (and not None) in `row`: the card's, then the common ones."""
    for name in ((preferred,) if preferred else ()) + common:
        if lookup(row, name) is not None:
            return name
    return None


def source_id(row: Any, index: int) -> str:
    """The id a source row is reported under (its first id field, else its index)."""
    name = first_field(row, None, ID_FIELDS) if isinstance(row, dict) else None
    return str(row[name]) if name else str(index)


def answer_text(value: Any) -> str:
    """An answer value as a string: integral floats lose their `.0` (AMC files store 142.0)."""
    if isinstance(value, bool):
        raise RowError(f"boolean answer {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RowError(f"non-finite answer {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, (int, str)):
        return str(value).strip()
    raise RowError(f"answer of type {type(value).__name__}")
