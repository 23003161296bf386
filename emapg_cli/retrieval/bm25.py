"""In-process BM25 over a FlashRAG-layout corpus, with bm25s (Lù 2024), the backend FlashRAG ships for BM25.

bm25s is pinned (see pyproject.toml): a past release silently broke index building so that every
query returned the same hits (RUC-NLPIR/FlashRAG#103); tests/test_retrieval.py checks that
different queries get different hits. Tokenisation: bm25s's regex tokenizer, lower-cased, English
stop words removed, no stemming (PyStemmer is an optional bm25s extra we do not require).

An index folder holds bm25s's own files (`bm25/`), `docs.jsonl` (the corpus rows in index order)
and `manifest.json` (corpus path, sha256, row count, bm25s version, build time).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from emapg_cli.errors import UserError
from emapg_cli.fileio import sha256_file
from emapg_cli.retrieval.base import Hit, hit_from_doc
from emapg_cli.retrieval.corpus import read_corpus

MANIFEST = "manifest.json"
DOCS = "docs.jsonl"
FORMAT = "emapg-bm25/1"


def _bm25s():
    """The bm25s module, or a one-line UserError naming the extra that installs it."""
    try:
        import bm25s
    except ImportError:
        raise UserError("the bm25 retriever needs bm25s: pip install 'emapg[search]'") from None
    return bm25s


def _tokens(texts: list[str]) -> list[list[str]]:
    bm25s = _bm25s()
    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


def build_index(corpus: Path, out: Path, progress: Optional[Callable[[int], Callable[[int], None]]] = None,
                chunk: int = 2000) -> dict:
    """Index `corpus` into the new folder `out` (written next to it, then renamed); returns the manifest.

    progress(total) -> advance(k), called per chunk of tokenised rows.
    """
    bm25s = _bm25s()

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; choose a new --out folder")
    t0 = time.perf_counter()
    docs = read_corpus(corpus)
    advance = progress(len(docs)) if progress else (lambda k: None)
    tokens: list[list[str]] = []
    for s in range(0, len(docs), chunk):
        part = docs[s:s + chunk]
        tokens.extend(_tokens([d["contents"] for d in part]))
        advance(len(part))
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=False)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    retriever.save(str(tmp / "bm25"), show_progress=False)
    with open(tmp / DOCS, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    manifest = {
        "format": FORMAT,
        "corpus": str(corpus),
        "corpus_sha256": sha256_file(Path(corpus)),
        "rows": len(docs),
        "bm25s_version": bm25s.__version__,
        "tokenizer": "bm25s regex, lower-case, English stop words, no stemming",
        "index_s": time.perf_counter() - t0,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    if out.exists():
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return manifest


class BM25Retriever:
    """`Retriever` over an index folder written by `build_index` (thread-safe: one search at a time)."""

    def __init__(self, model, docs: list[dict[str, str]], manifest: dict):
        self.model, self.docs, self.manifest = model, docs, manifest
        self._lock = threading.Lock()

    @classmethod
    def load(cls, folder: str | Path) -> "BM25Retriever":
        bm25s = _bm25s()

        from emapg_cli.paths import expand

        folder = expand(str(folder))  # ~ and $EMAPG_HOME (presets write search.index under it)
        if not (folder / MANIFEST).is_file():
            raise UserError(f"{folder}: not a bm25 index (no {MANIFEST}; build one with `emapg retriever index CORPUS --out DIR`)")
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT:
            raise UserError(f"{folder}: unknown index format {manifest.get('format')!r} (expected {FORMAT})")
        model = bm25s.BM25.load(str(folder / "bm25"), show_progress=False)
        docs = [json.loads(line) for line in open(folder / DOCS, encoding="utf-8")]
        if len(docs) != manifest["rows"]:
            raise UserError(f"{folder}: {DOCS} has {len(docs)} rows, the manifest says {manifest['rows']}")
        return cls(model, docs, manifest)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Top `topk` documents per query by BM25 score (fewer when the corpus is smaller); ties keep bm25s's order."""
        if not queries:
            return []
        k = min(topk, len(self.docs))
        with self._lock:
            idx, scores = self.model.retrieve(_tokens(list(queries)), k=k, show_progress=False, n_threads=1)  # [n, k] each
        return [[hit_from_doc(self.docs[int(i)], float(s)) for i, s in zip(row_i, row_s)] for row_i, row_s in zip(idx, scores)]

    def close(self) -> None:
        """Nothing to release."""
