"""The paper's K3 clamps, and staged response lengths resumed across a stage boundary (real CLI, tiny model)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from emapg_cli.kl import kl_per_token
from train_helpers import load_weights, run, tiny_overrides, train_cmd, write_dataset


def test_k3_clamps_by_hand():
    logp = torch.zeros(3, requires_grad=True)
    ref = torch.tensor([-1.0, -30.0, 30.0])
    kl = kl_per_token("k3", "reverse", logp=logp, ref_logp=ref, log_ratio_clamp=20.0, estimate_clamp=10.0)
    # token 0: log w = -1: K3 = 1 + e^-1 - 1 = e^-1 (inside both clamps); dK3/dl = 1 - e^-1
    # token 1: log w = -30 -> -20: K3 = 20 + e^-20 - 1 = 19.000... -> 10 (estimate clamp); gradient 0
    # token 2: log w = 30 -> 20: K3 = -20 + e^20 - 1 = 4.85e8 -> 10; gradient 0
    assert torch.allclose(kl, torch.tensor([math.exp(-1), 10.0, 10.0]))
    kl.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([1 - math.exp(-1), 0.0, 0.0]))
    # without the clamps token 1 is 29 + e^-30 and carries gradient 1 - e^-30
    free = kl_per_token("k3", "reverse", logp=torch.zeros(3), ref_logp=ref)
    assert abs(float(free[1]) - 29.0) < 1e-5


@pytest.mark.slow  # two trainings, ~30 s (CI budget)
def test_stages_resume_across_the_boundary(tiny_qwen2, tmp_path):
    data = write_dataset(tmp_path / "train.jsonl")
    stages = "stages=[{steps: 1, max_new_tokens: 2}, {steps: 2, max_new_tokens: 5}]"
    opts = [*tiny_overrides(tiny_qwen2, data, steps=3, **{"data.eval": "null"}), "--set", stages]
    ref = run(train_cmd(*opts, "--out", str(tmp_path / "a")))
    assert ref.returncode == 0, ref.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("rollout/max_new_tokens") for r in rows] == [None, 2.0, 5.0, 5.0]
    assert rows[1]["rollout/response_len"] <= 2 and rows[2]["rollout/response_len"] <= 5  # lengths follow the stage
    # stop at the stage boundary (train.steps=1), then resume to 3: the same weights as the straight run
    first = run(train_cmd(*opts, "--set", "train.steps=1", "--out", str(tmp_path / "b")))
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = run(train_cmd("--resume", str(tmp_path / "b"), "--set", "train.steps=3"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = load_weights(tmp_path / "a" / "final" / "policy"), load_weights(tmp_path / "b" / "final" / "policy")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_b = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("rollout/max_new_tokens") for r in rows_b] == [None, 2.0, 5.0, 5.0]
