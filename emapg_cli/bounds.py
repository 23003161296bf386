"""What user input and user code may take: time, memory, processes (docs/reliability.md, "User code is contained").

* `MAX_SECONDS`, `check_seconds`: the longest time limit any `*_s` config key or seconds option takes (one week).
  Python's waits overflow long before a user's 1e13 is reached (threading.TIMEOUT_MAX is ~292 years, the C
  time_t sooner), so an unbounded limit is an internal error at the first wait instead of a line at config time.
* `die_with_parent`, `limit_memory`: a worker process that gets SIGKILL when its parent dies (Linux) and an
  address-space cap (RLIMIT_AS), for the grading pool's workers (maths graders, reward plugins).
* `user_code()`: the context every call into user code (a reward plugin, an environment's hooks, their imports)
  runs in. A process the code forks must never run emapg's own code: when the call returns (or raises) in the
  forked child, the child exits at once (`os._exit`), and (Linux) it gets SIGKILL when the thread that forked it
  ends, so an orphan never outlives emapg holding its stdout (`emapg eval ... | tee log` returns).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Iterator

log = logging.getLogger(__name__)

#: The longest time limit a `*_s` config key or a seconds option accepts: one week.
MAX_SECONDS = 7 * 24 * 3600.0


def check_seconds(value: float) -> float:
    """`value` when it is at most MAX_SECONDS, else ValueError saying the bound (pydantic names the key and the value)."""
    if value > MAX_SECONDS:
        raise ValueError(f"a time limit is at most {MAX_SECONDS:.0f} seconds (one week)")
    return value


def die_with_parent(parent_pid: int) -> None:
    """Linux: get SIGKILL when the parent dies, so a worker stuck in C code never outlives it (elsewhere the worker
    still exits when its inbox closes, once its task returns); exit at once if the parent is already gone."""
    with contextlib.suppress(OSError, AttributeError):  # no libc.so.6 / no prctl: not Linux
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: when the creating thread ends
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def limit_memory(max_bytes: int) -> None:
    """Cap this process's address space (RLIMIT_AS) at `max_bytes` where the platform allows it."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = max_bytes if hard == resource.RLIM_INFINITY else min(max_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: the timeout still bounds the task
        log.debug("could not cap worker memory at %d bytes", max_bytes)


_inside = threading.local()  # .depth: calls into user code in progress on this thread


def _before_fork() -> None:
    """In user code about to fork: note this process's pid on the forking thread (the child inherits the note)."""
    if getattr(_inside, "depth", 0):
        _inside.forker = os.getpid()


def _after_fork_in_child() -> None:
    """In a process forked by user code (the forking thread was inside `user_code()`): die with the forking thread.
    The forker may already be gone before prctl takes effect (a forked copy that forks and returns at once, leaving
    user code: `os._exit` in `user_code()`); then nothing would ever signal this process, so it exits here."""
    if getattr(_inside, "depth", 0):
        die_with_parent(_inside.forker)


if hasattr(os, "register_at_fork"):  # once, when this module is first imported; it acts only inside user_code()
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def user_code() -> Iterator[None]:
    """Run a call into user code (module doc): a fork it makes never comes back into emapg's code."""
    pid = os.getpid()
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        if os.getpid() != pid:  # the forked child left the user's code: it must not run ours (a copy of the run)
            os._exit(0)
        _inside.depth -= 1

