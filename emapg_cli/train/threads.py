"""How many intra-op threads torch uses on CPU: the user's choice, or the cores that are free now.

On a small machine the grading pool's workers and other jobs compete with torch's threads, and an
oversubscribed BLAS is slower than a smaller one (a 15-step toy run: 25.8 s with 2 threads vs 15.9 s
with 1 while another job ran on 2 cores). The automatic choice gives each local process its share of
the cores that are idle in a short sample of /proc/stat taken as the command starts (`SAMPLE_SECONDS`).
The 1-minute load average, used before issue 32, still held a job that had just finished (`emapg prepare
&& emapg train` chose 1 thread on an idle 2-core machine); it remains the fallback where /proc/stat is not
readable (macOS), and the note says so.
"""

from __future__ import annotations

import os
import time
from typing import Optional

#: Environment variable that overrides `train.torch_threads` (a positive integer).
ENV = "EMAPG_TORCH_THREADS"
#: How long the idle time of the cores is sampled before choosing (/proc/stat counts in 10 ms ticks: 20 per core).
SAMPLE_SECONDS = 0.2


def available_cores() -> set[int]:
    """The cores this process may run on (its CPU affinity), else 0 .. os.cpu_count() - 1."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


def cpu_times(stat: str) -> dict[int, tuple[int, int]]:
    """Per-core (busy, total) ticks from the text of /proc/stat: its `cpuN` lines (user nice system idle iowait irq
    softirq steal ...; guest time is already inside user). Idle is idle + iowait."""
    out = {}
    for line in stat.splitlines():
        name, *fields = line.split() or [""]
        if name.startswith("cpu") and name[3:].isdigit() and len(fields) >= 4:
            ticks = [int(f) for f in fields[:8]]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return out


def busy_cores(before: str, after: str, cores: set[int]) -> float:
    """How many of `cores` were busy between two readings of /proc/stat: the sum over those cores of the fraction of
    their ticks spent not idle (0 .. len(cores)). A core absent from either reading, or that did not tick, counts
    as idle."""
    first, second = cpu_times(before), cpu_times(after)
    busy = 0.0
    for core in cores:
        if core in first and core in second:
            d_busy, d_total = (second[core][i] - first[core][i] for i in (0, 1))
            busy += min(1.0, max(0.0, d_busy / d_total)) if d_total > 0 else 0.0
    return busy


def auto_threads(cores: int, local_processes: int, busy: float) -> int:
    """round(cores - busy) / local_processes, floored, clamped to [1, cores // local_processes].

    `busy`: how many cores other work keeps busy (`busy_cores`). The free cores are rounded, so a core used a
    little by a background process (busy 0.2) still counts as free, one used more than half as not.
    """
    share = max(1, cores // max(1, local_processes))
    free = int(cores - busy + 0.5) // max(1, local_processes)
    return max(1, min(share, free))


def read_proc_stat() -> str:
    """The text of /proc/stat (OSError where there is none)."""
    with open("/proc/stat", encoding="ascii") as f:
        return f.read()


def measure_busy(cores: set[int], seconds: float = SAMPLE_SECONDS) -> tuple[float, str]:
    """(busy cores, how they were measured): two readings of /proc/stat `seconds` apart, or where it cannot be read,
    the 1-minute load average (which lags: it still counts a job that ended a minute ago)."""
    try:
        before = read_proc_stat()
        time.sleep(seconds)
        return busy_cores(before, read_proc_stat(), cores), "idle cores"
    except (OSError, ValueError):  # no /proc/stat, or one this parser does not know
        try:
            return os.getloadavg()[0], "load average"
        except OSError:  # pragma: no cover - no load average either
            return 0.0, "no load measure"


def choose_threads(configured: Optional[int], local_processes: int = 1) -> tuple[int, str]:
    """(threads, where the number came from): EMAPG_TORCH_THREADS, then train.torch_threads, then `auto_threads` of
    the cores busy now ("auto", or "auto, load average" where /proc/stat cannot be read)."""
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
    cores = available_cores()
    busy, how = measure_busy(cores)
    return auto_threads(len(cores), local_processes, busy), "auto" if how == "idle cores" else f"auto, {how}"


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
