"""LoRA: adapter counts by hand, the adapter-only EMA anchor, and a tiny run with checkpoints, resume and final weights."""

from __future__ import annotations

import json

import pytest
import torch

from emapg_cli.config import load_config
from emapg_cli.errors import UserError
from emapg_cli.train.plan import ModelShapes, load_model_config, lora_params, make_plan
from train_helpers import load_weights, run, tiny_overrides, train_cmd, write_dataset

peft = pytest.importorskip("peft")


def lora_model(path, r=4):
    from emapg_cli.train.loading import load_policy

    cfg = load_config(overrides=[f"model.path={path}", f"lora.r={r}"])
    return load_policy(cfg.model, cfg.lora)


def test_adapter_count_by_hand_matches_peft(tiny_qwen2):
    # tiny Qwen2: h = 64, q = 64, kv = 32, I = 128, 2 layers; r = 4 adds r x (in + out) per layer:
    #   q 4 x 128 = 512, k 4 x 96 = 384, v 384, o 512, gate 4 x 192 = 768, up 768, down 768 -> 4,096 per layer, 8,192 in all
    shapes = ModelShapes.from_hf_config(load_model_config(str(tiny_qwen2)))
    assert lora_params(shapes, 4, load_config().lora.target_modules) == 8_192
    model = lora_model(tiny_qwen2)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 8_192


def test_plan_shows_an_adapter_sized_anchor(tiny_qwen2):
    mc = load_model_config(str(tiny_qwen2))
    full = {t.name: t.bytes for t in make_plan(load_config(overrides=[f"model.path={tiny_qwen2}"]), mc).memory}
    lora = {t.name: t.bytes for t in make_plan(load_config(overrides=[f"model.path={tiny_qwen2}", "lora.r=4"]), mc).memory}
    assert full["EMA anchor"] == 90_880 * 4  # every parameter, fp32
    assert lora["EMA anchor"] == 8_192 * 4 and lora["AdamW moments"] == 2 * 8_192 * 4


def test_lora_config_rejects_what_it_does_not_support():
    for bad in ("train.parallel=fsdp", "kl.estimator=exact", "eval.anchor_every=5"):  # vLLM: lora.sync (test_lora_sync.py)
        with pytest.raises(UserError, match="lora.r > 0 does not support"):
            load_config(overrides=["lora.r=8", bad])


def test_adapter_anchor_swaps_and_restores(tiny_qwen2):
    from emapg_cli.train.loading import ema_tensors, make_anchor
    from emapg_cli.train.logprobs import TokenScorer

    policy = lora_model(tiny_qwen2)
    anchor = make_anchor(policy)
    assert [t.shape for t in anchor.parameters()] == [t.shape for t in ema_tensors(policy)]  # the shadow: adapters only
    ids = torch.randint(3, 200, (2, 9))  # [B, P + R]: 4 prompt + 5 response tokens
    args = (ids, torch.ones_like(ids), 4, torch.ones(2, 5, dtype=torch.bool))
    before = TokenScorer(policy)(*args).logp
    assert torch.equal(anchor.scorer()(*args).logp, before)  # same adapters: the same pass
    with torch.no_grad():
        for t in ema_tensors(policy):
            t.add_(0.5)  # B starts at 0: moving both A and B changes the output
    moved = TokenScorer(policy)(*args).logp
    assert not torch.allclose(moved, before)
    assert torch.equal(anchor.scorer()(*args).logp, before)  # the anchor still has the old adapters
    assert torch.equal(TokenScorer(policy)(*args).logp, moved)  # and the policy got its own back


@pytest.mark.slow  # three training runs (~70 s): out of CI's default run for its 20-minute budget (`pytest -m slow`)
def test_lora_run_checkpoints_resumes_and_saves_merged_weights(tiny_qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    data = write_dataset(tmp_path / "train.jsonl")
    opts = tiny_overrides(tiny_qwen2, data, steps=2, **{"lora.r": 4, "eval.anchor_every": 0, "data.eval": "null"})
    straight = run(train_cmd(*opts, "--out", str(tmp_path / "a")))
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = run(train_cmd(*opts, "--set", "train.steps=1", "--out", str(tmp_path / "b")))
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = run(train_cmd("--resume", str(tmp_path / "b"), "--set", "train.steps=2"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for part in ("policy", "anchor"):
        a, b = load_weights(tmp_path / "a" / "final" / part), load_weights(tmp_path / "b" / "final" / part)
        assert all(torch.equal(a[k], b[k]) for k in a), part
        assert (tmp_path / "a" / "final" / part / "adapter" / "adapter_config.json").is_file()
    # final/policy is a plain transformers model (adapters merged): same names as the base, weights moved
    merged = load_weights(tmp_path / "a" / "final" / "policy")
    base = load_weights(tiny_qwen2)
    assert merged.keys() == base.keys()
    assert any(not torch.equal(merged[k], base[k]) for k in base if "q_proj.weight" in k)
    AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "final" / "policy")
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["ema/distance"] > 0
