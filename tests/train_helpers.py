"""Shared pieces of the training tests: a tiny arithmetic dataset, the CLI launcher, tiny-run overrides."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

LAUNCHER = str(Path(__file__).with_name("train_launcher.py"))


def write_dataset(path: Path, n: int = 12) -> Path:
    """`n` rows {id, question "a+b", answer} in the canonical JSONL schema."""
    rows = [{"id": f"q{i}", "question": f"{i % 7}+{i % 5}", "answer": str(i % 7 + i % 5)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_overrides(model: Path, data: Path, steps: int = 3, **extra: object) -> list[str]:
    """--set options for a few-second run: 4 prompts x 4 responses of <= 6 tokens, 2 mini-batches."""
    values = {
        "model.path": model, "data.train": data, "data.eval": data, "data.eval_limit": 4,
        "rollout.reward": "test_digit", "rollout.prompts_per_step": 4, "rollout.n": 4, "rollout.max_new_tokens": 6,
        "train.steps": steps, "train.mini_batch_prompts": 2, "train.micro_batch_size": 4, "train.save_every": 1,
        "train.keep_checkpoints": 0, "optim.lr": 0.01, "kl.estimator": "topk", "kl.k": 8, "kl.coef": 0.1,
        "ema.decay": 0.5, "ema.update_period": 1, "eval.max_new_tokens": 4, "eval.anchor_every": 2,
    }
    values.update(extra)
    out: list[str] = []
    for k, v in values.items():
        out += ["--set", f"{k}={v}"]
    return out


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, LAUNCHER, "train", *args]


def env() -> dict[str, str]:
    """One thread per process: the test processes share two cores."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env())


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def tree_hash(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` by relative path (to show a command changed nothing)."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OneProcess:
    """The Accelerator methods the update and finite_step use, for one process on CPU."""

    device, num_processes = torch.device("cpu"), 1

    def backward(self, loss):
        loss.backward()

    def no_sync(self, model):
        return contextlib.nullcontext()

    def clip_grad_norm_(self, params, max_norm):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
