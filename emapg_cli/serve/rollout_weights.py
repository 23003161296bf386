"""A rollout server's side of weight pushes: each version received into one staging copy, checked, then applied.

A pushed version is received into the staging copy of the parameters (allocated at the first push, reused), checked
(every value finite: a NaN or an infinity in one tensor refuses the whole version), and only then handed to the
applier thread, which copies it into the engine between two generations (the service's lock). A push that follows
another before it was applied waits for it: there is one staging copy.

The bytes come in the push request's own body, right after its manifest, and are read exactly as the manifest
(already checked against the server's parameters) declares, into the staging copy in CPU memory: a sender cannot make
the server read more or other than that, and the request is answered once the version is received and checked (422
when it is not finite, 400 when the body is short). (An NCCL channel between GPUs, untested and unmeasured, was
removed: scripts/benchmarks/weight_channel.py keeps its code for the push benchmark.)
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

from emapg_cli.engines.rollout_protocol import ProtocolError


class Staging:
    """The one staging copy of a server's parameters, and the thread that applies what it holds.

    `apply(version, tensors, epoch)` copies a version into the engine (the service's, under its lock); the copy is
    free again once it returned."""

    def __init__(self, params: dict[str, tuple[str, list[int]]], apply: Callable[[int, dict, int], None]):
        self.params, self._apply = params, apply
        self.tensors: dict[str, Any] = {}
        self._free = threading.Semaphore(1)
        self._jobs: "queue.Queue[tuple[int, int]]" = queue.Queue()
        threading.Thread(target=self._run, name="emapg-rollout-apply", daemon=True).start()

    def acquire(self, still_wanted: Callable[[], bool]) -> bool:
        """Take the staging copy, waiting for the previous version to be applied while `still_wanted()` (checked
        twice a second); False when it was given up."""
        while not self._free.acquire(timeout=0.5):
            if not still_wanted():
                return False
        return True

    def release(self) -> None:
        self._free.release()

    def receive(self, rows: list[tuple[str, str, list[int]]], read_into: Callable[[Any], None]) -> None:
        """Each tensor of `rows` (a checked manifest) read into its staging tensor (CPU memory) by `read_into`."""
        import torch

        for name, dtype, shape in rows:
            buf = self.tensors.get(name)
            if buf is None:
                buf = self.tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype))
            read_into(buf)

    def not_finite(self) -> Optional[str]:
        """The name of the first staged tensor holding a NaN or an infinity, else None. A tensor whose sum is finite
        holds neither (a NaN makes the sum NaN, an infinity makes it infinite or NaN), and a sum is ~20x cheaper than
        an elementwise check; only a sum that overflowed from finite values needs the elementwise one."""
        import torch

        def finite(t: Any) -> bool:
            return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())

        return next((n for n, t in self.tensors.items() if not finite(t)), None)

    def hand_over(self, version: int, epoch: int) -> None:
        """The staged `version` (complete and checked) to the applier; the copy is released once applied."""
        self._jobs.put((version, epoch))

    def _run(self) -> None:
        while True:
            version, epoch = self._jobs.get()
            try:
                self._apply(version, self.tensors, epoch)
            finally:
                self.release()


def read_exactly_into(read_into: Callable[[memoryview], int]) -> Callable[[Any], None]:
    """A `Staging.receive` reader: fills a tensor's bytes from `read_into(view) -> bytes read` (a socket file's
    `readinto`); `ProtocolError` when the stream ends first."""

    def fill(tensor: Any) -> None:
        import torch

        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        got = 0
        while got < len(view):
            n = read_into(view[got:])
            if not n:
                raise ProtocolError(f"the body ended {len(view) - got} bytes before the end of a tensor")
            got += n

    return fill

