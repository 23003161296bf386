"""The `math` reward: 1.0 when the response's final boxed answer is equivalent to a gold answer."""

from __future__ import annotations

from typing import Optional, Sequence

from emapg_cli.data.schema import Example
from emapg_cli.grading import Gold, MathGrader


class MathReward:
    """Rule-based 0/1 reward via `MathGrader` (its worker pool starts on the first call)."""

    def __init__(self, workers: Optional[int] = None, timeout: float = 5.0, think: str = "emapg") -> None:
        self.grader = MathGrader(workers=workers, timeout=timeout, think=think)

    @property
    def timeouts(self) -> int:
        """Comparisons that ran out of time (scored 0)."""
        return self.grader.timeouts

    def __call__(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        grades = self.grader.grade(responses, [Gold.of(e) for e in examples])
        return [1.0 if g.correct else 0.0 for g in grades]

    def eval_grader(self) -> MathGrader:
        """What `emapg eval` grades with (rewards/graders.py): the same grader, answer by answer
        (extracted boxed answers, strict matches, math-verify equivalence for maj@n)."""
        return self.grader

    def close(self) -> None:
        self.grader.close()
