"""Training under faults (opt-in, `-m slow`: each case trains a tiny model in subprocesses):
SIGKILL at random points of checkpointing, then resume, bit-identical to an uninterrupted run; a full
disk while checkpointing is one line, exit 2, and the run resumes."""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import time

import pytest
import torch

from train_helpers import env, load_weights, run, tiny_overrides, train_cmd, write_dataset

pytestmark = pytest.mark.slow


def _reference(tiny_qwen2, tmp_path, opts):
    ref = run(train_cmd(*opts, "--out", str(tmp_path / "ref")))
    assert ref.returncode == 0, ref.stderr[-2000:]
    return {part: load_weights(tmp_path / "ref" / "final" / part) for part in ("policy", "anchor")}


def test_sigkill_at_random_points_of_checkpointing_then_resume(tiny_qwen2, tmp_path):
    """Kill -9 while a checkpoint is being written (its `.tmp-step_N` folder exists), after a random
    delay; resume; the final weights equal the uninterrupted run's. The seed is printed."""
    seed = int(os.environ.get("EMAPG_FUZZ_SEED") or random.SystemRandom().randrange(2**31))
    kills = int(os.environ.get("EMAPG_KILLS", "3"))
    print(f"kill seed {seed} ({kills} kills)")
    rng = random.Random(seed)
    data = write_dataset(tmp_path / "train.jsonl")
    opts = tiny_overrides(tiny_qwen2, data, steps=4)
    ref = _reference(tiny_qwen2, tmp_path, opts)
    for i in range(kills):
        out = tmp_path / f"victim{i}"
        step, delay = rng.randrange(1, 3), rng.uniform(0.0, 0.3)  # steps 1-2 of 4: the run is not done yet
        victim = subprocess.Popen(train_cmd(*opts, "--out", str(out)), env=env(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while not (out / "checkpoints" / f".tmp-step_{step}").exists() and victim.poll() is None:
            assert time.time() < deadline
            time.sleep(0.005)
        time.sleep(delay)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert victim.returncode == -signal.SIGKILL, f"seed {seed}, kill {i}: the run ended before the kill"
        resumed = run(train_cmd("--resume", str(out)), timeout=300)
        assert resumed.returncode == 0, f"seed {seed}, kill {i} (step {step}, +{delay:.3f}s): {resumed.stderr[-2000:]}"
        for part in ("policy", "anchor"):
            got = load_weights(out / "final" / part)
            assert all(torch.equal(ref[part][k], got[k]) for k in ref[part]), f"seed {seed}, kill {i}: final {part} differs"


def test_disk_full_while_checkpointing_then_resume(tiny_qwen2, tmp_path):
    data = write_dataset(tmp_path / "train.jsonl")
    opts = tiny_overrides(tiny_qwen2, data, steps=2)
    out = tmp_path / "run"

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))  # below one checkpoint file

    r = subprocess.run(train_cmd(*opts, "--out", str(out)), env=env(), capture_output=True, text=True, timeout=300,
                       preexec_fn=small_files)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert last.startswith("error: writing in") and str(out) in last, last
    resumed = run(train_cmd("--resume", str(out)), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (out / "final" / "policy" / "model.safetensors").is_file()
