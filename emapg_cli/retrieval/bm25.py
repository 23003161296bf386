"""In-process BM25 over a FlashRAG-layout corpus, with bm25s (Lù 2024), the backend FlashRAG ships for BM25.

bm25s is pinned (see pyproject.toml): a past release silently broke index building so that every
query returned the same hits (RUC-NLPIR/FlashRAG#103); tests/test_retrieval.py checks that
different queries get different hits. Tokenisation: bm25s's regex tokenizer, lower-cased, English
stop words removed, no stemming (PyStemmer is an optional bm25s extra we do not require).

An index folder (format emapg-bm25/3) holds bm25s's own saved files (`bm25/`, loaded memory-mapped), the
corpus rows in a doc store (`docs.bin` + `docs.offsets.npy`, retrieval/docstore.py, memory-mapped) and
`manifest.json` (corpus path and sha256, row count, bm25s version, build time, and the size and sha256 of
every other file of the folder). It is built by streaming the corpus in chunks (retrieval/bm25_build.py:
bounded memory, the same matrix as bm25s's in-memory `BM25.index`). It is an output folder like a run's
(`outputs.claim_folder`, kind `retriever index`): claimed and locked while it is built, written through a
temporary folder of a unique name beside it, the manifest last. `BM25Retriever.load` validates all of it
(docs/search.md "Index validation"): any problem is one UserError naming the folder and the file.

This module is the only one that imports bm25s; bm25_build.py gets its tokenizer and scoring functions from here.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from emapg_cli.errors import UserError
from emapg_cli.fileio import sha256_file
from emapg_cli.retrieval.base import MANIFEST, Hit, file_table, hit_from_doc, read_index_manifest
from emapg_cli.retrieval.corpus import count_rows, iter_corpus
from emapg_cli.retrieval.docstore import DOCS_BIN, OFFSETS

FORMAT = "emapg-bm25/3"
#: Rows tokenised per chunk by `build_index` (`emapg retriever index --chunk-rows`).
DEFAULT_CHUNK_ROWS = 10_000
#: An index whose files total at most this many bytes has every file's sha256 checked at load; a larger one
#: has its sizes checked and only its files under HASH_ALWAYS_BYTES hashed (a full pass over wiki-18's ~25 GB
#: would take minutes; `emapg retriever index` wrote them and the manifest lists every hash for a manual check).
VERIFY_MAX_BYTES = 2 << 30
HASH_ALWAYS_BYTES = 256 << 20
#: The one-line error without bm25s (the README's toy-search section quotes it: tests/test_first_hour_third_pass.py).
MISSING_EXTRA = ("the bm25 retriever needs bm25s, in emapg's search extra: pip install \".[search]\" in a clone of emapg, "
                 "or pip install \"emapg[search]\"")


def _bm25s():
    """The bm25s module, or a one-line UserError naming the extra that installs it."""
    try:
        import bm25s
    except ImportError:
        raise UserError(MISSING_EXTRA) from None
    return bm25s


def _tokens(texts: list[str]) -> list[list[str]]:
    return _bm25s().tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


def _token_ids(texts: list[str]) -> tuple[list[list[int]], dict[str, int]]:
    """`_tokens`'s tokenisation (the same call), as ids per text and the token -> id map of this batch."""
    tok = _bm25s().tokenize(texts, stopwords="en", return_ids=True, show_progress=False)
    return tok.ids, tok.vocab


def _scoring():
    """bm25s's idf and term-frequency functions and saved params for a default `bm25s.BM25()` (what the in-memory
    build used), for bm25_build. bm25s 0.3.16's scoring module (private names: the version is pinned)."""
    bm25s = _bm25s()
    from bm25s import scoring

    from emapg_cli.retrieval.bm25_build import Scoring

    m = bm25s.BM25()
    if m.method in m.methods_requiring_nonoccurrence:  # BM25L / BM25+ need a non-occurrence array we do not build
        raise RuntimeError(f"bm25s's default method {m.method!r} is not supported by the streaming build")
    params = {"k1": m.k1, "b": m.b, "delta": m.delta, "method": m.method, "idf_method": m.idf_method, "dtype": m.dtype,
              "int_dtype": m.int_dtype, "version": bm25s.__version__, "backend": m.backend}
    return Scoring(idf=scoring._select_idf_scorer(m.idf_method), tfc=scoring._select_tfc_scorer(m.method), params=params)


KIND = "retriever index"  # the output-folder kind (outputs.claim_folder)
#: The manifest's keys and their JSON types.
MANIFEST_KEYS: dict[str, type | tuple[type, ...]] = {
    "format": str, "corpus": str, "corpus_sha256": str, "rows": int, "bm25s_version": str, "tokenizer": str,
    "index_s": (int, float), "files": dict}


