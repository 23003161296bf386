"""Reward shaping applied after scoring: truncated responses and DAPO's soft overlong penalty.

Pure functions on lists: the trainer and the evaluation call them with each response's token
count and the engine's `finish_reason` ("length" = cut at the token cap). For a search episode both
are per turn (`agents.search.Episode`): the policy's tokens of its last turn, and whether that turn
hit the per-turn cap; an episode that ended unanswered at the turn or context limit is not truncated.
"""

from __future__ import annotations

from typing import Sequence


def is_truncated(finish_reason: str | None) -> bool:
    """A response that hit the token cap (the engines' finish_reason `length`)."""
    return finish_reason == "length"


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13), returned as a value <= 0.

    With L_max = max_tokens and L_cache = buffer:
        0                                      if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache    if L_max - L_cache < |y| <= L_max
        -1                                     if |y| > L_max
    scaled by `penalty`. buffer = 0 turns it off.
    """
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length > max_tokens:
        return -penalty
    return (start - length) / buffer * penalty


def shape_rewards(
    rewards: Sequence[float],
    lengths: Sequence[int],
    finish_reasons: Sequence[str | None],
    *,
    truncated: str = "zero",
    max_tokens: int = 0,
    overlong_buffer: int = 0,
    overlong_penalty_max: float = 1.0,
) -> list[float]:
    """Rewards after the truncation rule (`zero`: a truncated response's reward is 0; `grade`: kept)
    plus the soft overlong penalty."""
    out = []
    for r, n, fr in zip(rewards, lengths, finish_reasons, strict=True):
        if truncated == "zero" and is_truncated(fr):
            r = 0.0
        out.append(r + overlong_penalty(n, max_tokens, overlong_buffer, overlong_penalty_max))
    return out
