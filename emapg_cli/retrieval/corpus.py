"""Corpus files in the FlashRAG layout (`{"id", "contents"}` per JSONL row) and the HotpotQA paragraph converter."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from emapg_cli.data.schema import read_jsonl
from emapg_cli.errors import UserError


def read_corpus(path: Path) -> list[dict[str, str]]:
    """Every row as `{"id", "contents"}`; a row without a non-empty string `contents` is a one-line UserError.

    A row without `id` gets its 0-based row number; ids must be unique.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such corpus file")
    docs, seen = [], set()
    for i, row in enumerate(read_jsonl(path)):
        contents = row.get("contents") if isinstance(row, dict) else None
        if not isinstance(contents, str) or not contents.strip():
            raise UserError(f"{path}: row {i + 1} has no 'contents' string (corpus rows are {{\"id\", \"contents\"}}, "
                            "the first line of contents being the title)")
        doc_id = str(row.get("id", i))
        if doc_id in seen:
            raise UserError(f"{path}: row {i + 1}: duplicate id {doc_id!r}")
        seen.add(doc_id)
        docs.append({"id": doc_id, "contents": contents})
    if not docs:
        raise UserError(f"{path}: the corpus has no rows")
    return docs


def hotpotqa_paragraphs(row: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(title, text) of every context paragraph of one HotpotQA-style row.

    Layouts: IRCoT (`contexts: [{title, paragraph_text}]`), Hugging Face distractor
    (`context: {title: [...], sentences: [[...]]}`) and the original JSON (`context: [[title, [sentences]]]`).
    Sentences are joined with a space.
    """
    if isinstance(row.get("contexts"), list):
        for c in row["contexts"]:
            yield str(c["title"]), str(c["paragraph_text"])
    elif isinstance(row.get("context"), dict):
        ctx = row["context"]
        for title, sents in zip(ctx["title"], ctx["sentences"]):
            yield str(title), " ".join(s.strip() for s in sents)
    elif isinstance(row.get("context"), list):
        for title, sents in row["context"]:
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
