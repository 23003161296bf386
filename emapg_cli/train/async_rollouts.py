"""Asynchronous rollouts (rollout.max_staleness = k >= 1): step s+1's samples are generated while step s trains.

Timeline with k = 1 (G_s: generation of step s's samples, U_s: its passes + update, P_s: the push of version s, the
policy after U_s; the weights at setup are version 0):

    trainer  | G_1 (waits) | U_1 | P_1 | wait | U_2 | P_2 | wait | U_3 | P_3 ...
    engine   | G_1 @ v0    | G_2 @ v0 ...     | G_3 @ v1 ...     | G_4 @ v2 ...

Once step s's samples are in (and its batch built), the generation of step s+1 is handed to a background thread with
`SamplingParams.min_version = (s + 1) - 1 - k = s - k`: a versioned engine (`engines.base.Engine.versioned`, a
rollout server) holds the request until its weights are at least that version, so when step s+1 trains (on the
policy of version s) its samples are at most k updates old. The off-policy gap pi_theta_s / pi_sampled is what
`train.rollout_correction` weighs (token_truncate unless set; the old-policy log-probs come from the trainer's own
pass: train.old_logprobs=pass). k = 0 is the synchronous loop: nothing runs in the background (a versioned
engine is asked for the current version, s - 1, so it never samples from weights it has not applied yet).

Only the engine call runs in the thread (`Rollouts.generate`: the prompts are a pure function of the step, the
seeds are per request); grading, the batch and every metric are made on the main thread when the step starts, so
nothing the thread reads is written meanwhile (the engine applies pushed weights between generations). The engine
gets one request at a time: the thread's starts after the step's own, and an evaluation of the policy waits for
it (`RolloutPipeline.drain`). An error in the thread is raised by the step that waits for it, unchanged (the same one-line UserError as a synchronous
run). On close, an error or Ctrl-C the in-flight generation is cancelled if it has not started, else abandoned:
it runs in a daemon thread, so nothing waits for it. docs/async_rollouts.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import replace
from typing import Any, Callable, Optional

from emapg_cli.errors import UserError


def check_async(cfg) -> None:
    """What rollout.max_staleness >= 1 needs, checked without any file (launch and `--dry-run`): a versioned engine
    (rollout.engine_url), the trainer's own old-policy log-probs, and the engine's sampling log-probs for the
    correction. One-line UserError otherwise."""
    k = cfg.rollout.max_staleness
    if not k:
        return
    if not cfg.rollout.engine_url:
        raise UserError(f"rollout.max_staleness={k} samples while the trainer updates, which needs a versioned engine "
                        "in another process: set rollout.engine_url to a rollout server (`emapg rollout serve`), or "
                        "rollout.max_staleness=0")
    if cfg.train.old_logprobs == "engine":
        raise UserError(f"rollout.max_staleness={k} samples from weights up to {k} update(s) old, so the engine's log-probs "
                        "are not the current policy's that PPO's ratio needs: set train.old_logprobs=pass (or auto)")
    if cfg.search.enabled and cfg.search.retokenize:
        raise UserError(f"rollout.max_staleness={k} corrects the off-policy gap with the engine's sampling log-probs, "
                        "which search.retokenize drops: set search.retokenize=false or rollout.max_staleness=0")


def first_version(step: int, k: int, start: int) -> int:
    """The oldest weights version the samples of RL step `step` may come from: the policy that trains on them is
    version step - 1, so (step - 1) - k, and never below `start`, the version pushed at setup (what a resumed run,
    or a server that served another run before, must not sample older than)."""
    return max(step - 1 - k, start)


def staleness_metrics(completions: list, step: int, trainer_wait_s: float, engine_wait_s: float) -> dict[str, float]:
    """`rollout/staleness` (mean over the step's samples of (step - 1) - weights_version: how many updates behind
    the training policy each sample's weights were; a multi-turn episode counts its oldest turn), `rollout/staleness_max`,
    `rollout/trainer_wait_s` (seconds the trainer blocked for the step's samples) and `rollout/engine_wait_s` (seconds
    the engine's requests of the step waited for pushed weights). {} when no sample carries a version."""
    versions = [c.weights_version for c in completions if getattr(c, "weights_version", None) is not None]
    if not versions:
        return {}
    lag = [(step - 1) - v for v in versions]
    return {"rollout/staleness": sum(lag) / len(lag), "rollout/staleness_max": float(max(lag)),
            "rollout/trainer_wait_s": trainer_wait_s, "rollout/engine_wait_s": engine_wait_s}


def in_background(fn: Callable[[], Any], name: str) -> Future:
    """Run `fn()` in a daemon thread; its Future holds the result or the exception (re-raised by `result()`).
    A daemon thread: an interrupted run exits without waiting for it."""
    future: Future = Future()

    def work() -> None:
        if not future.set_running_or_notify_cancel():  # cancelled before it started
            return
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting step, unchanged
            future.set_exception(e)

    threading.Thread(target=work, name=name, daemon=True).start()
    return future


class RolloutPipeline:
    """The rollout phase of every step (`pipeline(step)`, in place of `Rollouts(...)(step)`): synchronous with
    k = 0, else the generation of the next step runs in the background (module docstring)."""

    def __init__(self, rollouts, engine, k: int, start: int, steps: int):
        """`rollouts`: the run's `train.rollouts.Rollouts`; `engine`: the rollout engine (k >= 1 needs a versioned
        one); `start`: the version pushed at setup (the last finished step); `steps`: train.steps."""
        if k and not getattr(engine, "versioned", False):
            raise UserError(f"rollout.max_staleness={k} needs a versioned rollout engine (rollout.engine_url), "
                            f"and {type(engine).__name__} is not one")
        self.engine, self.k, self.start, self.steps = engine, k, start, steps
        self.versioned = bool(getattr(engine, "versioned", False))
        if self.versioned:  # every request names the oldest weights it may be sampled from
            rollouts.min_version = lambda step: first_version(step, k, start)
        self.rollouts = rollouts
        self.untimed = replace(rollouts, timed=lambda name: contextlib.nullcontext())  # the thread times nothing
        self.pending: Optional[tuple[int, Future]] = None  # (step, its generation) in flight

    def _engine_wait(self) -> float:
        return float(getattr(self.engine, "wait_s", 0.0)) if self.versioned else 0.0

    def _generate(self, step: int, timed: bool) -> tuple[tuple, float]:
        """Round 0 of `step`'s generation (this rank's scheduled prompts) and the seconds the engine waited for weights."""
        before = self._engine_wait()
        r = self.rollouts if timed else self.untimed
        out = r.generate(r.scheduled(step), step, r.cfg.stage_at(step))
        return out, self._engine_wait() - before

    def __call__(self, step: int):
        """(batch, pending grades, metrics inputs) of `step`, as `Rollouts.__call__`; the pipeline's metrics are in
        the third's "pipeline" entry (versioned engines only)."""
        if not self.versioned:  # an engine in this process (k = 0): the synchronous loop, untouched
            batch, pending, roll = self.rollouts(step)
            roll["pipeline"] = {}
            return batch, pending, roll
        t0 = time.perf_counter()
        if self.pending is not None and self.pending[0] == step:
            with self.rollouts.timed("generation"):  # only the part the update did not hide
                first, engine_wait = self.pending[1].result()  # the thread's error, if any, is raised here
        else:  # k = 0, or the first step of a session: nothing was started for it
            first, engine_wait = self._generate(step, timed=True)
        self.pending = None
        waited = time.perf_counter() - t0
        # grading starts and the batch is built before the next step's generation starts: one engine call at a
        # time (`drain` keeps it so for the evaluations)
        batch, pending, roll = self.rollouts(step, first=first)
        if self.k and step < self.steps:
            self.pending = (step + 1, in_background(lambda: self._generate(step + 1, timed=False), "emapg-rollouts"))
        roll["pipeline"] = staleness_metrics(pending[1], step, waited, engine_wait)
        return batch, pending, roll

    def drain(self) -> None:
        """Wait until the in-flight generation (if any) is done; its result, or error, is kept for its step."""
        if self.pending is not None:
            wait([self.pending[1]])

    def close(self) -> None:
        """Cancel the in-flight generation if it has not started; a running one is left to its daemon thread (its
        samples are dropped: a resumed run generates the step again, from the weights it resumes with)."""
        if self.pending is not None:
            self.pending[1].cancel()
            self.pending = None

    def __enter__(self) -> "RolloutPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def eval_sampler(model, params, step: int, *, policy, engine, generator, pipeline: "RolloutPipeline",
                 push: Callable[[Any], None], local: Callable[[Any], Any]):
    """(generator, params) of an evaluation of `model` after RL step `step` (`Trainer._eval`), for the block.

    An engine in this process samples `model` itself: another model than the `policy` (the EMA anchor, a teacher) is
    put in for the block by `push(model)` and the policy back after it. A versioned engine holds the policy's versions
    only: the policy is evaluated there at its current version (min_version = step, or the setup version at step 0),
    any other model by `local(model)`, a generator on that module in this process, so its weights never enter the
    engine."""
    if not engine.versioned:
        swap = model is not policy
        if swap:
            push(model)
        yield generator, params
        if swap:
            push(policy)
        return
    if model is policy:
        pipeline.drain()  # the next step's generation first: one request at a time on the engine
        yield generator, replace(params, min_version=max(step, pipeline.start))
        return
    yield local(model), params
