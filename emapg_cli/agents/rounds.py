"""Engine calls of concurrently running agent episodes, batched in deterministic lockstep rounds.

Agents run in threads and call the endpoint whenever their code gets there; sampled one request at a time, a step's
episodes would make hundreds of one-row engine calls, and batched as they arrive, a sample would depend on which
requests happened to arrive together. `Rounds` does neither: a round starts only when every admitted, unfinished
episode is waiting on a call (or has ended), so its requests are a function of what the episodes did, not of
timing. Its requests are taken in episode order (and call order within an episode), grouped by their sampling
settings, and each group is one `engine.generate` call seeded by (the step's seed, the round, the group, the
request's own `seed`): the same episodes give the same samples on a rerun or a resumed run (docs/agents.md,
"Reproducibility"). Episodes are admitted in order, at most `width` at once; one that ends admits the next before
the round condition is looked at again.

A request may carry a `cancelled` hook (its client left, its deadline passed, its episode ended): while it waits for
its round it is polled, and once true the request is withdrawn (`Cancelled`); a round's engine call is given a hook
that is true once every request of its group is cancelled (the hf engine stops at its next decode step), so a round
no one waits for anymore does not run on. `wait_idle()` returns once no round runs.

An engine that fails (a rollout server that went away) fails the round's requests and is kept in `engine_error`,
which the runner raises once the episodes are over: a dead engine stops the run, it is not an agent's failure.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from emapg_cli.engines.base import Cancelled, SamplingParams, derive_seed

#: Seconds between two polls of a waiting request's `cancelled` hook.
POLL_S = 0.1


class EpisodeOver(Exception):
    """A call of an episode that has ended (timed out, or returned): refused."""


@dataclass
class _Request:
    slot: int
    prompts: list[list[int]]
    params: SamplingParams
    seed: int
    cancelled: Optional[Callable[[], bool]] = None
    rows: Optional[list] = None
    error: Optional[BaseException] = None
    done: bool = False


@dataclass
class Rounds:
    """Lockstep rounds over `engine` for episode slots 0..slots-1 (see the module docstring). `start(slot)` is called
    (under the lock, quickly) when a slot is admitted: it starts the episode's thread."""

    engine: Any
    seed: int
    slots: int
    width: int
    start: Callable[[int], None]
    engine_error: Optional[BaseException] = None
    rounds: int = 0  # engine rounds run
    _running: set = field(default_factory=set)
    _next: int = 0
    _pending: list = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _busy: bool = False

    def begin(self) -> None:
        """Admit the first `width` slots."""
        with self._cond:
            while self._next < self.slots and len(self._running) < self.width:
                self._admit()

    def _admit(self) -> None:
        slot, self._next = self._next, self._next + 1
        self._running.add(slot)
        self.start(slot)

    def generate(self, slot: int, prompts: list[list[int]], params: SamplingParams, seed: int,
                 cancelled: Optional[Callable[[], bool]] = None) -> list:
        """`params.n` completions per prompt for episode `slot`, sampled in the next round; EpisodeOver when the
        episode has ended, `Cancelled` once `cancelled()` (withdrawn before its round, or its round stopped), the
        engine's error when the round failed."""
        req = _Request(slot, prompts, params, seed, cancelled)
        with self._cond:
            if slot not in self._running:
                raise EpisodeOver(f"episode {slot} is over")
            self._pending.append(req)
        self._maybe_run()
        with self._cond:
            while not req.done:
                if cancelled is not None and req in self._pending and cancelled():
                    self._pending.remove(req)  # the others' rounds go on without it
                    raise Cancelled("the request was cancelled before its round")
                self._cond.wait(timeout=POLL_S if cancelled is not None else None)
        if req.error is not None:
            raise req.error
        return req.rows

    def leave(self, slot: int) -> None:
        """Episode `slot` has ended (returned, raised, or was given up on): its waiting requests are refused, the
        next slot admitted, and a round starts if everyone left is waiting. Idempotent."""
        with self._cond:
            if slot not in self._running:
                return
            self._running.discard(slot)
            for req in [r for r in self._pending if r.slot == slot]:
                self._pending.remove(req)
                req.error, req.done = EpisodeOver(f"episode {slot} is over"), True
            if self._next < self.slots:
                self._admit()
            self._cond.notify_all()
        self._maybe_run()

    def wait_idle(self) -> None:
        """Until no round runs (a round whose requests are all cancelled stops at the engine's next decode step)."""
        with self._cond:
            while self._busy:
                self._cond.wait()

    def _maybe_run(self) -> None:
        """Run rounds while every running episode is waiting (in this thread: it is waiting too, or has ended)."""
        while True:
            with self._cond:
                waiting = {r.slot for r in self._pending}
                if self._busy or not self._pending or not self._running <= waiting:
                    return
                self._busy, batch = True, sorted(self._pending, key=lambda r: r.slot)  # stable: call order per slot
                self._pending = []
            try:
                self._run(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self.rounds += 1
                    self._cond.notify_all()

    def _run(self, batch: list[_Request]) -> None:
        groups: dict[tuple, list[_Request]] = {}
        for req in batch:
            groups.setdefault((replace(req.params, seed=0), req.seed), []).append(req)
        for g, ((params, seed), reqs) in enumerate(groups.items()):
            prompts = [p for r in reqs for p in r.prompts]
            try:
                if self.engine_error is not None:
                    raise self.engine_error
                rows = self.engine.generate(prompts, replace(params, seed=derive_seed(self.seed, self.rounds, g, seed)),
                                            cancelled=_all_cancelled(reqs))
            except Cancelled as e:  # no one waits for this group's samples anymore: not an engine failure
                for r in reqs:
                    r.error = e
            except Exception as e:  # noqa: BLE001 - kept, and raised by the runner once the episodes are over
                self.engine_error = self.engine_error or e
                for r in reqs:
                    r.error = e
            else:
                at = 0
                for r in reqs:
                    r.rows, at = rows[at:at + len(r.prompts)], at + len(r.prompts)
            for r in reqs:
                r.done = True


def _all_cancelled(reqs: list[_Request]) -> Callable[[], bool]:
    """The `cancelled` hook of a group's engine call: true once every one of its requests is cancelled."""
    return lambda: all(r.cancelled is not None and r.cancelled() for r in reqs)
