"""The retriever interface: a batch of queries in, top-k hits per query out.

Documents follow the FlashRAG / Search-R1 corpus layout: `{"id", "contents"}` where the first line
of `contents` is the title (wiki-18 quotes it: `"Evan Morris"\nEvan Morris Evan L. ...`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol


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
