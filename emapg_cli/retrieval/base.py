"""The retriever interface: a batch of queries in, top-k hits per query out.

Documents follow the FlashRAG / Search-R1 corpus layout: `{"id", "contents"}` where the first line
of `contents` is the title (wiki-18 quotes it: `"Evan Morris"\nEvan Morris Evan L. ...`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Protocol


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


def make_retriever(kind: str, *, index: Optional[str] = None, url: Optional[str] = None,
                   timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 1.0) -> Retriever:
    """`bm25` over a saved index folder (`emapg retriever index`), or `http` against a Search-R1 `/retrieve` URL."""
    from emapg_cli.errors import UserError

    if kind == "bm25":
        if not index:
            raise UserError("search.index is not set: the folder written by `emapg retriever index CORPUS --out DIR`")
        from emapg_cli.paths import expand
        from emapg_cli.retrieval.bm25 import BM25Retriever

        return BM25Retriever.load(expand(index))
    if kind == "http":
        if not url:
            raise UserError("search.url is not set (a Search-R1 `/retrieve` endpoint, e.g. http://127.0.0.1:8000/retrieve)")
        from emapg_cli.retrieval.http import HTTPRetriever

        return HTTPRetriever(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
    raise UserError(f"unknown retriever '{kind}' (bm25 or http)")
