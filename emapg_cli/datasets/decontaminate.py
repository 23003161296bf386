"""Find training items that overlap evaluation items: exact (normalised) and n-gram matches.

Exact: the questions are equal after lower-casing and collapsing whitespace. N-gram: the two
questions share at least one run of `n` consecutive words (13 by default, as in the GPT-3 paper's
contamination analysis); questions shorter than `n` words are only checked exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from emapg_cli.data.schema import Example

_WORD = re.compile(r"\w+")


def question_key(text: str) -> str:
    """The normalised question used for exact matching and deduplication."""
    return " ".join(text.lower().split())


def ngrams(text: str, n: int) -> Iterator[tuple[str, ...]]:
    """Every run of `n` consecutive lower-cased words of `text`."""
    words = _WORD.findall(text.lower())
    for i in range(len(words) - n + 1):
        yield tuple(words[i : i + n])


@dataclass(frozen=True)
class Overlap:
    train_id: str
    eval_set: str
    eval_id: str
    kind: str  # "exact" or "ngram"


def find_overlaps(train: Sequence[Example], evals: dict[str, Iterable[Example]], n: int = 13) -> list[Overlap]:
    """One Overlap per training item that matches an evaluation item (exact matches reported first)."""
    exact: dict[str, tuple[str, str]] = {}
    grams: dict[tuple[str, ...], tuple[str, str]] = {}
    for name, items in evals.items():
        for ex in items:
            exact.setdefault(question_key(ex.question), (name, ex.id))
            for g in ngrams(ex.question, n):
                grams.setdefault(g, (name, ex.id))
    out = []
    for ex in train:
        hit = exact.get(question_key(ex.question))
        if hit is not None:
            out.append(Overlap(ex.id, hit[0], hit[1], "exact"))
            continue
        hit = next((grams[g] for g in ngrams(ex.question, n) if g in grams), None)
        if hit is not None:
            out.append(Overlap(ex.id, hit[0], hit[1], "ngram"))
    return out
