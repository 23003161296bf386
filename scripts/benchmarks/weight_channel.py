"""Raw tensors from a trainer to a rollout server over a torch.distributed group of two: rank 0 sends, rank 1
receives. This was emapg's `nccl` weight backend (rollout.engine_weights_backend), removed as untested and unmeasured
(no GPU pair); it stays here, beside weight_push_speed.py, which times the same group on gloo against the `http` push
(its bytes in the push's own body, emapg_cli/serve/rollout_weights.py) for docs/rollout_server.md.

The group is built directly on a `TCPStore` and a `ProcessGroupNCCL` object, never through `init_process_group`: the
trainer's own default group (accelerate's) is not touched, and the server needs none. The server hosts the store,
on the address its connect request came to only (a socket bound there, handed to the store), not on every
interface, and the trainer joins it: the server never dials anything. `handshake` sends one value through the new
group, so that its setup (NCCL's communicator) happens within the timeout of the side that waits for it. Each tensor
goes as its bytes (`uint8` view) in one broadcast from rank 0, so any dtype travels bit for bit and nothing is
serialised: the receiver writes straight into a preallocated staging tensor of the agreed dtype and shape (the
push's manifest, engines/rollout_protocol.py). `backend="gloo"` builds the same group on CPU.
"""

from __future__ import annotations

import datetime
import os
import socket
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
            if rank == SERVER:  # a collective that fails raises here; NCCL's default would end the whole process
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, 2, options)
        elif backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        else:
            raise ValueError(f"unknown weight channel backend {backend!r} (nccl)")

    def send(self, tensor: Any) -> None:
        """Rank 0: broadcast `tensor`'s bytes (made contiguous first); returns once sent."""
        self.group.broadcast(_bytes(tensor.contiguous()), TRAINER).wait()

    def recv_into(self, tensor: Any) -> None:
        """Rank 1: receive the next tensor into `tensor` (contiguous, of the sent dtype and shape)."""
        self.group.broadcast(_bytes(tensor), TRAINER).wait()

    def handshake(self) -> None:
        """One int64 from rank 0 to rank 1: the group is set up (NCCL's communicator) once this returns."""
        import torch

        one = torch.ones(1, dtype=torch.int64, device="cuda" if self.backend == "nccl" else "cpu")
        self.group.broadcast(one, TRAINER).wait()


def host_store(host: str, timeout_s: float) -> Any:
    """The server's `TCPStore` on a free port (`store.port`) of `host` only, waiting for no one yet."""
    import torch.distributed as dist

    listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=16)
    try:
        store = dist.TCPStore(host, listener.getsockname()[1], 2, True, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now (and closes it with itself)
    return store


def join_store(host: str, port: int, timeout_s: float) -> Any:
    """The trainer's client of the server's store."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=timeout_s))
