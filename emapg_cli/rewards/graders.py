"""How `emapg eval` grades: through the rewards registry, so `--reward` takes exactly what training's
`rollout.reward` takes (a registered name, or a plugin `module:function` / `path/to/file.py:function`).

`get_grader(name, ...)` calls `get_reward` (the one lookup) and grades with what it returns:

* a reward that can grade answer by answer (`math`, `toy`: `MathGrader`; `em`, `f1`: `QAGrader`) says so
  with an `eval_grader()` method: the results keep each extracted answer, and maj@n votes on them;
* any other reward (a plugin, `exact_match`, a name added with `register_reward`) is graded by its score
  alone (`ScoreGrader`), through the same `SafeReward` wrapper and, for a plugin, the same grading
  pool, per-call timeout and error counting as in training.

An eval grader has `grade(responses, examples) -> [grade]` (each with `extracted`, `correct`, `strict`,
and `score` when the reward has partial credit), `equivalent(pairs)`, `vote_key(answer)`, `votes`
(False: no answers, maj@n is not defined), `version`, `timeouts`, `refused`, `pool_stats` and `close()`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from emapg_cli.errors import UserError, first_line
from emapg_cli.rewards.registry import SafeReward, get_reward

#: A response "solves" its item (avg@n, pass@k) when its score reaches this: a 0/1 reward counts its
#: 1s, a partial-credit reward (f1, a plugin's fractions) only full scores, a bonus above 1 still counts.
FULL_SCORE = 1.0


@dataclass(frozen=True)
class ScoreGrade:
    """One response graded by its score alone (the fields of `grading.Grade`, plus the score)."""

    extracted: Optional[str]  # always None: the reward gives no answer to vote on
    correct: bool  # score >= FULL_SCORE
    strict: bool  # same as correct
    score: float  # the reward


class ScoreGrader:
    """Eval grading by a reward's score per response (`SafeReward`: a failure scores 0 and is counted).

    A reward that fails on every response of its first batch (raises, times out, returns no finite
    number) is broken rather than harsh: that is a one-line UserError, raised before any row is written,
    so a rerun after the fix grades every item again.
    """

    votes = False  # no extracted answers: maj@n and maj@n_strict are null
    refused = 0

    def __init__(self, reward: SafeReward) -> None:
        from emapg_cli.rewards.plugin import is_plugin_ref

        self.reward = reward
        self.version = f"plugin {reward.name}" if is_plugin_ref(reward.name) else f"reward {reward.name}"
        self._scored = 0  # responses scored without a failure, over this grader's life

    @property
    def pool_stats(self) -> Any:
        """The plugin pool's counts (zeros for an in-process reward), with the wrapper's own failures as errors."""
        from emapg_cli.grading.pool import PoolStats

        fn = self.reward.fn
        stats = getattr(fn, "stats", None) or PoolStats()
        own = self.reward.errors - int(getattr(fn, "errors", 0))  # items that raised in-process
        return replace(stats, errors=stats.errors + own)

    @property
    def timeouts(self) -> int:
        return self.pool_stats.timeouts

    @staticmethod
    def vote_key(answer: str) -> str:
        return answer

    def equivalent(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        return [a == b for a, b in pairs]

    def grade(self, responses: Sequence[str], examples: Sequence[Any]) -> list[ScoreGrade]:
        from emapg_cli.rewards.plugin import EVAL_MAX_FAILURE_RATE, is_plugin_ref

        before = self.reward.start_count()[1]
        scores = self.reward(responses, examples) if responses else []
        failed = self.reward.errors - before
        if self._scored == 0 and responses and failed >= len(responses):
            last = first_line(Exception(self.reward.last_error)) if self.reward.last_error else "no finite score"
            raise UserError(f"reward '{self.reward.name}' failed on all {len(responses)} responses of the first batch "
                            f"(last error: {last}); nothing was written")
        if responses and is_plugin_ref(self.reward.name) and failed / len(responses) > EVAL_MAX_FAILURE_RATE:
            # training's reward.max_failure_rate, per graded batch (the batches graded before are kept: resumable)
            first = first_line(Exception(self.reward.first_error)) if self.reward.first_error else "no finite score"
            raise UserError(f"reward plugin {self.reward.name} failed on {failed} of {len(responses)} responses of a "
                            f"batch (over {EVAL_MAX_FAILURE_RATE:.0%}); first failure: {first}")
        self._scored += len(responses) - failed
        return [ScoreGrade(None, s >= FULL_SCORE, s >= FULL_SCORE, s) for s in scores]

    def close(self) -> None:
        self.reward.close()

    def __enter__(self) -> "ScoreGrader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def get_grader(name: str, *, think: str = "emapg", workers: Optional[int] = None, timeout: Optional[float] = None,
               memory_mib: Optional[int] = None) -> Any:
    """The eval grader of reward `name` (see the module doc); a context manager that stops its workers.
    `workers` and `timeout` (`--grader-workers`, `--grader-timeout`) size the pool and bound one call; `memory_mib`
    caps a plugin's workers (reward.plugin_memory_mib)."""
    reward = get_reward(name, think=think, workers=workers, timeout=timeout, memory_mib=memory_mib)
    make = getattr(reward.fn, "eval_grader", None)
    return make() if make is not None else ScoreGrader(reward)
