"""The `exact_match` reward for short-answer QA: SQuAD-style normalised equality with any gold.

Normalisation (Rajpurkar et al. 2016, the SQuAD v1.1 evaluation script): lower-case, remove
punctuation, remove the articles a/an/the, collapse whitespace. The prediction is the final boxed
answer when the response has one, else the content of the last `<answer>...</answer>` tag, else
the whole response after `</think>`.
"""

from __future__ import annotations

import re
import string
from typing import Sequence

from emapg_cli.data.schema import Example
from emapg_cli.grading.extract import answer_region, last_boxed

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_qa(text: str) -> str:
    """SQuAD answer normalisation: lower, strip punctuation and articles, single spaces."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def qa_prediction(response: str, think: str = "emapg") -> str:
    """The answer span of a QA response (boxed, else last <answer> tag, else the final text)."""
    region = answer_region(response, think)
    boxed = last_boxed(region)
    if boxed is not None:
        return boxed
    lower = region.lower()  # find the last <answer>...</answer> with rfind: linear, no backtracking
    end = lower.rfind("</answer>")
    start = lower.rfind("<answer>", 0, end) if end >= 0 else -1
    return region[start + len("<answer>") : end] if start >= 0 else region


def exact_match(response: str, answers: Sequence[str], think: str = "emapg") -> bool:
    """True when the normalised prediction equals any normalised gold answer."""
    pred = normalize_qa(qa_prediction(response, think))
    return any(pred == normalize_qa(a) for a in answers)


class ExactMatchReward:
    """1.0 per response whose prediction exactly matches (normalised) one of its example's answers."""

    def __init__(self, think: str = "emapg") -> None:
        self.think = think

    def __call__(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        return [1.0 if exact_match(r, e.answers, self.think) else 0.0 for r, e in zip(responses, examples)]