def build_index(corpus: Path, out: Path, progress: Optional[Callable[[Optional[int]], Callable[[int], None]]] = None,
                chunk: int = DEFAULT_CHUNK_ROWS, buckets: Optional[int] = None) -> dict:
    """Index `corpus` into the new (or empty) folder `out`, streaming it `chunk` rows at a time; returns the manifest.

    `out` is claimed and locked (`outputs.claim_folder`, kind `retriever index`; a second process on the
    same folder gets "in use"); the index is written into a temporary folder of a unique name beside `out`
    (this process's own, removed on every exit path) and its files are moved into `out`, the manifest last.
    progress(total rows, or None when unknown) -> advance(k), called per chunk of tokenised rows. `buckets`:
    spill files of the build (bm25_build.default_buckets of the corpus size when None).
    """
    import os
    import shutil
    import tempfile

    from emapg_cli.outputs import claim_folder, marker_kind
    from emapg_cli.retrieval.bm25_build import NoTokens, build_matrix, default_buckets
    from emapg_cli.retrieval.docstore import DocStoreWriter

    bm25s = _bm25s()
    out, corpus = Path(out), Path(corpus)
    if chunk < 1:
        raise UserError(f"--chunk-rows must be at least 1 (got {chunk})")
    if (out / MANIFEST).is_file() and marker_kind(out) == KIND:
        raise UserError(f"{out} already holds an index; choose a new --out folder")
    with claim_folder(out, KIND, fresh=True):
        t0 = time.perf_counter()
        if not corpus.is_file():
            raise UserError(f"{corpus}: no such corpus file")
        advance = progress(count_rows(corpus)) if progress else None
        scoring = _scoring()
        size = corpus.stat().st_size * (4 if corpus.name.lower().endswith(".gz") else 1)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))  # ours alone: a unique new name
        try:
            (tmp / "work").mkdir()
            with DocStoreWriter(tmp) as store:
                def texts():  # chunks of `contents`; every row goes to the doc store on the way
                    part: list[str] = []
                    for row in iter_corpus(corpus):  # raises on a duplicate id after the last row, before any yield
                        store.add(row)
                        part.append(row["contents"])
                        if len(part) == chunk:
                            yield part
                            part = []
                    if part:
                        yield part

                try:
                    build_matrix(texts(), tmp / "bm25", tmp / "work", _token_ids, scoring, buckets or default_buckets(size), advance)
                except NoTokens:
                    raise UserError(f"{corpus}: no row has a searchable word (every word is an English stop word or "
                                    "punctuation); nothing to index") from None
                rows = store.finish()
            shutil.rmtree(tmp / "work")
            manifest = {
                "format": FORMAT,
                "corpus": str(corpus),
                "corpus_sha256": sha256_file(corpus),
                "rows": rows,
                "bm25s_version": bm25s.__version__,
                "tokenizer": "bm25s regex, lower-case, English stop words, no stemming",
                "index_s": time.perf_counter() - t0,
                "files": file_table(tmp),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
            for name in ("bm25", DOCS_BIN, OFFSETS, MANIFEST):  # the manifest last: a folder without one is no index
                os.replace(tmp / name, out / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # only the folder mkdtemp made for this call
    return manifest


def remove_index(folder: Path) -> None:
    """Delete the index folder `folder` to build it again (`emapg prepare toy-search`), only if it is one emapg wrote:
    it carries the `retriever index` marker. Anything else is a UserError and is left as it is."""
    import shutil

    from emapg_cli.outputs import marker_kind

    folder = Path(folder)
    if not folder.exists():
        return
    if folder.is_symlink():  # a link to an index elsewhere: never delete through it
        raise UserError(f"{folder} is a symbolic link; remove it yourself to rebuild the index there")
    if marker_kind(folder) != KIND:
        raise UserError(f"{folder} exists and is not an index emapg wrote; move it away to rebuild the index there")
    shutil.rmtree(folder)


def _bad(folder: Path, what: str) -> UserError:
    return UserError(f"{folder}: broken bm25 index: {what} (rebuild it with `emapg retriever index CORPUS --out DIR`)")


def read_manifest(folder: Path) -> dict:
    """The manifest of index `folder`, its keys and types checked (UserError naming the folder otherwise)."""
    manifest = read_index_manifest(folder, FORMAT, MANIFEST_KEYS, lambda what: _bad(folder, what))
    if manifest["rows"] < 1:
        raise _bad(folder, f"{MANIFEST}: rows is {manifest['rows']}")
    if not {DOCS_BIN, OFFSETS, "bm25/params.index.json"} <= set(manifest["files"]):
        raise _bad(folder, f"{MANIFEST}: files does not list {DOCS_BIN} and {OFFSETS} and the bm25 model")
    return manifest


def check_files(folder: Path, manifest: dict) -> None:
    """Every file the manifest lists is there with its size and sha256, and no other file is.

    Cost: one sha256 pass over the index's files (about 1-2 s per GB). Above VERIFY_MAX_BYTES in all (a
    paper-scale index, loaded memory-mapped in seconds) only the files under HASH_ALWAYS_BYTES are hashed; the
    others have their sizes checked."""
    files = manifest["files"]
    hash_all = sum(int(e["bytes"]) for e in files.values()) <= VERIFY_MAX_BYTES
    present = {k for k in _names(folder)}
    for name in sorted(set(files) | present):
        if name not in files:
            raise _bad(folder, f"{name} is not listed in {MANIFEST}")
        path = folder / name
        if not path.is_file():
            raise _bad(folder, f"{name} is missing")
        size = path.stat().st_size
        if size != files[name]["bytes"]:
            raise _bad(folder, f"{name} has {size:,} bytes, the manifest says {files[name]['bytes']:,}")
        if (hash_all or size <= HASH_ALWAYS_BYTES) and sha256_file(path) != files[name]["sha256"]:
            raise _bad(folder, f"{name} was changed since the index was built (sha256 differs from the manifest)")


def _names(folder: Path) -> set[str]:
    """Relative names of the index's files (not the manifest, nor the output-folder marker and lock)."""
    from emapg_cli.outputs import LOCK, MARKER

    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")
            if p.is_file() and p.name not in (MANIFEST, MARKER, LOCK)}


def open_docs(folder: Path, rows: int):
    """The doc store (format /3), memory-mapped, of `rows` rows; a problem is one UserError naming the folder."""
    from emapg_cli.retrieval.docstore import DocStore

    try:
        docs = DocStore.open(folder)
    except UserError as e:
        raise _bad(folder, str(e).removeprefix(f"{folder}: ")) from None
    if len(docs) != rows:
        raise _bad(folder, f"{DOCS_BIN} has {len(docs)} rows, the manifest says {rows}")
    return docs


def _index_range(indices, n_docs: int) -> bool:
    """Every document index of the (memory-mapped) CSC `indices` is in [0, n_docs), checked in blocks."""
    for s in range(0, len(indices), 1 << 24):
        part = indices[s:s + (1 << 24)]
        if int(part.min()) < 0 or int(part.max()) >= n_docs:
            return False
    return True


def load_model(folder: Path, rows: int, mmap: bool = True):
    """bm25s's model from `folder/bm25` (its score arrays memory-mapped with `mmap`), its document count checked
    against `rows` (a model of more documents than the doc file has rows would index past its end on every
    query). The document indices are range-checked when the index is small enough to be hashed at load."""
    bm25s = _bm25s()
    try:
        model = bm25s.BM25.load(str(folder / "bm25"), show_progress=False, mmap=mmap)
        n_docs = int(model.scores["num_docs"])
        indptr = model.scores["indptr"]
        n_vocab = len(indptr) - 1
        indices = model.scores["indices"]
        ok = len(model.scores["data"]) == len(indices) == int(indptr[-1]) and n_vocab >= 1
        ids = list(model.vocab_dict.values())  # bm25s adds "" as one id past the last column
        ok = ok and all(isinstance(i, int) and 0 <= i <= n_vocab for i in ids) and len(set(ids)) == len(ids)
        ok = ok and (indices.nbytes > VERIFY_MAX_BYTES or _index_range(indices, n_docs))
    except Exception as e:  # noqa: BLE001  a file bm25s cannot parse, whatever its library raises
        raise _bad(folder, f"the bm25 model does not load ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})") from None
    if not ok:
        raise _bad(folder, "the bm25 model's arrays are inconsistent")
    if n_docs != rows:
        raise _bad(folder, f"the bm25 model has {n_docs} documents, {DOCS_BIN} has {rows}")
    return model


class BM25Retriever:
    """`Retriever` over an index folder written by `build_index` (thread-safe: one search at a time)."""

    def __init__(self, model, docs, manifest: dict):
        self.model, self.docs, self.manifest = model, docs, manifest  # docs: a DocStore
        self._lock = threading.Lock()

    @classmethod
    def load(cls, folder: str | Path, mmap: bool = True) -> "BM25Retriever":
        """The index in `folder`, validated (manifest, file sizes and hashes, row counts; docs/search.md); with
        `mmap` the score matrix and the doc store stay on disk, memory-mapped."""
        from emapg_cli.paths import expand

        folder = expand(str(folder))  # ~ and $EMAPG_HOME (presets write search.index under it)
        if not folder.is_dir():
            raise UserError(f"{folder}: no such index folder (build one with `emapg retriever index CORPUS --out DIR`)")
        manifest = read_manifest(folder)
        check_files(folder, manifest)
        docs = open_docs(folder, manifest["rows"])
        try:
            model = load_model(folder, len(docs), mmap=mmap)
        except UserError:
            docs.close()
            raise
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
        """Release the doc store's memory map."""
        self.docs.close()
