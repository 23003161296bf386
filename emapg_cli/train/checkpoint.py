"""Checkpoints: `checkpoints/step_N/` written under a temporary name and renamed, so resume never sees half of one.

A checkpoint holds the policy and anchor state dicts, optimizer and scheduler state, each rank's
RNG states and `state.json` (step = the data cursor, counters, elapsed time, initial accuracy).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from emapg_cli.errors import UserError

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, path), oldest first (temporary folders are ignored)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "state.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint, or None."""
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1][1] if dirs else None


def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` saved."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(strategy, run_dir: Path, step: int, *, scorer, policy, anchor, optimizer, scheduler,
                    state: dict[str, Any], keep: int = 0) -> Path:
    """Write checkpoints/step_{step}/ atomically (every rank must call it); prune to the newest `keep` (0: all).

    Model and optimizer states are whole (unsharded) whatever the `strategy` (train/parallel.py);
    gathering them is collective, so every rank takes part and the main process writes.
    """
    accelerator = strategy.acc
    policy_state = strategy.model_state(policy)
    anchor_state = strategy.model_state(anchor) if anchor is not None else None
    optimizer_state = strategy.optimizer_state(scorer, optimizer)
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng_rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        torch.save(policy_state, tmp / "policy.pt")
        if anchor_state is not None:
            torch.save(anchor_state, tmp / "anchor.pt")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step, "parallel": strategy.name}, indent=2))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep > 0:
            for _, old in checkpoint_dirs(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(strategy, path: Path, *, scorer, policy, anchor, optimizer, scheduler) -> dict[str, Any]:
    """Restore a checkpoint into the live objects (every rank reads the files); returns its state.json."""
    path = Path(path)
    accelerator = strategy.acc
    saved = json.loads((path / "state.json").read_text())
    written_by = saved.get("parallel", "replicated")
    if written_by != strategy.name:
        raise UserError(f"{path} was written by a {written_by} run and this one is {strategy.name}: resume with the "
                        "train.parallel that wrote it, on several processes for fsdp (optimizer states differ in format)")

    def load(name: str):
        return torch.load(path / name, map_location="cpu", weights_only=True)

    strategy.load_model_state(policy, load("policy.pt"))
    if anchor is not None:
        strategy.load_model_state(anchor, load("anchor.pt"))
    strategy.load_optimizer_state(scorer, optimizer, load("optimizer.pt"))
    scheduler.load_state_dict(load("scheduler.pt"))
    rng = path / f"rng_rank{accelerator.process_index}.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    return saved
