"""Retrievers behind one interface (`base.Retriever`): in-process BM25 (`bm25`), dense e5-style embeddings in FAISS
(`dense`) and a Search-R1 HTTP client (`http`), and the factory that builds one by name.

Only `bm25.py` imports bm25s and only `dense.py` imports faiss and sentence-transformers (the extras `search`
and `dense`); the HTTP client and `server.py` use the standard library only.
"""

from __future__ import annotations

from typing import Optional

from emapg_cli.retrieval.base import Hit, Retriever

__all__ = ["Hit", "Retriever", "make_retriever", "open_index"]


def open_index(folder) -> Retriever:
    """The index in `folder` (`emapg retriever index`), bm25 or dense as its manifest's format says."""
    from emapg_cli.retrieval.dense import DenseRetriever, is_dense_index

    if is_dense_index(folder):
        return DenseRetriever.load(folder)
    from emapg_cli.retrieval.bm25 import BM25Retriever

    return BM25Retriever.load(folder)


def make_retriever(kind: str, *, index: Optional[str] = None, url: Optional[str] = None,
                   timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 1.0) -> Retriever:
    """`bm25` or `dense` over a saved index folder (`emapg retriever index [--dense MODEL]`), or `http` against a
    Search-R1 `/retrieve` URL."""
    from emapg_cli.errors import UserError

    if kind == "bm25":
        if not index:
            raise UserError("search.index is not set: the folder written by `emapg retriever index CORPUS --out DIR`")
        from emapg_cli.paths import expand
        from emapg_cli.retrieval.bm25 import BM25Retriever

        return BM25Retriever.load(expand(index))
    if kind == "dense":
        if not index:
            raise UserError("search.index is not set: the folder written by `emapg retriever index CORPUS --out DIR --dense MODEL`")
        from emapg_cli.retrieval.dense import DenseRetriever

        return DenseRetriever.load(index)
    if kind == "http":
        if not url:
            raise UserError("search.url is not set (a Search-R1 `/retrieve` endpoint, e.g. http://127.0.0.1:8000/retrieve)")
        from emapg_cli.retrieval.http import HTTPRetriever

        return HTTPRetriever(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
    raise UserError(f"unknown retriever '{kind}' (bm25, dense or http)")
