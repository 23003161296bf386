"""The `reasoning-gym` reward: reasoning-gym's own answer extraction and its task's own scorer.

For a response r to a row prepared by `emapg prepare reasoning-gym:TASK` (datasets/reasoning_gym_data.py):

    answer = reasoning_gym.utils.extract_answer(r)     # the last <answer>...</answer>, stripped; None without one
    score  = dataset.score_answer(answer, entry)       # the task's scorer, on the entry the row's meta rebuilds

The score is kept as reasoning-gym returns it: a float, with partial credit where the task gives some (most
tasks give 1.0 for the exact answer, 0.0 for none, and some a fraction for a near miss). A response counts as
solved when its score is >= 1 (`solved`): in `emapg eval` (`rewards.graders.FULL_SCORE`, every score kept in its
results rows) and in training's eval/accuracy.
A row without a reasoning-gym entry in its meta, or whose entry no longer rebuilds (another reasoning-gym
version), raises: `SafeReward` scores it 0 and counts it in reward/errors (and `emapg eval` stops with one
line when a whole first batch fails).
"""

from __future__ import annotations

from typing import Optional, Sequence

from emapg_cli.data.schema import Example


def extract(response: str) -> Optional[str]:
    """reasoning-gym's `extract_answer`: the content of the last <answer>...</answer>, None without one."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(response)


def score_one(response: str, example: Example) -> float:
    """The task's `score_answer(extract_answer(response), entry)` for the entry `example.meta` rebuilds."""
    from emapg_cli.datasets.reasoning_gym_data import entry_of

    dataset, entry = entry_of(example.meta)
    return float(dataset.score_answer(extract(response), entry))


class ReasoningGymReward:
    """The registered `reasoning-gym` reward (batch in, one float per response out)."""

    def __init__(self) -> None:
        from emapg_cli.datasets.reasoning_gym_data import library

        library()  # one line naming the extra when reasoning-gym is not installed, before any work

    def __call__(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        return [score_one(r, e) for r, e in zip(responses, examples)]

    @staticmethod
    def solved(score: float) -> bool:
        """A full score (partial credit is not a solve): training's eval/accuracy counts what `emapg eval` counts
        (rewards.graders.FULL_SCORE)."""
        return score >= 1.0
