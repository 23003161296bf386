"""The trainer's glue for train.objective distill / rl+distill (docs/distill.md): the evaluations at step 0. The
loss is chosen in train/settings.py (`grpo.distill.distill_estimator`), the rewards skipped in train/rollout_phase.py."""

from __future__ import annotations

from typing import Callable

#: The metric of the teacher's (the anchor's) accuracy, measured once, at step 0.
TEACHER_KEY = "eval/teacher_accuracy"


def initial_evaluations(evaluate: Callable[..., dict[str, float]], policy, anchor, objective: str,
                        state: dict) -> dict[str, float]:
    """Step 0's evaluations by `evaluate(model, step, key=...)` (`Trainer._eval`): the policy's accuracy
    (`eval/accuracy`) and, when the run distils (`objective` not rl), the teacher's: the `anchor`'s accuracy on the
    same evaluation set with the same settings, kept in the run's `state` as `teacher_accuracy` (summary.json).
    With an EMA anchor (not a teacher) the anchor starts as the policy, so the two agree."""
    row = evaluate(policy, 0)
    if objective != "rl" and anchor is not None:
        row.update(evaluate(anchor, 0, TEACHER_KEY))
        state["teacher_accuracy"] = row[TEACHER_KEY]
    return row
