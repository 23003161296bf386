"""Corpus files in the FlashRAG layout (`{"id", "contents"}` per JSONL row) and the HotpotQA paragraph converter."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional

from emapg_cli.data.schema import parse_json_line, read_jsonl
from emapg_cli.errors import UserError


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based row number, raw row) of a JSONL, gzipped JSONL or parquet corpus file, one at a time."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        yield from enumerate(_parquet_rows(path), 1)
    elif name.endswith(".gz"):
        import gzip

        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if line.strip():
                        yield i, parse_json_line(line, f"{path}:{i}")
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: not a readable gzipped JSONL file ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})") from None
    else:
        yield from read_jsonl(path, numbered=True)


def _parquet_rows(path: Path, batch_rows: int = 8192) -> Iterator[dict[str, Any]]:
    """Rows of a parquet corpus (columns `contents` and optionally `id`), read one record batch at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading a parquet corpus needs pyarrow (pip install pyarrow), or convert it to JSONL") from None
    try:
        pf = pq.ParquetFile(path)
        columns = [c for c in ("id", "contents") if c in pf.schema_arrow.names]
        if "contents" not in columns:
            raise UserError(f"{path}: the parquet corpus has no 'contents' column (columns: {', '.join(pf.schema_arrow.names)[:120]})")
        for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
            yield from batch.to_pylist()
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  whatever pyarrow raises on a damaged file
        raise UserError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})") from None


def count_rows(path: Path) -> Optional[int]:
    """The corpus's row count for a progress bar, cheaply: a JSONL file's line count (blank lines included, so an
    upper bound), a parquet file's metadata; None for a gzipped file (it would have to be decompressed twice)."""
    path = Path(path)
    name = path.name.lower()
    if name.endswith(".gz"):
        return None
    if name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        except Exception:  # noqa: BLE001  no pyarrow, a damaged file: iter_corpus says what is wrong
            return None
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def iter_corpus(path: Path) -> Iterator[dict[str, str]]:
    """Stream the corpus rows as `{"id", "contents"}`, one at a time, in file order.

    Layouts: FlashRAG / Search-R1 JSONL (`wiki-18.jsonl`, one `{"id", "contents"}` object a line; `.jsonl.gz`
    read as is) and parquet with the same columns. A row without a non-empty string `contents` is a one-line
    UserError; a row without `id` gets its 0-based row number; ids must be unique. Duplicate ids are found
    with an 8-byte hash per row (not a set of every id) and reported when the file has been read, so a
    consumer must not commit what it built before the iterator is exhausted; an empty corpus is refused then too.
    """
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such corpus file")
    hashes, block = [], []  # blocks of the ids' hashes, int64 [65536] each, and the current one
    for n, (_, row) in enumerate(_rows(path)):
        contents = row.get("contents") if isinstance(row, dict) else None
        if not isinstance(contents, str) or not contents.strip():
            raise UserError(f"{path}: row {n + 1} has no 'contents' string (corpus rows are {{\"id\", \"contents\"}}, "
                            "the first line of contents being the title)")
        doc_id = row.get("id")
        doc_id = str(n if doc_id is None else doc_id)
        block.append(hash(doc_id))
        if len(block) == 65536:
            hashes.append(np.array(block, dtype=np.int64))
            block = []
        yield {"id": doc_id, "contents": contents}
    if not block and not hashes:
        raise UserError(f"{path}: the corpus has no rows")
    hashes.append(np.array(block, dtype=np.int64))
    all_hashes = np.concatenate(hashes)  # int64 [rows]: 8 bytes per row, the one per-row cost of the stream
    hashes.clear()
    _check_unique_ids(path, all_hashes)


def _check_unique_ids(path: Path, hashes) -> None:
    """UserError naming the first repeated id, if any; `hashes` (int64 [rows], the ids' hashes, this function's to
    change) are sorted in place (memory: them and 1 byte per row). Only when two hashes are equal is the file read
    again, for the rows with such a hash, whose ids are compared (a hash collision is no duplicate)."""
    hashes.sort()  # in place: no [rows] index array
    equal = hashes[1:] == hashes[:-1]  # bool [rows - 1]
    if not equal.any():
        return
    repeated = set(hashes[1:][equal].tolist())
    del equal
    first_seen: dict[str, int] = {}
    for n, (_, row) in enumerate(_rows(path)):
        doc_id = row.get("id")
        doc_id = str(n if doc_id is None else doc_id)
        if hash(doc_id) in repeated:
            if doc_id in first_seen:
                raise UserError(f"{path}: row {n + 1}: duplicate id {doc_id!r} (first at row {first_seen[doc_id] + 1})")
            first_seen[doc_id] = n


def hotpotqa_paragraphs(row: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(title, text) of every context paragraph of one HotpotQA-style row.

    Layouts: IRCoT (`contexts: [{title, paragraph_text}]`), Hugging Face distractor
    (`context: {title: [...], sentences: [[...]]}`) and the original JSON (`context: [[title, [sentences]]]`).
    Sentences are joined with a space.
    """
    if isinstance(row.get("contexts"), list):
        for c in row["contexts"]:
            yield str(c["title"]), str(c["paragraph_text"])
    elif isinstance(row.get("context"), (dict, list)):
        ctx = row["context"]
        for title, sents in zip(ctx["title"], ctx["sentences"]) if isinstance(ctx, dict) else ctx:
            yield str(title), " ".join(s.strip() for s in sents)
    else:
        raise KeyError("no 'contexts' or 'context' field")


def paragraph_contents(title: str, text: str) -> str:
    """A paragraph in wiki-18's `contents` layout: the quoted title, a newline, the text."""
    return f'"{title}"\n{text.strip()}'


def hotpotqa_corpus(src: Path) -> tuple[list[dict[str, str]], int]:
    """(corpus rows `{"id", "contents"}`, duplicates dropped) from a HotpotQA-style JSONL file.

    Deduplicated by (title, text) in first-seen order; ids are the 0-based positions.
    """
    src = Path(src)
    if not src.is_file():
        raise UserError(f"{src}: no such file")
    seen: set[tuple[str, str]] = set()
    docs, dups = [], 0
    for i, row in enumerate(read_jsonl(src)):
        try:
            paragraphs = list(hotpotqa_paragraphs(row))
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{src}: row {i + 1} is not a HotpotQA-style row with context paragraphs ({e})") from None
        for title, text in paragraphs:
            key = (title.strip(), " ".join(text.split()))
            if key in seen:
                dups += 1
                continue
            seen.add(key)
            docs.append({"id": str(len(docs)), "contents": paragraph_contents(title.strip(), text)})
    if not docs:
        raise UserError(f"{src}: no paragraphs found")
    return docs, dups
