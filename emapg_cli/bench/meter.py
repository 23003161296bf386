"""Measuring one piece of work: CPU time (user + system, all threads), wall time and peak memory growth."""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; elsewhere the lifetime peak, which only grows)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Measurement:
    cpu_s: float
    wall_s: float
    peak_growth_mib: float


class _RssSampler(threading.Thread):
    """Polls the RSS every `period` seconds; `peak` is the largest value seen."""

    def __init__(self, period: float = 0.0005):
        super().__init__(daemon=True)
        self.period, self.peak, self.stop = period, rss_bytes(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.period)


def measure(fn: Callable[[], object], device: torch.device) -> Measurement:
    """Run `fn` once: CPU seconds of the process, wall seconds, and the peak memory above the state
    before the call (CUDA: peak allocated device memory; CPU: peak RSS, sampled every 0.5 ms)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = rss_bytes()
        sampler = _RssSampler()
        sampler.start()
    r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    w1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
    else:
        sampler.stop.set()
        sampler.join()
        peak = max(sampler.peak, rss_bytes())
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return Measurement(cpu_s=cpu, wall_s=w1 - w0, peak_growth_mib=max(0, peak - base) / 2**20)
