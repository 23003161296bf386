"""The retriever interface: a batch of queries in, top-k hits per query out.

Documents follow the FlashRAG / Search-R1 corpus layout: `{"id", "contents"}` where the first line
of `contents` is the title (wiki-18 quotes it: `"Evan Morris"\nEvan Morris Evan L. ...`).
Also what the bm25 and the dense index folders share: their manifest.json, its keys and JSON types checked, and
the table of the files it lists.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from emapg_cli.errors import UserError
from emapg_cli.fileio import sha256_file

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Hit:
    """One retrieved document."""

    id: str
    title: str  # first line of `contents`, surrounding double quotes removed
    contents: str  # the corpus row's `contents`, unchanged (first line = title)
    score: float

    def to_json(self) -> dict[str, Any]:
        """`{"id", "title", "contents", "score"}` (what `emapg retriever query --json` prints)."""
        return asdict(self)


def title_of(contents: str) -> str:
    """The title line of a FlashRAG `contents` string, without the quotes wiki-18 puts around it."""
    first = contents.split("\n", 1)[0].strip()
    return first[1:-1] if len(first) >= 2 and first[0] == first[-1] == '"' else first


def hit_from_doc(doc: dict[str, Any], score: float) -> Hit:
    """A Hit from a corpus row / Search-R1 `document` dict (only `contents` is required, as in Search-R1's client)."""
    contents = str(doc["contents"])
    return Hit(id=str(doc.get("id", "")), title=title_of(contents), contents=contents, score=float(score))


class Retriever(Protocol):
    """A search backend. `search` is called once per agent turn with every active episode's query."""

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """For each query (in order), its best `topk` hits, best first."""
        ...

    def close(self) -> None:
        """Release resources (connections, memory maps)."""
        ...


def file_table(folder: Path) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} of every file under `folder` but the manifest (sorted)."""
    return {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}


def is_json(value: Any, kind: Any) -> bool:
    """isinstance for a JSON value: true and false are no numbers (they are only where `kind` is bool)."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def read_index_manifest(folder: Path, fmt: str, keys: dict[str, Any], bad: Callable[[str], UserError]) -> dict:
    """The manifest of index `folder`, of format `fmt`: exactly the keys `keys` with their JSON types, and `files`
    mapping names inside the folder to {"bytes": int, "sha256": str}. Anything else is a UserError naming the
    folder (`bad(what)` for a broken index)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{folder}: not an index (no {MANIFEST}; build one with `emapg retriever index CORPUS --out DIR`)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise bad(f"{MANIFEST} is not readable JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(manifest, dict):
        raise bad(f"{MANIFEST} is not a JSON object")
    if manifest.get("format") != fmt:
        raise UserError(f"{folder}: unknown index format {str(manifest.get('format'))[:80]!r} (expected {fmt})")
    missing, extra = sorted(set(keys) - set(manifest)), sorted(set(manifest) - set(keys))
    if missing or extra:
        raise bad(f"{MANIFEST} " + "; ".join(
            ([f"lacks {', '.join(missing)}"] if missing else []) + ([f"has unknown keys {', '.join(extra)[:120]}"] if extra else [])))
    for key, kind in keys.items():
        if not is_json(manifest[key], kind):
            raise bad(f"{MANIFEST}: {key} is {type(manifest[key]).__name__}, not {getattr(kind, '__name__', 'a number')}")
    for name, entry in manifest["files"].items():
        if not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"} or not is_json(entry["bytes"], int) \
                or not isinstance(entry["sha256"], str):
            raise bad(f"{MANIFEST}: files[{name[:80]!r}] is not {{\"bytes\": int, \"sha256\": str}}")
        if name.startswith("/") or ".." in Path(name).parts:
            raise bad(f"{MANIFEST}: files names {name[:80]!r}, outside the index")
    return manifest
