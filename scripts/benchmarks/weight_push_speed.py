"""Weight push throughput to a rollout server: the `http` backend (the tensors in the push's own body, read into the
server's preallocated staging copy and checked finite) against a two-process gloo group (one broadcast per tensor
into preallocated buffers: how the weights travelled before issue 32). docs/rollout_server.md quotes its output.

    python scripts/benchmarks/weight_push_speed.py                 # 3 rounds, each: gloo then http, for 3 layouts of float32
    python scripts/benchmarks/weight_push_speed.py --rounds 5

The server is a real `RolloutService` behind `make_server` in a subprocess (one torch thread), on a stand-in engine
(the push path does not touch it); the trainer side is `RemoteEngine.push_weights`. Every server is on 127.0.0.1.
Within each round both transports run back to back, so a change of the machine's load hits both; prints the median
and the range of GiB/s per layout and transport.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # weight_channel.py, beside this script

LAYOUTS = {"64 x 1 MiB": [[1 << 18]] * 64, "4 x 64 MiB": [[1 << 24]] * 4, "2 x 256 MiB": [[1 << 26]] * 2}

SERVER = r'''
import json, sys
from types import SimpleNamespace
import torch
from emapg_cli.serve.rollout_server import make_server
from emapg_cli.serve.rollout_service import RolloutService, ServedModel
torch.set_num_threads(1)
params = {f"p{i}": ("float32", shape) for i, shape in enumerate(json.loads(sys.argv[1]))}
engine = SimpleNamespace(records_topk=False, load_weights=lambda model: None)
server = make_server(RolloutService(ServedModel(engine, "hf", {}, "-", params, "cpu")), "127.0.0.1", 0)
print(server.server_address[1], flush=True)
server.serve_forever()
'''

GLOO = r'''
import json, os, sys
import torch
sys.path.insert(0, sys.argv[4])
from weight_channel import SERVER, WeightChannel, join_store
torch.set_num_threads(1)
shapes, port, pushes = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
channel = WeightChannel(join_store("127.0.0.1", port, 60), SERVER, "gloo", 60)
buffers = [torch.empty(shape) for shape in shapes]
for _ in range(pushes):
    for b in buffers:
        channel.recv_into(b)
os._exit(0)  # a process ending with a live gloo group aborts in its destructors
'''


class _Model:
    def __init__(self, named):
        self.named = named

    def named_parameters(self):
        return iter(self.named)


def http_seconds(shapes: list, pushes: int) -> list[float]:
    import torch

    from emapg_cli.engines.remote import RemoteEngine

    proc = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(shapes)], stdout=subprocess.PIPE, text=True)
    try:
        engine = RemoteEngine(f"http://127.0.0.1:{int(proc.stdout.readline())}", timeout_s=600)
        model = _Model([(f"p{i}", torch.randn(shape)) for i, shape in enumerate(shapes)])
        engine.push_weights(model, 0)  # the server allocates its staging copy
        out = []
        for v in range(pushes):
            t0 = time.perf_counter()
            engine.push_weights(model, v + 1)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        proc.kill()
        proc.wait(30)


def gloo_seconds(shapes: list, pushes: int) -> list[float]:
    import torch

    from weight_channel import TRAINER, WeightChannel, host_store

    store = host_store("127.0.0.1", 60)
    proc = subprocess.Popen([sys.executable, "-c", GLOO, json.dumps(shapes), str(store.port), str(pushes + 1),
                             str(Path(__file__).resolve().parent)])
    try:
        channel = WeightChannel(store, TRAINER, "gloo", 60)
        tensors = [torch.randn(shape) for shape in shapes]
        for t in tensors:  # the first push: buffers touched, connections warm
            channel.send(t)
        out = []
        for _ in range(pushes):
            t0 = time.perf_counter()
            for t in tensors:
                channel.send(t)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (gloo, http) per layout")
    ap.add_argument("--pushes", type=int, default=2, help="timed pushes per transport and round")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    rates: dict[tuple[str, str], list[float]] = {}
    for name, shapes in LAYOUTS.items():
        gib = sum(torch.Size(s).numel() * 4 for s in shapes) / (1 << 30)
        for _ in range(args.rounds):
            for kind, measure in (("gloo", gloo_seconds), ("http", http_seconds)):
                rates.setdefault((name, kind), []).extend(gib / s for s in measure(shapes, args.pushes))
    for (name, kind), r in rates.items():
        r.sort()
        print(f"{name:12s} {kind}: median {r[len(r) // 2]:.2f} GiB/s (min {r[0]:.2f}, max {r[-1]:.2f}, n {len(r)})")


if __name__ == "__main__":
    main()
