"""How many intra-op threads torch uses on CPU: the user's choice, or the cores that are actually free.

On a small machine the grading pool's workers and other jobs compete with torch's threads, and an
oversubscribed BLAS is slower than a smaller one (a 15-step toy run: 25.8 s with 2 threads vs 15.9 s
with 1 while another job ran on 2 cores). The automatic choice gives each local process its share of
the cores that the 1-minute load average leaves free, at least 1.
"""

from __future__ import annotations

import os
from typing import Optional

#: Environment variable that overrides `train.torch_threads` (a positive integer).
ENV = "EMAPG_TORCH_THREADS"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def auto_threads(cores: int, local_processes: int, load: float) -> int:
    """floor((cores - load) / local_processes), clamped to [1, cores // local_processes].

    `load` is the run queue before training starts (1-minute load average): cores it keeps busy are
    not free for this run's threads.
    """
    share = max(1, cores // max(1, local_processes))
    free = int((cores - load) // max(1, local_processes))
    return max(1, min(share, free))


def choose_threads(configured: Optional[int], local_processes: int = 1) -> tuple[int, str]:
    """(threads, where the number came from): EMAPG_TORCH_THREADS, then train.torch_threads, then `auto_threads`."""
    from emapg_cli.errors import UserError

    env = os.environ.get(ENV)
    if env:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value < 1:
            raise UserError(f"{ENV} must be a positive integer, not '{env}'")
        return value, ENV
    if configured is not None:
        return configured, "train.torch_threads"
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = 0.0
    return auto_threads(available_cores(), local_processes, load), "auto"


def set_torch_threads(configured: Optional[int]) -> str:
    """On CPU, set torch's intra-op threads by `choose_threads` (unless OMP_NUM_THREADS is set: torch read it) and
    return the note `train` and `eval` print: ", 1 torch thread (auto)"; "" on a CUDA machine."""
    import torch

    if torch.cuda.is_available():
        return ""
    if "OMP_NUM_THREADS" not in os.environ:
        threads, source = choose_threads(configured, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(threads)
    else:
        source = "OMP_NUM_THREADS"
    n = torch.get_num_threads()
    return f", {n} torch thread{'s' if n != 1 else ''} ({source})"
