"""Retrievers behind one interface (`base.Retriever`): in-process BM25 (`bm25`) and a Search-R1 HTTP client (`http`).

Only `bm25.py` imports bm25s; the HTTP client and `server.py` use the standard library only.
"""

from emapg_cli.retrieval.base import Hit, Retriever, make_retriever

__all__ = ["Hit", "Retriever", "make_retriever"]
