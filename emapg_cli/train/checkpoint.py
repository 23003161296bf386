"""Checkpoints: `checkpoints/step_N/` written under a temporary name and renamed, so resume never sees half of one.

A checkpoint holds the policy and EMA anchor state dicts (a teacher anchor: only its path and fingerprint, in
state.json), optimizer and scheduler state (`*.pt`, read back with `torch.load(weights_only=True)`: tensors and plain containers only, never arbitrary
objects), each rank's RNG states (`rng_rank{R}.json`: plain JSON), `state.json` (step = the data
cursor, counters, elapsed time, initial accuracy) and, written last, `manifest.json`: the size and
sha256 of every other file. Resume verifies the manifest of each checkpoint, newest first, and
takes the newest intact one, saying which ones it passed over and why.
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
from emapg_cli.fileio import sha256_file

CHECKPOINTS = "checkpoints"
#: anchor.rule=bema's buffers (train/anchor_rule.BEMA_FILE): theta_0 and BEMA's EMA.
ANCHOR_RULE_FILE = "anchor_rule.pt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class DamagedCheckpoint(Exception):
    """A checkpoint file is missing, truncated, altered or unreadable (the message says which and how)."""


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """The renamed (complete or damaged) checkpoints of a run as (step, path), oldest first; the
    temporary `.tmp-step_N` folders of an interrupted save are never listed."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


# ---------------------------------------------------------------------------------- RNG states
def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from, as plain JSON values (byte states as hex)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return state


