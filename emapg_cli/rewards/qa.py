"""QA rewards of the search agent: `em` (Search-R1's exact match) and `f1` (SQuAD token F1).

The prediction is the content of the last `<answer>...</answer>` in the response — the policy's
own text (`agents.Episode.text`: observations and the prompt, whose example `<answer> Beijing
</answer>` Search-R1 has to discount, are never part of it). No answer scores 0.

  em  Search-R1 `verl/utils/reward_score/qa_em.py`: normalise (lower-case, drop punctuation, drop
      a/an/the, collapse spaces; SQuAD v1.1 order) and score 1 if equal to any normalised gold.
  f1  SQuAD v1.1 token F1 of the normalised strings, the best over the gold answers:
      2 P R / (P + R) with P = common / |pred tokens|, R = common / |gold tokens| (common counts
      multiset overlap).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from emapg_cli.agents.protocol import last_answer
from emapg_cli.data.schema import Example
from emapg_cli.rewards.exact_match import normalize_qa


def em_score(prediction: Optional[str], golds: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer; 0.0 otherwise or without a prediction."""
    if prediction is None:
        return 0.0
    pred = normalize_qa(prediction)
    return 1.0 if any(pred == normalize_qa(g) for g in golds) else 0.0


def f1_score(prediction: Optional[str], golds: Sequence[str]) -> float:
    """Best SQuAD token F1 of the prediction against the gold answers (0.0 without a prediction)."""
    if prediction is None:
        return 0.0
    pred = normalize_qa(prediction).split()
    best = 0.0
    for g in golds:
        gold = normalize_qa(g).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common == 0:
            continue
        p, r = common / len(pred), common / len(gold)
        best = max(best, 2 * p * r / (p + r))
    return best


def em_reward(responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
    """`em` per response (last `<answer>` vs the example's answers)."""
    return [em_score(last_answer(r), e.answers) for r, e in zip(responses, examples)]


def f1_reward(responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
    """`f1` per response (last `<answer>` vs the example's answers)."""
    return [f1_score(last_answer(r), e.answers) for r, e in zip(responses, examples)]



#: reward name -> per-response score of (prediction, golds)
QA_SCORES = {"em": em_score, "f1": f1_score}


@dataclass(frozen=True)
class QAGrade:
    """One graded QA response (the fields of `grading.Grade`, plus the reward itself)."""

    extracted: Optional[str]  # the last <answer>, None without one
    correct: bool  # full score: em = 1, or f1 = 1
    strict: bool  # same as correct
    score: float  # the reward (f1 in [0, 1])


class QAGrader:
    """`emapg eval --reward em|f1`: the `MathGrader` interface (`grade`, `timeouts`, a context manager) for QA."""

    timeouts = refused = 0  # pure string work: nothing times out or is refused

    def __init__(self, reward: str):
        from emapg_cli.grading.pool import PoolStats

        self.score = QA_SCORES[reward]
        self.pool_stats = PoolStats()  # no worker pool: all counts stay 0

    def __enter__(self) -> "QAGrader":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def grade(self, responses: Sequence[str], golds: Sequence) -> list[QAGrade]:
        """Grades in order; `golds` are `grading.Gold`s (their `answers`)."""
        out = []
        for r, gold in zip(responses, golds):
            pred = last_answer(r)
            s = self.score(pred, gold.answers)
            out.append(QAGrade(pred, s >= 1.0, s >= 1.0, s))
        return out
