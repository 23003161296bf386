"""Kill -9 mid-run, resume, and get final policy and anchor weights bit-identical to an uninterrupted run (CPU)."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import torch

from train_helpers import env, load_weights, run, tiny_overrides, train_cmd, write_dataset


def test_sigkill_and_resume_is_bit_identical(tiny_qwen2, tmp_path):
    data = write_dataset(tmp_path / "train.jsonl")
    opts = tiny_overrides(tiny_qwen2, data, steps=4)
    # The interrupted run: killed with SIGKILL as soon as its first checkpoint is complete.
    victim = subprocess.Popen(train_cmd(*opts, "--out", str(tmp_path / "b")), env=env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    reference = subprocess.Popen(train_cmd(*opts, "--out", str(tmp_path / "a")), env=env(),  # meanwhile, on the other core
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "b" / "checkpoints" / "step_1" / "state.json").exists() and victim.poll() is None:
        assert time.time() < deadline
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    _, ref_err = reference.communicate(timeout=180)
    assert reference.returncode == 0, ref_err[-2000:]
    assert not (tmp_path / "b" / "final").exists(), "the run finished before it could be killed"
    resumed = run(train_cmd("--resume", str(tmp_path / "b")))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for part in ("policy", "anchor"):
        a, b = load_weights(tmp_path / "a" / "final" / part), load_weights(tmp_path / "b" / "final" / part)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f"final {part} differs"
    # metrics.jsonl of the resumed run holds each step once, as the uninterrupted one does
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]
    ref_rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    res_rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward/mean", "loss/pg", "kl/value", "ema/distance"):
        assert [r.get(key) for r in ref_rows] == [r.get(key) for r in res_rows], key


def test_latest_checkpoint_ignores_half_written_ones(tmp_path):
    from emapg_cli.train.checkpoint import latest_checkpoint

    root = tmp_path / "checkpoints"
    for name in ("step_2", "step_10", ".tmp-step_12", "step_11"):
        (root / name).mkdir(parents=True)
    for name in ("step_2", "step_10", ".tmp-step_12"):
        (root / name / "state.json").write_text("{}")
    # step_11 has no state.json (cannot happen after the rename, but never trusted); .tmp-* is never picked
    assert latest_checkpoint(tmp_path) == root / "step_10"
