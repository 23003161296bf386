"""The `reasoning-gym` reward: reasoning-gym's own answer extraction and its task's own scorer.

For a response r to a row prepared by `emapg prepare reasoning-gym:TASK` (datasets/reasoning_gym_data.py):

    answer = reasoning_gym.utils.extract_answer(r[-MAX_RESPONSE_CHARS:])  # the last <answer>...</answer>, stripped
    score  = dataset.score_answer(answer, entry)       # the task's scorer, on the entry the row's meta rebuilds

The score is kept as reasoning-gym returns it: a float, with partial credit where the task gives some (most
tasks give 1.0 for the exact answer, 0.0 for none, and some a fraction for a near miss). A response counts as
solved when its score is >= 1 (`solved`): in `emapg eval` (`rewards.graders.FULL_SCORE`, every score kept in its
results rows) and in training's eval/accuracy.

Some scorers `eval` the answer (spiral_matrix, string_insertion, binary_matrix, n_queens), and extract_answer is
quadratic in the response: model output reaches them only in the grading pool's workers (`PooledReward`, as a
reward plugin), each under reward.plugin_memory_mib, with the per-call time limit (`--grader-timeout`, 5 s), in an
empty private working folder that is deleted when the reward closes; only the response's last MAX_RESPONSE_CHARS
characters are sent. A call that raises, hangs or kills its worker scores 0 and is counted (reward/errors, and
reward/timeouts for those cut at the limit; `emapg eval`'s grader_errors, grader_timeouts): a row without a
reasoning-gym entry in its meta, or whose entry no longer rebuilds (another reasoning-gym version), too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any, Optional, Sequence

from emapg_cli.rewards.plugin import PLUGIN_MEMORY_MIB, PLUGIN_TIMEOUT, PooledReward

#: The characters of a response a scorer sees (its end, where the last <answer> is): extract_answer is quadratic.
MAX_RESPONSE_CHARS = 16384


def score_task(response: str, meta: dict[str, Any]) -> float:
    """In a worker: the task's `score_answer(extract_answer(response), entry)` for the entry `meta` rebuilds."""
    from reasoning_gym.utils import extract_answer

    from emapg_cli.datasets.reasoning_gym_data import entry_of

    dataset, entry = entry_of(meta)
    return float(dataset.score_answer(extract_answer(response), entry))


def warm_up(folder: str) -> None:
    """In a new worker: import reasoning-gym and work in the reward's empty private folder."""
    import reasoning_gym.utils  # noqa: F401

    os.chdir(folder)


class ReasoningGymReward(PooledReward):
    """The registered `reasoning-gym` reward (batch in, one float per response out), over the grading pool."""

    label = "reward reasoning-gym"

    def __init__(self, workers: Optional[int] = None, timeout: float = PLUGIN_TIMEOUT, memory_mib: int = PLUGIN_MEMORY_MIB) -> None:
        from emapg_cli.datasets.reasoning_gym_data import library

        library()  # one line naming the extra when reasoning-gym is not installed, before any work
        self.folder = tempfile.mkdtemp(prefix="emapg-scorer-")
        # removed by close(), else when the reward is collected or the interpreter exits (a reward nobody closes, as in
        # a one-off `get_reward("reasoning-gym")`, left its empty folder in the temp dir)
        self._remove_folder = weakref.finalize(self, shutil.rmtree, self.folder, True)
        super().__init__(score_task, warm_up, (self.folder,), workers, timeout, memory_mib)

    def tasks(self, responses: Sequence[str], examples: Sequence[Any]) -> list[tuple]:
        return [(r[-MAX_RESPONSE_CHARS:], e.meta) for r, e in zip(responses, examples)]

    def close(self) -> None:
        super().close()
        self._remove_folder()

    @staticmethod
    def solved(score: float) -> bool:
        """A full score (partial credit is not a solve): training's eval/accuracy counts what `emapg eval` counts
        (rewards.graders.FULL_SCORE)."""
        return score >= 1.0
