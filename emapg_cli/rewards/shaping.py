"""Reward shaping applied after scoring: truncated responses.

Pure functions on lists: the trainer and the evaluation call them with the engine's `finish_reason`
of each response ("length" = cut at the token cap). For a search episode it is per turn
(`agents.search.Episode`): whether its last turn hit the per-turn cap; an episode that ended unanswered
at the turn or context limit is not truncated.
"""

from __future__ import annotations

from typing import Sequence


def is_truncated(finish_reason: str | None) -> bool:
    """A response that hit the token cap (the engines' finish_reason `length`)."""
    return finish_reason == "length"


def shape_rewards(rewards: Sequence[float], finish_reasons: Sequence[str | None], *, truncated: str = "zero") -> list[float]:
    """Rewards after the truncation rule (`zero`: a truncated response's reward is 0; `grade`: kept)."""
    return [0.0 if truncated == "zero" and is_truncated(fr) else r for r, fr in zip(rewards, finish_reasons, strict=True)]
