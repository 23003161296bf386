"""Streaming corpus reading (`retrieval.corpus.iter_corpus`) and the memory-mapped doc store (`retrieval.docstore`)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from emapg_cli.errors import UserError
from emapg_cli.retrieval.corpus import iter_corpus
from emapg_cli.retrieval.docstore import DOCS_BIN, OFFSETS, DocStore, write_docstore


def _write(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_iter_corpus_streams_rows_and_numbers_missing_ids(tmp_path):
    path = _write(tmp_path / "c.jsonl", [{"id": 7, "contents": "A\na"}, {"contents": "B\nb", "extra": 1}])
    rows = iter_corpus(path)
    assert next(rows) == {"id": "7", "contents": "A\na"}  # one row at a time: nothing read past the first yet
    assert list(rows) == [{"id": "1", "contents": "B\nb"}]  # no id: its 0-based row number; other keys dropped
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert list(iter_corpus(gz)) == list(iter_corpus(path))


@pytest.mark.parametrize("text, needle", [
    ('{"id": "a", "contents": "x"}\n{"id": "b"}\n', "row 2 has no 'contents' string"),
    ('{"id": "a", "contents": "x"}\n{"id": "b", "contents": "y"}\n{"id": "a", "contents": "z"}\n',
     "row 3: duplicate id 'a' (first at row 1)"),
    ('{"contents": "x"}\n{"id": "0", "contents": "y"}\n', "row 2: duplicate id '0' (first at row 1)"),  # "0" = row 1's number
    ("\n\n", "the corpus has no rows"),
])
def test_iter_corpus_errors_are_one_line(tmp_path, text, needle):
    path = tmp_path / "c.jsonl"
    path.write_text(text)
    with pytest.raises(UserError, match=r"c\.jsonl: ") as e:
        list(iter_corpus(path))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_iter_corpus_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": ["x", "y"], "contents": ["T\none", "U\ntwo"], "other": [1, 2]}), path)
    assert list(iter_corpus(path)) == [{"id": "x", "contents": "T\none"}, {"id": "y", "contents": "U\ntwo"}]


def test_docstore_round_trip_and_offsets(tmp_path):
    rows = [{"id": "a", "contents": "T\nx"}, {"id": "b", "contents": "é\n"}, {"id": "c", "contents": "z", "extra": 1}]
    assert write_docstore(iter(rows), tmp_path) == 3
    # a line is json.dumps(row) + "\n": `{"id": "a", "contents": ` is 24 bytes, then the quoted value, "}", "\n".
    # a: "T\nx" = 6 bytes (the newline escaped as 2) -> 24 + 6 + 2 = 32; b: "é\n" = 6 bytes (é is 2 in UTF-8) -> 32;
    # c: "z" = 3 -> 29.  Offsets: 0, 32, 64, 93.
    assert np.load(tmp_path / OFFSETS).tolist() == [0, 32, 64, 93]
    assert sorted(p.name for p in tmp_path.iterdir()) == [DOCS_BIN, OFFSETS]  # no temporary file left
    store = DocStore.open(tmp_path)
    assert len(store) == 3 and store[1] == rows[1] and store[-1] == {"id": "c", "contents": "z"}
    assert store.get_many([2, 0]) == [{"id": "c", "contents": "z"}, rows[0]]
    with pytest.raises(IndexError):
        store[3]
    store.close()


def test_docstore_write_is_atomic_and_open_checks(tmp_path):
    def rows():
        yield {"id": "a", "contents": "x"}
        raise UserError("row 2 is bad")

    with pytest.raises(UserError, match="row 2 is bad"):
        write_docstore(rows(), tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    write_docstore([{"id": "a", "contents": "x"}], tmp_path)
    (tmp_path / DOCS_BIN).write_bytes(b'{"id": "a", "contents": "x"}\nmore')
    with pytest.raises(UserError, match=r"docs.offsets.npy ends at byte 29, docs.bin has 33 bytes"):
        DocStore.open(tmp_path)
    (tmp_path / DOCS_BIN).unlink()
    with pytest.raises(UserError, match="docs.bin is missing"):
        DocStore.open(tmp_path)


# ------------------------------------------------------------------------------- the streamed bm25 index
def _bm25s_in_memory(texts):
    """bm25s's own in-memory index of `texts` (what `build_index` built before it streamed)."""
    bm25s = pytest.importorskip("bm25s")
    from emapg_cli.retrieval.bm25 import _tokens

    model = bm25s.BM25()
    model.index(_tokens(texts), show_progress=False)
    return model


def _same_hits(model, retriever, queries, k):
    """Same top-k ids and float32 scores, and the same score matrix: each term's column (its documents and scores)
    bit-equal, the term ids mapped through the two vocabularies (bm25s numbers terms in a Python set's order)."""
    from emapg_cli.retrieval.bm25 import _tokens

    a, b = model.scores, retriever.model.scores
    assert set(model.vocab_dict) == set(retriever.model.vocab_dict) and a["num_docs"] == b["num_docs"]
    for token, i in model.vocab_dict.items():
        j = retriever.model.vocab_dict[token]
        if token:  # "" is one id past the last column in both
            sa, sb = slice(a["indptr"][i], a["indptr"][i + 1]), slice(b["indptr"][j], b["indptr"][j + 1])
            assert a["indices"][sa].tolist() == b["indices"][sb].tolist() and a["data"][sa].tobytes() == b["data"][sb].tobytes(), token

    ids_a, scores_a = model.retrieve(_tokens(queries), k=k, show_progress=False)  # [n, k] each
    ids_b, scores_b = retriever.model.retrieve(_tokens(queries), k=k, show_progress=False)
    assert ids_a.tolist() == ids_b.tolist()
    assert scores_a.dtype == scores_b.dtype == np.float32 and scores_a.tolist() == scores_b.tolist()  # bit-equal


