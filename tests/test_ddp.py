"""Two CPU processes (DDP over gloo, launched with `accelerate launch`) train together and end with identical anchors."""

from __future__ import annotations

import json
import socket
import sys

from train_helpers import LAUNCHER, run, tiny_overrides, write_dataset


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_keep_identical_anchors(tiny_qwen2, tmp_path):
    data = write_dataset(tmp_path / "train.jsonl")
    opts = tiny_overrides(tiny_qwen2, data, steps=2, **{"train.save_every": 0, "eval.anchor_every": 0})
    # `accelerate launch --multi_gpu` on a machine without GPUs starts the ranks through torchrun and the
    # Accelerator runs them as MULTI_CPU over gloo (`--cpu` instead would need MPI for several processes).
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           LAUNCHER, "train", *opts, "--out", str(tmp_path / "run")]
    proc = run(cmd, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    hashes = summary["anchor_sha256_per_rank"]
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    assert (tmp_path / "run" / "final" / "anchor" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # logged once, by the main process
    assert rows[-1]["ema/distance"] > 0
