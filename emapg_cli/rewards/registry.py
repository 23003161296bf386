"""Reward functions by name: `get_reward("math")(responses, examples) -> [0.0 | 1.0, ...]`.

A reward maps a batch of responses (one per example, in order) to floats. Every reward returned by
`get_reward` is wrapped in `SafeReward`: a batch that raises is retried item by item, and an item
that still raises scores 0.0 and is counted in `errors`, so one bad response never stops training.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol, Sequence

from emapg_cli.data.schema import Example
from emapg_cli.errors import UserError

log = logging.getLogger(__name__)


class RewardFn(Protocol):
    def __call__(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]: ...


def _math() -> RewardFn:
    from emapg_cli.rewards.math_reward import MathReward

    return MathReward()


def _exact_match() -> RewardFn:
    from emapg_cli.rewards.exact_match import exact_match_reward

    return exact_match_reward


def _em() -> RewardFn:
    from emapg_cli.rewards.qa import em_reward

    return em_reward


def _f1() -> RewardFn:
    from emapg_cli.rewards.qa import f1_reward

    return f1_reward


#: name -> factory (called once per `get_reward`, so each caller owns its reward's resources).
REWARDS: dict[str, Callable[[], RewardFn]] = {
    "math": _math,
    "exact_match": _exact_match,
    "em": _em,  # search agent: Search-R1 exact match of the last <answer>
    "f1": _f1,  # search agent: SQuAD token F1 of the last <answer>
    "toy": _math,  # the toy task's answers are integers in \boxed{}: maths grading
}


def register_reward(name: str, factory: Callable[[], RewardFn]) -> None:
    """Add (or replace) a reward factory under `name`."""
    REWARDS[name] = factory


class SafeReward:
    """Wraps a reward: exceptions score 0.0 per item and are counted in `errors`."""

    def __init__(self, name: str, fn: RewardFn) -> None:
        self.name, self.fn = name, fn
        self.errors = 0  # items that raised, over this object's life

    def __call__(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        if len(responses) != len(examples):
            raise ValueError(f"reward {self.name}: {len(responses)} responses but {len(examples)} examples")
        try:
            return [float(r) for r in self.fn(responses, examples)]
        except Exception:
            log.warning("reward %s raised on a batch of %d; scoring item by item", self.name, len(responses), exc_info=True)
        out = []
        for response, example in zip(responses, examples):
            try:
                out.append(float(self.fn([response], [example])[0]))
            except Exception:
                self.errors += 1
                out.append(0.0)
        return out

    def close(self) -> None:
        """Release the reward's resources (a grading pool), if it has any."""
        close = getattr(self.fn, "close", None)
        if close is not None:
            close()


def get_reward(name: str) -> SafeReward:
    """The reward registered as `name`; an unknown name is a UserError listing the known ones."""
    if name not in REWARDS:
        raise UserError(f"unknown reward '{name}' (known: {', '.join(sorted(REWARDS))})")
    return SafeReward(name, REWARDS[name]())
