"""Checkpoint files load without running code; a manifest (sizes + sha256, written last) lets resume
pass over a damaged checkpoint to the newest intact one, one line saying so; none intact is a UserError."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from emapg_cli.errors import UserError
from emapg_cli.train import checkpoint as ckpt
from emapg_cli.train.parallel import Replicated


class MainProcess:
    """The Accelerator attributes checkpointing uses, for one process."""

    is_main_process, process_index, num_processes = True, 0, 1

    def wait_for_everyone(self):
        pass


class Evil:
    """Unpickling it calls open(marker, "w"): any loader that runs pickled code creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _objects(seed: int):
    """A small policy/anchor/AdamW/scheduler set whose values depend on `seed`."""
    torch.manual_seed(seed)
    policy, anchor = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(policy.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    policy(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return dict(scorer=policy, policy=policy, anchor=anchor, optimizer=opt, scheduler=sched)


def _save(run: Path, step: int) -> dict:
    objs = _objects(step)
    ckpt.save_checkpoint(Replicated(MainProcess()), run, step, **objs, state={"skipped": step}, keep=0)
    return objs


def _load(run: Path, notes: list[str] | None = None):
    fresh = _objects(99)
    saved = ckpt.load_checkpoint(Replicated(MainProcess()), run, **fresh, notify=(notes if notes is not None else []).append)
    return saved, fresh


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_manifest_records_every_file_and_an_intact_checkpoint_loads(tmp_path):
    _save(tmp_path, 1)
    objs = _save(tmp_path, 2)
    folder = tmp_path / "checkpoints" / "step_2"
    manifest = json.loads((folder / "manifest.json").read_text())
    names = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == names == ["anchor.pt", "optimizer.pt", "policy.pt", "rng_rank0.json", "scheduler.pt", "state.json"]
    assert all(manifest["files"][n]["bytes"] == (folder / n).stat().st_size for n in names)
    notes: list[str] = []
    saved, fresh = _load(tmp_path, notes)
    assert saved["step"] == 2 and saved["skipped"] == 2 and notes == []
    assert _same(fresh["policy"], objs["policy"]) and _same(fresh["anchor"], objs["anchor"])
    assert fresh["scheduler"].last_epoch == 1


def test_rng_states_round_trip_through_json(tmp_path):
    """The RNG file is plain JSON; restoring it replays the same draws of Python, NumPy and torch."""
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    state = json.loads(json.dumps(ckpt.rng_state()))
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    ckpt.set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first


def _truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path):  # same size, other content: only the sha256 tells
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated policy": ("policy.pt", _truncate, "policy.pt has"),
    "truncated optimizer": ("optimizer.pt", _truncate, "optimizer.pt has"),
    "truncated rng": ("rng_rank0.json", _truncate, "rng_rank0.json has"),
    "bad state.json": ("state.json", lambda p: p.write_text("{not json"), "state.json has"),
    "flipped byte in policy": ("policy.pt", _flip_byte, "policy.pt sha256 differs"),
    "missing scheduler": ("scheduler.pt", lambda p: p.unlink(), "scheduler.pt missing"),
    "0-byte anchor": ("anchor.pt", lambda p: p.write_bytes(b""), "anchor.pt has 0 bytes"),
    "no manifest": ("manifest.json", lambda p: p.unlink(), "no manifest.json"),
    "bad manifest": ("manifest.json", lambda p: p.write_text("[]"), "manifest.json unreadable"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, case):
    older = _save(tmp_path, 1)
    _save(tmp_path, 2)
    name, damage, reason = DAMAGE[case]
    damage(tmp_path / "checkpoints" / "step_2" / name)
    notes: list[str] = []
    saved, fresh = _load(tmp_path, notes)
    assert saved["step"] == 1
    assert _same(fresh["policy"], older["policy"]) and _same(fresh["anchor"], older["anchor"])
    assert len(notes) == 1 and "\n" not in notes[0]
    assert f"step_2 ({reason}" in notes[0] and notes[0].endswith("resuming from step_1")


def test_no_intact_checkpoint_is_one_line_user_error(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "checkpoints" / "step_1" / "policy.pt").unlink()
    _truncate(tmp_path / "checkpoints" / "step_2" / "optimizer.pt")
    with pytest.raises(UserError) as err:
        _load(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("no intact checkpoint in")
    assert "step_2 (optimizer.pt has" in msg and "step_1 (policy.pt missing)" in msg


def test_no_checkpoint_at_all_is_a_fresh_start(tmp_path):
    assert _load(tmp_path)[0] is None
    (tmp_path / "checkpoints" / ".tmp-step_3").mkdir(parents=True)  # an interrupted save is never listed
    assert ckpt.checkpoint_dirs(tmp_path) == [] and _load(tmp_path)[0] is None


def test_pickled_code_in_a_checkpoint_never_runs(tmp_path):
    """A `__reduce__` payload as the legacy rng_rank0.pt (in a checkpoint without a manifest) and as
    policy.pt (with a manifest recomputed over it, so it passes verification) is never executed:
    the first checkpoint is passed over, the second fails weights_only loading; both are named."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    marker = tmp_path / "pwned"
    # step_2: policy.pt replaced by the payload, manifest rewritten to match it
    step2 = tmp_path / "checkpoints" / "step_2"
    torch.save({"weight": Evil(marker)}, step2 / "policy.pt")
    ckpt.write_manifest(step2)
    # step_3: an old-format checkpoint whose RNG file is the payload (no manifest)
    step3 = tmp_path / "checkpoints" / "step_3"
    shutil.copytree(tmp_path / "checkpoints" / "step_1", step3)
    (step3 / "manifest.json").unlink()
    (step3 / "rng_rank0.json").unlink()
    torch.save({"python": Evil(marker)}, step3 / "rng_rank0.pt")
    notes: list[str] = []
    saved, _ = _load(tmp_path, notes)
    assert saved["step"] == 1
    assert not marker.exists(), "unpickling ran code"
    assert len(notes) == 1 and "step_3 (no manifest.json)" in notes[0] and "step_2 (policy.pt does not load" in notes[0]
    # and with no intact checkpoint left: a UserError, still without running the payload
    shutil.rmtree(tmp_path / "checkpoints" / "step_1")
    with pytest.raises(UserError, match="no intact checkpoint"):
        _load(tmp_path)
    assert not marker.exists()


def test_anchor_missing_because_config_changed_is_a_user_error(tmp_path):
    """A run trained with kl.coef=0 has no anchor.pt; resuming it with a KL term is a config error, not damage."""
    objs = _objects(1)
    objs["anchor"] = None
    ckpt.save_checkpoint(Replicated(MainProcess()), tmp_path, 1, **objs, state={}, keep=0)
    with pytest.raises(UserError, match="holds no EMA anchor"):
        _load(tmp_path)


def test_checkpoint_of_another_shape_is_a_user_error(tmp_path):
    _save(tmp_path, 1)
    other = _objects(5)
    other["policy"] = other["scorer"] = torch.nn.Linear(5, 3)
    with pytest.raises(UserError, match="does not fit this run's config"):
        ckpt.load_checkpoint(Replicated(MainProcess()), tmp_path, **other, notify=print)
