"""A process pool with a hard per-task timeout: a wedged worker is killed and replaced.

math-verify's own timeout uses `signal.alarm`, which only works in a main thread and cannot
interrupt C code (a big-integer power such as an exponent tower never returns to the
interpreter). Here every task runs in a worker process; the parent watches the clock and kills a
worker whose current task runs past `timeout` seconds. That task gets the default result, the
rest of its chunk is re-queued, and a fresh worker takes the slot.

Workers are fresh interpreters (running `_worker_main("MODULE:FUNCTION", ...)`) talking over
two pipes: they never inherit the parent's threads (torch's) or memory, and never re-run the
caller's main script, so the pool is safe to use from any program, guarded by `__main__` or not.

Workers run in sessions of their own (Ctrl-C is the parent's to handle: it stops them; they also ignore
SIGINT), die with the parent (Linux), and may get an address-space cap (`memory_limit`): a task that
needs more raises MemoryError (counted in `stats.errors` and `stats.out_of_memory`) or kills its worker
(counted in `stats.crashes`); either way it scores the default and the pool goes on. A task that forks
(a reward plugin's own code) cannot break the pool: the forked copy exits when the call returns in it
(`bounds.user_code`), and whatever it left running is killed with the worker's process group.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional, Sequence

from emapg_cli.bounds import die_with_parent, limit_memory, user_code

log = logging.getLogger(__name__)


#: Seconds a new worker may take to import its function and warm up before it is an error.
STARTUP_TIMEOUT = 120.0
#: A worker's environment on top of the parent's: one thread per maths library (the pool runs one worker per core,
#: and each idle thread pool would reserve address space against the worker's memory cap).
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _resolve(ref: str) -> Callable[..., Any]:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def _worker_main(fn_ref: str, warmup_ref: str, read_fd: int, write_fd: int, parent_pid: int, memory_limit: int = 0,
                 warmup_args: tuple = ()) -> None:
    """Worker loop: warm up, say "ready", then per chunk [(index, args)] send (index, result, error). Every call runs
    in `bounds.user_code()`: a process the task forks exits when the call returns in it, never answering on the pipes."""
    die_with_parent(parent_pid)
    if memory_limit:
        limit_memory(memory_limit)
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        fn = _resolve(fn_ref)
        if warmup_ref:
            with user_code():
                _resolve(warmup_ref)(*warmup_args)
    except (Exception, SystemExit) as e:  # told to the parent (WorkerStartError), in one line
        outbox.send(("failed", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))
        return
    outbox.send("ready")
    while True:
        try:
            chunk = inbox.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for index, args in chunk:
            try:
                with user_code():
                    value = fn(*args)
                outbox.send((index, value, None))
            except (Exception, SystemExit) as e:  # a task that raises (or exits) scores the default; the parent counts it
                outbox.send((index, None, f"{type(e).__name__}: {e}"))


def _ref(fn: Callable[..., Any]) -> str:
    """"module:name" of a module-level function (what a fresh interpreter can import)."""
    if "." in fn.__qualname__ or fn.__module__ == "__main__":
        raise ValueError(f"{fn.__qualname__} must be a module-level function of an importable module")
    return f"{fn.__module__}:{fn.__qualname__}"


def _death(proc: subprocess.Popen) -> str:
    """Why a worker that closed its pipes without answering is gone, in a few words. It is waited for without being
    reaped (WNOWAIT): `_kill` reaps it after its signal, so its pid (its group's id) cannot be reused before."""
    for _ in range(20):
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        if info is not None:
            return (f"the worker exited with code {info.si_status}" if info.si_code == os.CLD_EXITED else
                    f"the worker was killed by signal {info.si_status} (e.g. at its memory cap)")
        time.sleep(0.05)
    return "the worker closed its pipes without answering"


class WorkerStartError(RuntimeError):
    """A new worker could not import its function or warm up; `reason` says why, in one line."""

    def __init__(self, fn_ref: str, reason: str):
        super().__init__(f"a worker for {fn_ref} could not start: {reason}")
        self.reason = reason


@dataclass
class PoolStats:
    """What went wrong so far (cumulative over the pool's life)."""

    tasks: int = 0
    timeouts: int = 0  # tasks killed at the deadline
    errors: int = 0  # tasks whose function raised (MemoryError included)
    out_of_memory: int = 0  # of those, MemoryError (the worker's memory cap)
    crashes: int = 0  # workers that died without a timeout (e.g. killed at the memory cap)
    last_error: str = ""  # the last task error, "Type: message" (or a timeout)


@dataclass
class _Worker:
    proc: subprocess.Popen
    inbox: Connection  # parent -> worker
    conn: Connection  # worker -> parent
    started: float  # monotonic time of the start
    ready: bool = False  # said "ready" (warmed up)
    pending: deque = field(default_factory=deque)  # [(index, args)] sent, not yet answered
    deadline: float = 0.0  # the task in progress must answer before this


class TimeoutPool:
    """`map(tasks)`: `fn(*args)` for each task over worker processes, with a hard per-task timeout.

    `fn` must be a module-level function (a fresh interpreter imports it by name). A task that times
    out, or whose worker dies, gets `default`; one whose `fn` raises gets `default` too. Either way it
    is counted in `stats`, and the pool keeps going. `warmup` (module-level) runs once, as
    `warmup(*warmup_args)` (plain values), in each new worker before it takes tasks, so slow imports never count
    against a task's time; a replacement worker warms up while the others keep working. A worker that cannot
    import `fn` or warm up stops `map` with WorkerStartError saying why in one line. `memory_limit` (bytes,
    0: none) caps each worker's address space.

    Each worker runs in a session of its own, with one thread per maths library (OMP/MKL/OpenBLAS); killing
    it (a timeout, `close`) kills its whole process group, so whatever a task forked and left running goes too.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        workers: int = 2,
        timeout: float = 5.0,
        default: Any = None,
        chunk_size: int = 16,
        warmup: Optional[Callable[..., Any]] = None,
        warmup_args: tuple = (),
        memory_limit: int = 0,
    ) -> None:
        if workers < 1 or timeout <= 0 or chunk_size < 1:
            raise ValueError("workers >= 1, timeout > 0 and chunk_size >= 1 are required")
        self.fn_ref, self.warmup_ref = _ref(fn), _ref(warmup) if warmup else ""
        self.timeout, self.default, self.chunk_size = timeout, default, chunk_size
        self.n_workers, self.memory_limit, self.warmup_args = workers, memory_limit, tuple(warmup_args)
        self.stats = PoolStats()
        self._workers: list[_Worker] = []

    # -- lifecycle -------------------------------------------------------------------------------
    def _start(self) -> _Worker:
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        args = (f"{self.fn_ref!r}, {self.warmup_ref!r}, {to_child_r}, {to_parent_w}, {os.getpid()}, {self.memory_limit}, "
                f"{self.warmup_args!r}")
        # SIGINT is ignored before anything is imported: Ctrl-C is the parent's to handle.
        boot = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)"
        cmd = [sys.executable, "-c", f"{boot}; from {__name__} import _worker_main; _worker_main({args})"]
        proc = subprocess.Popen(cmd, pass_fds=(to_child_r, to_parent_w), stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **WORKER_ENV})
        os.close(to_child_r)
        os.close(to_parent_w)
        inbox, conn = Connection(to_child_w, readable=False), Connection(to_parent_r, writable=False)
        return _Worker(proc, inbox, conn, started=time.monotonic())

    def _kill(self, w: _Worker) -> None:
        """SIGKILL to the worker's process group (its session: the worker and what its tasks forked), then reap it.
        The worker is reaped only here, after the signal, so its pid (the group's id) cannot be reused before."""
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        w.proc.wait(timeout=10)
        w.inbox.close()
        w.conn.close()

    def close(self) -> None:
        """Stop every worker and what its tasks left running (idempotent)."""
        for w in self._workers:
            self._kill(w)
        self._workers = []

    def __enter__(self) -> "TimeoutPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- work ------------------------------------------------------------------------------------
    def warm(self) -> None:
        """Start the missing workers and wait until each has warmed up (WorkerStartError when one cannot), so that the
        next tasks' time never includes a start."""
        self._workers += [self._start() for _ in range(self.n_workers - len(self._workers))]
        for w in self._workers:
            while not w.ready:
                try:
                    if not w.conn.poll(max(0.0, w.started + STARTUP_TIMEOUT - time.monotonic())):
                        raise WorkerStartError(self.fn_ref, f"it did not start in {STARTUP_TIMEOUT:.0f} s")
                    self._receive(w, lambda index, value: None)
                except (EOFError, OSError, WorkerStartError) as e:
                    self._kill(w)
                    self._workers.remove(w)
                    raise e if isinstance(e, WorkerStartError) else WorkerStartError(
                        self.fn_ref, f"it exited while starting (exit code {w.proc.returncode})") from None

    def map(self, tasks: Sequence[tuple], on_result: Optional[Callable[[int, Any], None]] = None) -> list[Any]:
        """`[fn(*args) for args in tasks]`, in order; `on_result(index, result)` as each finishes."""
        results: list[Any] = [self.default] * len(tasks)
        if not tasks:
            return results
        self._workers += [self._start() for _ in range(self.n_workers - len(self._workers))]
        queue = deque(enumerate(tasks))
        self.stats.tasks += len(tasks)
        # Small chunks when there is little work, so every worker gets some.
        chunk = max(1, min(self.chunk_size, len(tasks) // (2 * self.n_workers) or 1))

        def finish(index: int, value: Any) -> None:
            results[index] = value
            if on_result is not None:
                on_result(index, value)

        while queue or any(w.pending for w in self._workers):
            for w in self._workers:
                if w.ready and not w.pending and queue:
                    w.pending.extend(queue.popleft() for _ in range(min(chunk, len(queue))))
                    w.inbox.send(list(w.pending))
                    w.deadline = time.monotonic() + self.timeout
            watched = [w for w in self._workers if w.pending or not w.ready]
            soonest = min(w.deadline if w.ready else w.started + STARTUP_TIMEOUT for w in watched)
            readable = set(wait([w.conn for w in watched], timeout=max(0.0, soonest - time.monotonic())))
            for i, w in enumerate(self._workers):
                if w.conn in readable:
                    try:
                        self._receive(w, finish)
                        continue
                    except (EOFError, OSError):
                        if not w.ready:  # it could not even start: replacing it would loop forever
                            self._kill(w)
                            raise WorkerStartError(self.fn_ref, f"it exited while starting (exit code {w.proc.returncode})") from None
                        self.stats.crashes += 1
                        self.stats.last_error = _death(w.proc)
                elif not w.ready:
                    if time.monotonic() < w.started + STARTUP_TIMEOUT:
                        continue
                    self._kill(w)
                    raise WorkerStartError(self.fn_ref, f"it did not start in {STARTUP_TIMEOUT:.0f} s")
                elif not w.pending or time.monotonic() < w.deadline:
                    continue
                else:
                    self.stats.timeouts += 1
                    self.stats.last_error = f"timed out after {self.timeout:g} s"
                # Timed out or died: the task in progress scores the default, the rest is re-queued.
                if w.pending:
                    index, _ = w.pending.popleft()
                    finish(index, self.default)
                    queue.extendleft(reversed(w.pending))
                self._kill(w)
                self._workers[i] = self._start()
        return results

    def _receive(self, w: _Worker, finish: Callable[[int, Any], None]) -> None:
        """Read everything `w` has sent: its "ready", then (index, result, error) per finished task."""
        while w.conn.poll():
            msg = w.conn.recv()
            if msg == "ready":
                w.ready = True
                continue
            if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "failed":
                self._kill(w)
                raise WorkerStartError(self.fn_ref, msg[1])
            index, value, error = msg
            w.pending.popleft()
            if error is not None:
                self.stats.errors += 1
                self.stats.last_error = error
                self.stats.out_of_memory += error.startswith("MemoryError")
                log.debug("task %d raised %s", index, error)
                value = self.default
            finish(index, value)
            w.deadline = time.monotonic() + self.timeout
