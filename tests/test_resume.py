"""Kill -9 mid-run, resume, and get final policy and anchor weights bit-identical to an uninterrupted run (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from emapg_cli.train.checkpoint import write_manifest

from train_helpers import killed_and_resumed, load_weights, run, run_many, tiny_overrides, train_cmd, tree_hash, write_dataset


def _killed_resumed_and_uninterrupted(opts: list[str], tmp_path) -> None:
    """`train_helpers.killed_and_resumed`, then both runs' final policy and anchor weights are bit-identical."""
    killed_and_resumed(opts, tmp_path)
    for part in ("policy", "anchor"):
        a, b = load_weights(tmp_path / "a" / "final" / part), load_weights(tmp_path / "b" / "final" / part)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f"final {part} differs"


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sigkill_and_resume_is_bit_identical(tiny_qwen2, tmp_path):
    data = write_dataset(tmp_path / "train.jsonl")
    _killed_resumed_and_uninterrupted(tiny_overrides(tiny_qwen2, data, steps=4), tmp_path)
    # metrics.jsonl of the resumed run holds each step once, as the uninterrupted one does
    ref_rows, res_rows = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["step"] for r in res_rows] == [0, 1, 2, 3, 4]
    for key in ("reward/mean", "loss/pg", "kl/value", "ema/distance"):
        assert [r.get(key) for r in ref_rows] == [r.get(key) for r in res_rows], key


def test_adaptive_beta_and_eta_sigkill_and_resume_is_bit_identical(tiny_qwen2, tmp_path):
    """Both controllers on (kl.target, ema.target_distance), 4 steps, killed (SIGKILL) once the first checkpoint is
    complete and resumed: final policy and anchor, and the logged kl/coef and ema/decay sequences, equal an
    uninterrupted run's; beta and eta follow their rules at every step (so a controller state lost on resume shows)."""
    data = write_dataset(tmp_path / "train.jsonl")
    # beta: 4 prompts x 4 responses = 16 per step, horizon 16: each step multiplies beta by 1 + e, e in [-0.2, 0.2];
    # the tiny run's KL (~0.005-0.04) sits around target 0.01, so beta moves every step.
    # eta: the tiny run's distances are ~1e-3, far below target 1, so H = 1 / (1 - eta) grows by the step limit 1.2.
    opts = tiny_overrides(tiny_qwen2, data, steps=4, **{"kl.target": 0.01, "kl.horizon": 16, "ema.target_distance": 1.0,
                                                         "data.eval": "null", "eval.anchor_every": 0})
    _killed_resumed_and_uninterrupted(opts, tmp_path)
    rows = {name: _rows(tmp_path / name)[1:] for name in "ab"}
    assert [r["step"] for r in rows["b"]] == [1, 2, 3, 4]
    for key in ("kl/coef", "kl/value", "kl/per_token", "ema/decay"):
        assert [r[key] for r in rows["b"]] == [r[key] for r in rows["a"]], key
    # beta, from the logged numbers: beta_1 = kl.coef = 0.1, beta_t+1 = beta_t * (1 + clip(KL_t / 0.01 - 1, +-0.2) * 16/16),
    # KL_t the step's kl/per_token (16 responses trained: nothing is dropped)
    betas = [r["kl/coef"] for r in rows["a"]]
    assert betas[0] == 0.1
    for t in range(3):
        e = min(max(rows["a"][t]["kl/per_token"] / 0.01 - 1, -0.2), 0.2)
        assert e != 0 and betas[t + 1] == pytest.approx(betas[t] * (1 + e), rel=1e-12), (t, betas)
    # eta: H grows by the step limit 1.2 per update from 1 / (1 - 0.5) = 2: 2.4 -> 2.88 -> 3.456 -> 4.1472
    decays = [r["ema/decay"] for r in rows["a"]]
    assert decays == pytest.approx([1 - 1 / (2 * 1.2**k) for k in (1, 2, 3, 4)], abs=1e-12)
    # the newest checkpoint holds the beta a fifth step would use and the eta in force (JSON floats: exact)
    state = json.loads((tmp_path / "b" / "checkpoints" / "step_4" / "state.json").read_text())
    e = min(max(rows["a"][3]["kl/per_token"] / 0.01 - 1, -0.2), 0.2)
    assert state["kl_coef"] == pytest.approx(betas[3] * (1 + e), rel=1e-12)
    assert state["ema_decay"] == decays[-1]


def test_resume_finished_bad_set_damaged_and_no_intact_checkpoint(tiny_qwen2, tmp_path):
    """Through the CLI, on one finished 2-step run: --resume leaves it as it is; a bad --set is refused
    with nothing written; a truncated newest policy.pt -> one warning line, training resumes from the
    previous checkpoint and redoes the lost step; every anchor.pt emptied -> exit 2, one error line, nothing written."""
    data = write_dataset(tmp_path / "train.jsonl")
    run_dir = tmp_path / "r"
    first = run(train_cmd(*tiny_overrides(tiny_qwen2, data, steps=2, **{"data.eval": "null"}), "--out", str(run_dir)))
    assert first.returncode == 0, first.stderr[-2000:]
    finished = tree_hash(run_dir)
    # both only read the run (neither claims the folder), so they run at once:
    again, bad = run_many([train_cmd("--resume", str(run_dir)),
                           train_cmd("--resume", str(run_dir), "--set", "optim.betas=[2,3]", "--set", "train.steps=3")])
    # resuming the finished run changes nothing (summary.json is not rewritten) and says so, exit 0
    # (whitespace joined: the console wraps at 80 columns, and where depends on the temp folder's length)
    assert again.returncode == 0 and f"{run_dir} is finished (2 steps" in " ".join(again.stdout.split())
    # a bad --set on resume is refused before anything is written (config.yaml keeps the good value)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == "error: optim.betas: each beta must be in [0, 1) (got [2, 3])"
    assert tree_hash(run_dir) == finished

    policy = run_dir / "checkpoints" / "step_2" / "policy.pt"
    policy.write_bytes(policy.read_bytes()[:100])
    resumed = run(train_cmd("--resume", str(run_dir), "--set", "train.steps=3"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("warning: passed over")]
    assert warnings == [f"warning: passed over damaged checkpoint(s) step_2 (policy.pt has 100 bytes, manifest.json says "
                        f"{json.loads((run_dir / 'checkpoints' / 'step_1' / 'manifest.json').read_text())['files']['policy.pt']['bytes']}); "
                        "resuming from step_1"]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3

    for step in (1, 2, 3):
        (run_dir / "checkpoints" / f"step_{step}" / "anchor.pt").write_bytes(b"")
    # and the newest one's policy.pt is a pickled payload that would create `marker` when unpickled,
    # under a manifest recomputed over it (so only the weights_only load stands in its way)
    marker = tmp_path / "pwned"
    step3 = run_dir / "checkpoints" / "step_3"
    torch.save({"weight": OpenOnUnpickle(marker)}, step3 / "policy.pt")
    write_manifest(step3)
    before = tree_hash(run_dir)
    refused = run(train_cmd("--resume", str(run_dir), "--set", "train.steps=4"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no intact checkpoint in") and "step_3 (policy.pt does not load" in last
    assert "step_2 (anchor.pt has 0 bytes" in last and "step_1 (anchor.pt has 0 bytes" in last
    assert not marker.exists(), "resume unpickled code"
    assert tree_hash(run_dir) == before


class OpenOnUnpickle:
    """Unpickling it calls open(marker, "w")."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))
