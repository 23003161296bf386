"""Read a local dataset file: JSON (an array, or an object holding one), JSONL, or parquet."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from emapg_cli.data.schema import read_jsonl
from emapg_cli.errors import UserError, first_line


def read_records(path: Path) -> list[Any]:
    """The rows of `path`, by extension (.json, .jsonl, .parquet); UserError when unreadable."""
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return list(read_jsonl(path))
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        except ValueError as e:  # an integer of more than 4300 digits (Python's int-from-text limit)
            raise UserError(f"{path}: holds an integer of more than {sys.get_int_max_str_digits()} digits (write such ids as JSON strings)"
                        if "digits" in str(e) else f"{path}: not valid JSON ({first_line(e)})") from None
        except RecursionError:
            raise UserError(f"{path}: JSON nested too deeply") from None
        if isinstance(data, dict):  # {"data": [...]} and similar wrappers
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise UserError(f"{path}: a JSON object must hold exactly one list of rows")
            data = lists[0]
        if not isinstance(data, list):
            raise UserError(f"{path}: expected a JSON array of rows")
        return data
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError("reading parquet needs pyarrow: pip install pyarrow (it comes with the emapg extra `hub`)") from None
        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's errors share no base class: all mean "not a readable parquet file"
            raise UserError(f"{path}: not a readable parquet file ({type(e).__name__}: {first_line(e)})") from None
    raise UserError(f"{path}: unsupported file type '{suffix}' (use .json, .jsonl or .parquet)")