def test_streamed_index_scores_equal_bm25s_in_memory(tmp_path, monkeypatch):
    """Chunks of 2 rows, 3 spill buckets scored 2 pairs at a time; repeated documents and documents with no token
    after stop words. 17 tokens in 9 documents: avgdl = 17/9, not a float32 (a build that rounded it to float32
    would differ in some scores)."""
    from emapg_cli.retrieval import bm25_build
    from emapg_cli.retrieval.bm25 import FORMAT, BM25Retriever, build_index

    monkeypatch.setattr(bm25_build, "SCORE_SLICE", 2)

    texts = ["A\nalpha beta", "B\nalpha", "C\nthe of and", "D\nalpha beta", "E\ngamma gamma alpha delta",
             "F\n", "G\nbeta beta beta delta", "H\nalpha beta", "I\nalpha gamma"]
    rows = [{"id": f"r{i}", "contents": t} for i, t in enumerate(texts)]
    rows[5]["contents"] = "F\n..."  # contents must be non-blank; "F" and "..." hold no token (\w\w+)
    texts[5] = rows[5]["contents"]
    corpus = _write(tmp_path / "c.jsonl", rows)
    manifest = build_index(corpus, tmp_path / "idx", chunk=2, buckets=3)
    assert manifest["format"] == FORMAT == "emapg-bm25/3" and manifest["rows"] == 9
    assert {"docs.bin", "docs.offsets.npy", "bm25/data.csc.index.npy", "bm25/vocab.index.json"} <= set(manifest["files"])
    retriever = BM25Retriever.load(tmp_path / "idx")
    assert isinstance(retriever.model.scores["data"], np.memmap) and isinstance(retriever.docs, DocStore)
    _same_hits(_bm25s_in_memory(texts), retriever, ["alpha", "beta delta", "gamma", "alpha beta gamma delta", "zeta", "the"], k=9)
    retriever.close()


def test_streamed_index_hand_computed_scores(tmp_path):
    """BM25 (Lucene variant, k1 = 1.5, b = 0.75) over d0 = "alpha beta" (|d| = 2) and d1 = "alpha" (|d| = 1): N = 2,
    avgdl = 1.5. idf(alpha) = ln(1 + (2 - 2 + .5)/(2 + .5)) = ln 1.2 = 0.182322; idf(beta) = ln(1 + 1.5/1.5) = ln 2.
    tf part = tf / (k1 (0.25 + 0.75 |d| / 1.5) + tf): d0: 1 / (1.5 x 1.25 + 1) = 1/2.875; d1: 1 / (1.5 x 0.75 + 1) = 1/2.125.
    "alpha": d1 0.182322/2.125 = 0.085798, d0 0.182322/2.875 = 0.063416; "beta": d0 0.693147/2.875 = 0.241095."""
    from emapg_cli.retrieval.bm25 import BM25Retriever, build_index

    build_index(_write(tmp_path / "c.jsonl", [{"id": "d0", "contents": "T\nalpha beta"}, {"id": "d1", "contents": "U\nalpha"}]),
                tmp_path / "idx", chunk=1, buckets=2)
    retriever = BM25Retriever.load(tmp_path / "idx")
    (a1, a0), (b0,) = retriever.search(["alpha"], 2)[0], retriever.search(["beta"], 1)[0]
    assert (a1.id, a0.id, b0.id) == ("d1", "d0", "d0")
    assert [round(h.score, 6) for h in (a1, a0, b0)] == [0.085798, 0.063416, 0.241095]


def test_streamed_index_equals_bm25s_on_the_toy_search_corpus(tmp_path):
    from emapg_cli.retrieval.bm25 import BM25Retriever, build_index
    from emapg_cli.tasks.toy_search.prepare import SIZES
    from emapg_cli.tasks.toy_search.task import make_world

    rows = list(make_world(0, SIZES).corpus())
    build_index(_write(tmp_path / "c.jsonl", rows), tmp_path / "idx", chunk=97, buckets=5)
    retriever = BM25Retriever.load(tmp_path / "idx")
    queries = [r["contents"].split("\n")[0] for r in rows[::37]] + [r["contents"][-40:] for r in rows[::53]]
    _same_hits(_bm25s_in_memory([r["contents"] for r in rows]), retriever, queries, k=5)


def test_vocab_file_and_final_ids(tmp_path):
    from emapg_cli.retrieval.bm25_build import _write_vocab, final_ids

    final, start = final_ids(5, 2)  # bucket 0 = {0, 2, 4} -> 0, 1, 2; bucket 1 = {1, 3} -> 3, 4
    assert final.tolist() == [0, 3, 1, 4, 2] and start.tolist() == [0, 3, 5]
    _write_vocab(tmp_path / "v.json", {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4}, final, batch=2)  # batches of 2, 2, 1
    assert json.loads((tmp_path / "v.json").read_text()) == {"a": 0, "b": 3, "c": 1, "d": 4, "e": 2, "": 5}


def test_chunk_rows_default_is_the_constant():
    import inspect

    from emapg_cli.cli import retriever_cmd
    from emapg_cli.retrieval.bm25 import DEFAULT_CHUNK_ROWS

    assert inspect.signature(retriever_cmd.index).parameters["chunk_rows"].default == DEFAULT_CHUNK_ROWS == 10_000
