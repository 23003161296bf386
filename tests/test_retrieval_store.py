"""Streaming corpus reading (`retrieval.corpus.iter_corpus`) and the memory-mapped doc store (`retrieval.docstore`)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from emapg_cli.errors import UserError
from emapg_cli.retrieval.corpus import iter_corpus, read_corpus
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
    assert list(iter_corpus(gz)) == read_corpus(path)


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
