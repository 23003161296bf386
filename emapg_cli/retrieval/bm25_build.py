"""A bm25s index built by streaming the corpus in chunks, in bounded memory, written in bm25s's own saved layout.

bm25s's `BM25.index` holds every document's tokens and the whole (doc, term, score) triple list in memory, then
sorts it (`build_index_from_ids`, `_np_csc_python`): fine for 10^4 passages, not for wiki-18's 2·10^7. This module
computes the same matrix in two passes, with no bm25s import (bm25.py hands it bm25s's tokenizer and scoring
functions, so the tokens, idf and term-frequency formulas are bm25s's own):

1. Per chunk of rows: tokenise (bm25s.tokenize, ids per chunk), map the chunk's token ids to global term ids
   (first-occurrence order), count each (doc, term) pair's term frequency, add to the document frequencies
   df[term] and write the doc lengths |d| (tokens, repeats included) to a file. The (term, doc, tf) triples go to
   one of B spill files by `term % B` (in doc order within each file, as the chunks come in doc order).
2. Final term ids put bucket b's terms in one contiguous range (`final = start[b] + term // B`), so the CSC
   matrix is written one bucket at a time, sequentially: read a spill file, stable-sort it by term id
   (doc order kept within a term, as bm25s's (column, row) sort gives), score it a slice at a time, append to
   `data` and `indices`.

Scores (bm25s 0.3.16, `_build_scores_and_indices_for_matrix`, method "lucene" = Lucene's BM25, Kamphuis et al.
2020): score(t, d) = float32( idf(t) · tf / (k1 · ((1 - b) + b · |d| / avgdl) + tf) ), idf(t) = float32(
log(1 + (N - df + 0.5) / (df + 0.5))), tf as float32, avgdl the float64 mean of |d| over all N documents. The
same numpy operations in the same order and dtypes as bm25s's per-document loop, so the arrays are bit-identical
to an in-memory build up to the order of the term ids (which bm25s takes from a Python set: arbitrary).

Memory: the vocabulary dict (term -> id) and df, plus one chunk's tokens in pass 1; one spill bucket (about
32 B per pair: the records, their sort order, the sorted copy), one slice's temporaries and the per-term arrays
in pass 2. Documents never stay in memory (the caller streams them to the doc store).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

#: The spill record: global term id (first-occurrence order), document row, term frequency.
SPILL = np.dtype([("term", "<i4"), ("doc", "<i4"), ("tf", "<i4")])
#: bm25s's saved file names (BM25.save defaults).
DATA, INDICES, INDPTR = "data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy"
VOCAB, PARAMS = "vocab.index.json", "params.index.json"
#: Pairs scored at a time in pass 2 (its float64 temporaries are a few times this many 8-byte values).
SCORE_SLICE = 1 << 20


class NoTokens(ValueError):
    """No document of the corpus has a token (every word a stop word or punctuation)."""


@dataclass(frozen=True)
class Scoring:
    """bm25s's scoring pieces: `idf(df, N)`, `tfc(tf_array, l_d, l_avg, k1, b, delta)` and the saved params
    (k1, b, delta, method, idf_method, dtype, int_dtype, version, backend: BM25.save's keys but num_docs)."""

    idf: Callable
    tfc: Callable
    params: dict


class Counts:
    """Pass 1: the vocabulary, document frequencies, doc lengths and spill files of the chunks seen so far."""

    def __init__(self, work: Path, buckets: int):
        self.work, self.buckets = Path(work), buckets
        self.vocab: dict[str, int] = {}  # token -> global id, in first-occurrence order
        self.df = np.zeros(1024, dtype=np.int64)  # [capacity >= len(vocab)]
        self.docs, self.tokens = 0, 0  # rows and tokens (|d| summed) so far
        self._lengths = open(self.work / "lengths.i4", "wb")
        self._spill = [open(self.work / f"spill-{b:03d}.bin", "wb") for b in range(buckets)]

    def add(self, ids: list[list[int]], local_vocab: dict[str, int]) -> None:
        """One chunk: `ids` the token ids of each of its documents (bm25s.tokenize, return_ids), `local_vocab`
        the chunk's token -> id map (ids 0..n-1 in insertion order)."""
        vocab = self.vocab
        to_global = np.fromiter((vocab.setdefault(t, len(vocab)) for t in local_vocab), np.int64, len(local_vocab))
        lens = np.fromiter(map(len, ids), np.int64, len(ids))  # |d| of each document [n]
        flat = np.fromiter(chain.from_iterable(ids), np.int64, int(lens.sum()))  # [tokens]
        local_doc = np.repeat(np.arange(len(ids), dtype=np.int64), lens)  # [tokens]
        pairs, tf = np.unique((local_doc << 32) | to_global[flat], return_counts=True)  # sorted by (doc, term)
        term = pairs & 0xFFFFFFFF  # [pairs]
        if len(vocab) > len(self.df):
            self.df = np.concatenate([self.df, np.zeros(max(len(vocab), 2 * len(self.df)) - len(self.df), np.int64)])
        self.df[:len(vocab)] += np.bincount(term, minlength=len(vocab))  # each pair is one document holding the term
        rec = np.empty(len(pairs), SPILL)
        rec["term"], rec["doc"], rec["tf"] = term, self.docs + (pairs >> 32), tf
        bucket = term % self.buckets
        order = np.argsort(bucket, kind="stable")  # doc order kept within each bucket
        bounds = np.searchsorted(bucket[order], np.arange(self.buckets + 1))
        for b in range(self.buckets):
            if bounds[b] < bounds[b + 1]:
                self._spill[b].write(rec[order[bounds[b]:bounds[b + 1]]].tobytes())
        self._lengths.write(lens.astype("<i4").tobytes())
        self.docs += len(ids)
        self.tokens += int(lens.sum())

    def close(self) -> None:
        for f in [self._lengths, *self._spill]:
            f.close()


def final_ids(n_terms: int, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """(final id of each global id [n_terms], start of each bucket's range [buckets + 1]).

    Bucket b = {g : g % B == b} holds ceil((V - b) / B) terms; its terms get ids start[b] + g // B, in g order.
    E.g. V = 5, B = 2: bucket 0 = {0, 2, 4} -> 0, 1, 2; bucket 1 = {1, 3} -> 3, 4."""
    sizes = np.array([max(0, (n_terms - b + buckets - 1) // buckets) for b in range(buckets)], dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(sizes)])
    g = np.arange(n_terms, dtype=np.int64)
    return start[g % buckets] + g // buckets, start


def _npy_writer(path: Path, dtype: str, n: int):
    """An open file with the .npy header of a 1-D array of `n` `dtype` values written; the caller appends the data."""
    f = open(path, "wb")
    np.lib.format.write_array_header_1_0(f, {"descr": dtype, "fortran_order": False, "shape": (n,)})
    return f


def _write_vocab(path: Path, vocab: dict[str, int], final: np.ndarray, batch: int = 65536) -> None:
    """vocab.index.json: {token: final id, ..., "": V} (bm25s adds the empty token one past the last column),
    written in batches of `batch` terms (no string of the whole vocabulary)."""
    tokens = iter(vocab)  # insertion order: global id g = position
    with open(path, "w", encoding="utf-8") as f:
        f.write("{")
        for s in range(0, len(vocab), batch):
            ids = final[s:s + batch].tolist()
            f.write(json.dumps(dict(zip(islice(tokens, len(ids)), ids)), ensure_ascii=False)[1:-1] + ", ")
        f.write(f'"": {len(vocab)}}}')


def write_matrix(counts: Counts, out: Path, scoring: Scoring) -> int:
    """Pass 2: write bm25s's saved files into `out` (a new folder) from `counts`; returns the non-zero count."""
    n_docs, n_terms, B = counts.docs, len(counts.vocab), counts.buckets
    final, start = final_ids(n_terms, B)
    out.mkdir()
    _write_vocab(out / VOCAB, counts.vocab, final)
    counts.vocab.clear()  # its memory is the largest part of the peak: free it before the matrix pass
    df = np.zeros(n_terms, dtype=np.int64)
    df[final] = counts.df[:n_terms]  # [V] by final id
    uniq, inverse = np.unique(df, return_inverse=True)  # idf depends on df only: one call per distinct df
    idf = np.array([scoring.idf(int(d), N=n_docs) for d in uniq], dtype=np.float64).astype(np.float32)[inverse]  # [V]
    indptr = np.zeros(n_terms + 1, dtype=np.int64)
    np.cumsum(df, out=indptr[1:])
    nnz = int(indptr[-1])
    np.save(out / INDPTR, indptr)
    avgdl = np.float64(counts.tokens) / n_docs  # = bm25s's np.mean of the int lengths (an exact integer sum, / N)
    lengths = np.memmap(counts.work / "lengths.i4", dtype="<i4", mode="r") if n_docs else np.zeros(0, "<i4")
    p = scoring.params
    written = 0
    with _npy_writer(out / DATA, "<f4", nnz) as fd, _npy_writer(out / INDICES, "<i4", nnz) as fi:
        for b in range(B):
            rec = np.fromfile(counts.work / f"spill-{b:03d}.bin", dtype=SPILL)  # [pairs of bucket b]
            # within bucket b, final id = start[b] + term // B increases with term: sorting by term sorts by final
            # id; stable, so doc order is kept within a term (CSC)
            rec = rec[np.argsort(rec["term"], kind="stable")]
            for s in range(0, len(rec), SCORE_SLICE):  # scored a slice at a time: bounded temporaries
                part = rec[s:s + SCORE_SLICE]
                term = start[b] + part["term"].astype(np.int64) // B  # final ids [slice]
                l_d = lengths[part["doc"]].astype(np.int64)  # |d| per pair
                tfc = scoring.tfc(tf_array=part["tf"].astype(np.float32), l_d=l_d, l_avg=avgdl, k1=p["k1"], b=p["b"], delta=p["delta"])
                fd.write((idf[term] * tfc).astype(np.float32).tobytes())  # float32(float32 idf x float64 tfc), as bm25s
                fi.write(part["doc"].astype("<i4").tobytes())
            written += len(rec)
            del rec
            (counts.work / f"spill-{b:03d}.bin").unlink()
    if written != nnz:
        raise RuntimeError(f"bm25 build wrote {written} scores, the document frequencies sum to {nnz}")
    with open(out / PARAMS, "w") as f:
        json.dump({**{k: p[k] for k in ("k1", "b", "delta", "method", "idf_method", "dtype", "int_dtype")},
                   "num_docs": n_docs, "version": p["version"], "backend": p["backend"]}, f, indent=4)
    return nnz


def default_buckets(corpus_bytes: int) -> int:
    """Spill files: one per 16 MiB of corpus text (a bucket then holds ~1.8M pairs, ~22 MiB of spill), 1 to 512
    (open files)."""
    return int(min(512, max(1, corpus_bytes // (16 << 20) + 1)))


def build_matrix(texts: Iterable[list[str]], out: Path, work: Path, tokenize: Callable, scoring: Scoring,
                 buckets: int, advance: Optional[Callable[[int], None]] = None) -> tuple[int, int, int]:
    """bm25s's saved index of the documents in `texts` (chunks of strings, in row order) written to the new folder
    `out`, spill files in the existing folder `work`; returns (documents, terms, non-zeros).
    `tokenize(list[str]) -> (ids per text, token -> id)`. A corpus without one token raises NoTokens."""
    counts = Counts(work, buckets)
    try:
        for chunk in texts:
            ids, local_vocab = tokenize(chunk)
            counts.add(ids, local_vocab)
            if advance:
                advance(len(chunk))
    finally:
        counts.close()
    n_terms = len(counts.vocab)
    if not n_terms:
        raise NoTokens("no token")
    nnz = write_matrix(counts, out, scoring)
    os.remove(work / "lengths.i4")
    return counts.docs, n_terms, nnz
