"""Raw tensors from a trainer to a rollout server over a torch.distributed group of two: rank 0 sends, rank 1 receives.

The group is built directly on a `TCPStore` (hosted by the trainer) and a `ProcessGroupGloo` (CPU) or
`ProcessGroupNCCL` (both sides on CUDA) object, never through `init_process_group`: the trainer's own default group
(accelerate's) is not touched, and the server needs none. Each tensor goes as its bytes (`uint8` view) in one
broadcast from rank 0, so any dtype travels bit for bit and nothing is serialised: the receiver writes straight
into a preallocated staging tensor of the agreed dtype and shape (the push's manifest, engines/rollout_protocol.py).
The gloo path is tested on CPU; the NCCL path is the same code with the NCCL object and is untested here.
"""

from __future__ import annotations

import datetime
from typing import Any

#: Rank of the trainer (sends) and of the server (receives).
TRAINER, SERVER = 0, 1


def _bytes(t: Any) -> Any:
    """A contiguous tensor's storage as a flat uint8 tensor (a view: no copy)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


class WeightChannel:
    """One end of the two-process group."""

    def __init__(self, store: Any, rank: int, backend: str, timeout_s: float):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.backend, self.store = rank, backend, store
        if backend == "nccl":  # untested here (no GPU): both ends must hold CUDA tensors
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, 2, options)
        elif backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        else:
            raise ValueError(f"unknown weight channel backend {backend!r} (gloo or nccl)")

    def send(self, tensor: Any) -> None:
        """Rank 0: broadcast `tensor`'s bytes (made contiguous first); returns once sent."""
        self.group.broadcast(_bytes(tensor.contiguous()), TRAINER).wait()

    def recv_into(self, tensor: Any) -> None:
        """Rank 1: receive the next tensor into `tensor` (contiguous, of the sent dtype and shape)."""
        self.group.broadcast(_bytes(tensor), TRAINER).wait()


def host_store(host: str, timeout_s: float) -> Any:
    """The trainer's `TCPStore` on `host` and a free port (`store.port`), waiting for no one yet."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(host: str, port: int, timeout_s: float) -> Any:
    """The server's client of the trainer's store."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=timeout_s))
