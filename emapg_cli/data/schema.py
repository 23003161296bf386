"""The canonical example schema every command reads, its JSONL files, and the file a data reference points to
(`datasets.loading.load_examples` reads one, converting other layouts).

A data reference (config `data.train` / `data.eval`, `eval --bench`) is one of:
  * a path to a JSONL file (or a folder holding `data.jsonl`), `~` and `$EMAPG_HOME` expanded;
  * a dataset name prepared by `emapg prepare NAME` -> `$EMAPG_HOME/data/NAME/data.jsonl`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from emapg_cli.errors import UserError, first_line
from emapg_cli.paths import emapg_home, expand, prepare_hint


class Example(BaseModel):
    """One problem: a question and its accepted final answers."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="Stable identifier, unique within the dataset.")
    question: str = Field(min_length=1, description="The problem text, sent as the single user message.")
    answers: list[str] = Field(min_length=1, description="Accepted final answers (any one is correct).")
    source: str = Field("", description="Dataset name the row came from.")
    meta: dict[str, Any] = Field(default_factory=dict, description="Anything else (subfield, difficulty, unit, ...).")

    @field_validator("answers")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if any(not str(a).strip() for a in v):
            raise ValueError("answers must be non-empty strings")
        return v


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate


def parse_json_line(line: str, where: str, unicode_only: bool = True) -> dict[str, Any]:
    """One JSONL row: a JSON object (of valid Unicode text with `unicode_only`); anything else is a
    UserError naming `where`.

    JSON allows a lone surrogate escape (`"\\ud800"`); Python reads it into a string that is not
    valid Unicode, so user input holding one is refused here, not when its text is written later.
    """
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg})") from None
    except ValueError as e:  # an integer of more than 4300 digits (Python's int-from-text limit)
        raise UserError(f"{where}: holds an integer of more than {sys.get_int_max_str_digits()} digits (write such ids as JSON strings)"
                        if "digits" in str(e) else f"{where}: not valid JSON ({first_line(e)})") from None
    except RecursionError:
        raise UserError(f"{where}: JSON nested too deeply") from None
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if unicode_only and _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"{where}: holds a lone surrogate escape (\\ud800-\\udfff): not valid Unicode text") from None
    return row


def read_jsonl(path: Path, numbered: bool = False) -> Iterator[Any]:
    """Rows (JSON objects) of a UTF-8 JSONL file, or (line number, row) with `numbered`; a
    malformed line (not UTF-8, not JSON, not an object) is a UserError naming the file and line."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            row = parse_json_line(line, f"{path}:{lineno}")
            yield (lineno, row) if numbered else row


def json_line(row: dict[str, Any]) -> str:
    """One JSONL line: UTF-8 text as is; a row holding a lone surrogate (which UTF-8 cannot encode)
    is written with JSON escapes instead, which read back to the same string."""
    line = json.dumps(row, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(row)
    return line + "\n"


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows as JSONL (atomically: temp file then rename); returns the row count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json_line(row))
            n += 1
    tmp.replace(path)
    return n


def first_error(err: ValidationError) -> str:
    """The first validation error of a row as "field 'answers': <message>"."""
    e = err.errors()[0]
    return f"field '{'.'.join(str(p) for p in e['loc']) or 'row'}': {e['msg']}"


def resolve_data_ref(ref: str) -> Path:
    """The JSONL file a data reference points to (see module docstring)."""
    path = expand(ref)
    if path.is_file():
        return path
    if path.is_dir() and (path / "data.jsonl").is_file():
        return path / "data.jsonl"
    named = emapg_home() / "data" / ref / "data.jsonl"
    if "/" not in ref and named.is_file():
        return named
    if "/" in ref:  # a path: say where it was looked for, and how to make it when emapg makes it
        raise UserError(f"dataset file {path}: no such file{prepare_hint(path)}")
    raise UserError(f"dataset '{ref}' not found (not a file, and no {named}; run `emapg prepare {ref}` first)")
