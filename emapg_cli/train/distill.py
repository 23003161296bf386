"""The trainer's glue for train.objective distill / rl+distill (docs/distill.md): the evaluations at step 0. The
loss is chosen in train/settings.py (`grpo.distill.distill_estimator`), the rewards skipped in train/rollouts.py."""

from __future__ import annotations

#: The metric of the teacher's (the anchor's) accuracy, measured once, at step 0.
TEACHER_KEY = "eval/teacher_accuracy"


def initial_evaluations(trainer) -> dict[str, float]:
    """Step 0's evaluations: the policy's accuracy (`eval/accuracy`) and, when the run distils, the teacher's: the
    anchor's accuracy on the same evaluation set with the same settings (`Trainer._eval`), kept in the run's
    state as `teacher_accuracy` (summary.json). With an EMA anchor (not a teacher) the anchor starts as the
    policy, so the two agree."""
    row = trainer._eval(trainer.policy, 0)
    if trainer.cfg.train.objective != "rl" and trainer.anchor is not None:
        row.update(trainer._eval(trainer.anchor, 0, TEACHER_KEY))
        trainer.state["teacher_accuracy"] = row[TEACHER_KEY]
    return row
