"""Reading files, for every floor: a YAML mapping (duplicate keys refused, every problem one line) and a
file's SHA-256.

A bottom-layer helper (it imports only `errors`), so that dataset cards, retrieval indexes, checkpoints and
the config all read and fingerprint files the same way without importing each other. Named apart from
`paths.py` (where emapg keeps things, and atomic writes) and `datasets/files.py` (dataset file layouts).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml

from emapg_cli.errors import UserError


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: PyYAML's own error follows
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (line {key_node.start_mark.line + 1})", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def safe_load_yaml(text: str) -> Any:
    """yaml.safe_load, with a repeated mapping key an error (yaml.YAMLError)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def read_text_file(path: Path, what: str) -> str:
    """The UTF-8 text of `path`; unreadable or not UTF-8 is a one-line UserError starting with `what`."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what}: {path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{what}: cannot read {path}: {e.strerror}") from None


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """A YAML file holding a mapping ({} when empty); every problem (a duplicate key too) is a
    one-line UserError naming `what`."""
    if not path.is_file():
        raise UserError(f"{what} not found: {path}")
    try:
        data = safe_load_yaml(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot read {what} {path}: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{what} {path} must be a YAML mapping, got {type(data).__name__}")
    return data


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