def _byte_tensor(hex_text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes.fromhex(hex_text)), dtype=torch.uint8)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` saved (ValueError/TypeError/KeyError on a malformed record)."""
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    python = (int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss))
    numpy = (str(name), np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
    torch_state = _byte_tensor(state["torch"])
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(torch_state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_byte_tensor(s) for s in state["cuda"]])


# ---------------------------------------------------------------------------------- manifest
def write_manifest(folder: Path) -> None:
    """`manifest.json`: size and sha256 of every file in `folder` (call it after all of them are written)."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=2))
    os.replace(tmp, folder / MANIFEST)


def verify(folder: Path, required: tuple[str, ...]) -> None:
    """Raise DamagedCheckpoint unless `folder`'s manifest is readable, lists `required`, and every file
    it lists is present with its recorded size and sha256."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        entries = {name: (int(e["bytes"]), str(e["sha256"])) for name, e in files.items()}
    except FileNotFoundError:
        raise DamagedCheckpoint(f"no {MANIFEST}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedCheckpoint(f"{MANIFEST} unreadable ({type(e).__name__})") from None
    for name in required:
        if name not in entries:
            raise DamagedCheckpoint(f"{name} not in {MANIFEST}")
    for name, (size, digest) in entries.items():
        path = folder / name
        if not path.is_file():
            raise DamagedCheckpoint(f"{name} missing")
        if path.stat().st_size != size:
            raise DamagedCheckpoint(f"{name} has {path.stat().st_size} bytes, {MANIFEST} says {size}")
        if sha256_file(path) != digest:
            raise DamagedCheckpoint(f"{name} sha256 differs from {MANIFEST}")


# ---------------------------------------------------------------------------------- save
def save_checkpoint(strategy, run_dir: Path, step: int, *, scorer, policy, anchor, optimizer, scheduler,
                    state: dict[str, Any], keep: int = 0, extra=None) -> Path:
    """Write checkpoints/step_{step}/ atomically (every rank must call it); prune to the newest `keep` (0: all).
    `extra`: the anchor rule's own tensors (anchor.rule=bema's `BemaBuffers`, a `state_dict()`), saved as
    anchor_rule.pt; None: none.

    Model and optimizer states are whole (unsharded) whatever the `strategy` (train/parallel.py);
    gathering them is collective, so every rank takes part and the main process writes. The
    manifest is written after every rank's files, then the folder is renamed into place.
    """
    from emapg_cli.train.teacher import teacher_record

    accelerator = strategy.acc
    policy_state = strategy.model_state(policy)
    teacher = teacher_record(anchor)  # a teacher is not saved: its path and fingerprint go into state.json
    anchor_state = strategy.model_state(anchor) if anchor is not None and teacher is None else None
    state = {**state, "teacher": teacher} if teacher is not None else state
    optimizer_state = strategy.optimizer_state(scorer, optimizer)
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    (tmp / f"rng_rank{accelerator.process_index}.json").write_text(json.dumps(rng_state()))
    if accelerator.is_main_process:
        torch.save(policy_state, tmp / "policy.pt")
        if anchor_state is not None:
            torch.save(anchor_state, tmp / "anchor.pt")
        if extra is not None:
            torch.save(extra.state_dict(), tmp / ANCHOR_RULE_FILE)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step, "parallel": strategy.name}, indent=2))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep > 0:
            for _, old in checkpoint_dirs(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def save_final(strategy, run_dir: Path, models: dict[str, Any], tokenizer, dtype: torch.dtype, lora: bool) -> None:
    """final/<name> of each of `models` (policy, anchor; None: skipped) in save_pretrained format (whole weights;
    gathering is collective: every rank calls this), in `dtype` (model.save_dtype, default model.dtype, the
    transformers convention; checkpoints keep the master weights). `lora`: merged weights plus the adapter. A teacher
    anchor (anchor.source=teacher) is skipped: summary.json names its path and fingerprint."""
    from emapg_cli.models.loading import cast_state, set_config_dtype
    from emapg_cli.train.teacher import teacher_record

    main = strategy.acc.is_main_process
    for name, model in models.items():
        if model is None or teacher_record(model) is not None:  # a teacher anchor is not ours to save
            continue
        out = Path(run_dir) / "final" / name
        if lora:  # merged weights in save_pretrained format, plus the adapter
            if main:
                from emapg_cli.train.lora import save_merged

                save_merged(model, out, tokenizer, dtype=dtype)
            continue
        state = strategy.model_state(model)
        if main:
            model.save_pretrained(out, state_dict=cast_state(state, dtype))
            set_config_dtype(out, dtype)
            tokenizer.save_pretrained(out)
    strategy.acc.wait_for_everyone()


# ---------------------------------------------------------------------------------- load
def _read(folder: Path, rank: int, with_anchor: bool, with_rule: bool = False) -> dict[str, Any]:
    """Every file this rank needs from a verified checkpoint, deserialised without running code
    (DamagedCheckpoint naming the file when one does not load)."""
    def tensors(name: str):
        try:
            return torch.load(folder / name, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated, not a torch file, or objects outside weights_only's allow-list
            raise DamagedCheckpoint(f"{name} does not load ({_one_line(e, 200)})") from None

    def plain(name: str) -> Any:
        try:
            value = json.loads((folder / name).read_text())
        except (OSError, ValueError) as e:
            raise DamagedCheckpoint(f"{name} is not valid JSON ({type(e).__name__})") from None
        if not isinstance(value, dict):
            raise DamagedCheckpoint(f"{name} is not a JSON object")
        return value

    saved = plain("state.json")
    if not isinstance(saved.get("step"), int):
        raise DamagedCheckpoint("state.json has no integer step")
    out = {"state": saved, "policy": tensors("policy.pt"), "optimizer": tensors("optimizer.pt"),
           "scheduler": tensors("scheduler.pt"), "rng": plain(f"rng_rank{rank}.json")}
    if with_anchor:
        out["anchor"] = tensors("anchor.pt")
    if with_rule:
        out["anchor_rule"] = tensors(ANCHOR_RULE_FILE)
    return out


def _one_line(e: BaseException, limit: int = 300) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


def load_checkpoint(strategy, run_dir: Path, *, scorer, policy, anchor, optimizer, scheduler,
                    notify=print, extra=None) -> Optional[dict[str, Any]]:
    """Restore the newest intact checkpoint of `run_dir` into the live objects (every rank reads the files).

    Returns its state.json, or None when the run has no checkpoint. A damaged checkpoint (manifest
    check or a file that does not load) is passed over with one line through `notify`; none intact
    is a UserError. A checkpoint that does not fit this run's config (parallel strategy, no anchor,
    other shapes) is a UserError too: an older checkpoint would not fit either. `extra`: the anchor rule's own
    tensors to restore (`save_checkpoint`'s), which the checkpoint must hold.
    """
    from emapg_cli.train.teacher import check_same_teacher, teacher_record

    accelerator = strategy.acc
    rank = accelerator.process_index
    ema_anchor = anchor if teacher_record(anchor) is None else None  # a teacher is re-loaded from its path, not restored
    found = checkpoint_dirs(run_dir)
    if not found:
        return None
    damaged: list[str] = []
    for _, path in reversed(found):
        try:
            verify(path, ("state.json", "policy.pt", "optimizer.pt", "scheduler.pt", f"rng_rank{rank}.json"))
            files = _read(path, rank, with_anchor=ema_anchor is not None and (path / "anchor.pt").is_file(),
                          with_rule=extra is not None and (path / ANCHOR_RULE_FILE).is_file())
        except DamagedCheckpoint as e:
            damaged.append(f"{path.name} ({e})")
            continue
        written_by = files["state"].get("parallel", "replicated")
        if written_by != strategy.name:
            raise UserError(f"{path} was written by a {written_by} run and this one is {strategy.name}: resume with "
                            "the train.parallel that wrote it, on several processes for fsdp (optimizer states differ in format)")
        if anchor is not None:
            check_same_teacher(files["state"].get("teacher"), anchor, path)
        if ema_anchor is not None and "anchor" not in files:
            raise UserError(f"{path} holds no EMA anchor (the run was trained with kl.coef=0): resume with "
                            "kl.coef=0, or start a new run to train with a KL term")
        if extra is not None and "anchor_rule" not in files:
            raise UserError(f"{path} holds no {ANCHOR_RULE_FILE} (BEMA's theta_0 and EMA): it was trained with another "
                            "anchor.rule; resume with that rule, or start a new run")
        try:
            strategy.load_model_state(policy, files["policy"])
            if ema_anchor is not None:
                strategy.load_model_state(ema_anchor, files["anchor"])
            if extra is not None:
                extra.load_state_dict(files["anchor_rule"])
            strategy.load_optimizer_state(scorer, optimizer, files["optimizer"])
            scheduler.load_state_dict(files["scheduler"])
            set_rng_state(files["rng"])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
            raise UserError(f"{path} does not fit this run's config: {_one_line(e)}") from None
        if damaged:
            notify(f"warning: passed over damaged checkpoint(s) {'; '.join(damaged)}; resuming from {path.name}")
        return files["state"]
    raise UserError(f"no intact checkpoint in {Path(run_dir) / CHECKPOINTS}: {'; '.join(damaged)}")
