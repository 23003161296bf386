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

from emapg_cli.data.schema import Example
from emapg_cli.grading.extract import last_answer
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


#: reward name -> per-response score of (prediction, golds)
QA_SCORES = {"em": em_score, "f1": f1_score}


class QAReward:
    """The registered `em` / `f1` reward: `em_score` / `f1_score` of each response's last `<answer>` against its
    example's answers; `emapg eval` grades it answer by answer with `QAGrader` (extracted answers, maj@n votes)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        return [QA_SCORES[self.kind](last_answer(r), e.answers) for r, e in zip(responses, examples)]

    def eval_grader(self) -> "QAGrader":
        return QAGrader(self.kind)


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
    votes = True  # extracted answers vote (maj@n)

    def __init__(self, reward: str):
        from emapg_cli.grading.pool import PoolStats

        self.score = QA_SCORES[reward]
        self.version = f"rewards.qa.{reward}"  # summary.json's grader_version
        self.pool_stats = PoolStats()  # no worker pool: all counts stay 0

    def __enter__(self) -> "QAGrader":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def close(self) -> None:
        return None

    @staticmethod
    def vote_key(answer: str) -> str:
        """maj@n's vote of an answer: Search-R1's normalisation (equal keys are the same answer)."""
        return normalize_qa(answer)

    def equivalent(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """maj@n's equivalence of two answers: equal normalised strings (votes are already normalised)."""
        return [self.vote_key(a) == self.vote_key(b) for a, b in pairs]

    def grade(self, responses: Sequence[str], golds: Sequence) -> list[QAGrade]:
        """Grades in order; `golds` are `grading.Gold`s or `Example`s (their `answers`)."""
        out = []
        for r, gold in zip(responses, golds):
            pred = last_answer(r)
            s = self.score(pred, gold.answers)
            out.append(QAGrade(pred, s >= 1.0, s >= 1.0, s))
        return out
