"""LoRA weight sync to an engine with weights of its own (engines/lora_sync.py; vLLM's side against a fake `vllm`):
the merge arithmetic by hand, merged tensors against peft's own merge, adapter folders, and the engine's adapter
loading (a new name per push, the old one removed, generation passing the current one). The real vLLM run is
tests/test_lora_vllm.py (`-m vllm`)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from emapg_cli.engines.base import SamplingParams
from emapg_cli.engines.lora_sync import AdapterFolders, is_peft, merge_lora, merged_named_weights
from emapg_cli.engines.vllm import VLLM_LORA_RANKS, vllm_lora_rank
from emapg_cli.errors import UserError
import test_vllm_engine
from test_vllm_engine import FakeLLM, make_engine

fake_vllm = test_vllm_engine.fake_vllm  # the fake `vllm` package fixture, reused


def test_merge_lora_by_hand():
    # W = [[1, 2], [3, 4]], rank 1: A = [[1, -1]] (r x in), B = [[2], [0.5]] (out x r), alpha = 4, r = 1 -> s = 4
    # B A = [[2*1, 2*-1], [0.5*1, 0.5*-1]] = [[2, -2], [0.5, -0.5]]; s B A = [[8, -8], [2, -2]]
    # W + s B A = [[1+8, 2-8], [3+2, 4-2]] = [[9, -6], [5, 2]]
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    a = torch.tensor([[1.0, -1.0]])
    b = torch.tensor([[2.0], [0.5]])
    merged = merge_lora(w, a, b, 4 / 1)
    assert torch.equal(merged, torch.tensor([[9.0, -6.0], [5.0, 2.0]]))
    assert torch.equal(w, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # a copy: the base weight is untouched
    # bfloat16 base weights are merged in float32 (the adapters' dtype): 1 + 4 * 2**-9 is not a bfloat16 number
    merged = merge_lora(torch.ones(1, 1, dtype=torch.bfloat16), torch.ones(1, 1), torch.full((1, 1), 2.0**-9), 4.0)
    assert merged.dtype == torch.float32 and merged.item() == 1 + 2**-7


def test_merged_named_weights_equal_peft_merge_and_unload(tiny_qwen2):
    pytest.importorskip("peft")
    from emapg_cli.config import load_config
    from emapg_cli.train.loading import load_policy

    cfg = load_config(overrides=[f"model.path={tiny_qwen2}", "lora.r=4", "lora.alpha=8"])
    policy = load_policy(cfg.model, cfg.lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # B starts at 0 (peft): give the adapter an effect
                p.normal_(0, 0.1)
    assert is_peft(policy) and not is_peft(torch.nn.Linear(2, 2))
    import copy

    expected = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    got = dict(merged_named_weights(policy))
    assert list(got) == list(expected)  # the transformers names, in order, no lora_ tensors
    from transformers import AutoModelForCausalLM

    base = dict(AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).named_parameters())
    changed = 0
    for name, t in got.items():
        assert torch.allclose(t, expected[name].float(), atol=1e-6), name
        changed += not torch.equal(t, base[name])
    assert changed == 2 * 7  # 2 layers x 7 target modules were merged; the rest are the base tensors


def test_adapter_folders_are_new_atomic_and_cleaned_up(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR

    class Saves:  # what the folders ask of a peft model: save_pretrained(dir, save_embedding_layers=False)
        def save_pretrained(self, out, save_embedding_layers=True):
            assert save_embedding_layers is False
            import os

            os.makedirs(out)
            with open(os.path.join(out, "adapter_config.json"), "w") as f:
                json.dump({"r": 4}, f)

    folders = AdapterFolders()
    assert folders.root.parent == tmp_path
    (k1, p1), (k2, p2) = folders.save(Saves()), folders.save(Saves())
    assert (k1, k2) == (1, 2) and p1.name == "1" and p2.name == "2" and (p2 / "adapter_config.json").exists()
    assert sorted(p.name for p in folders.root.iterdir()) == ["1", "2"]  # no .partial-* left behind
    folders.drop(1)
    assert sorted(p.name for p in folders.root.iterdir()) == ["2"]
    folders.close()
    assert not folders.root.exists()


def test_vllm_lora_rank_rounds_up_to_what_vllm_accepts():
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    assert VLLM_LORA_RANKS[-1] == 512
    with pytest.raises(UserError, match="lora.sync=merged"):
        vllm_lora_rank(513)


def test_config_lora_sync_and_the_vllm_rank_limit():
    from emapg_cli.config import load_config

    assert load_config().lora.sync == "adapter"
    assert load_config(overrides=["lora.r=8", "rollout.engine=vllm"]).lora.r == 8  # refused before this change
    assert load_config(overrides=["lora.r=1024", "rollout.engine=vllm", "lora.sync=merged"]).lora.r == 1024
    assert load_config(overrides=["lora.r=1024"]).lora.r == 1024  # the hf engine has no such limit
    with pytest.raises(UserError, match="lora.r <= 512"):
        load_config(overrides=["lora.r=1024", "rollout.engine=vllm"])
    with pytest.raises(UserError, match="lora.sync"):
        load_config(overrides=["lora.sync=bogus"])
    # evaluating the EMA anchor would sample from the policy's adapter, not the anchor's: still refused, one line
    with pytest.raises(UserError, match="does not support eval.anchor_every"):
        load_config(overrides=["lora.r=4", "rollout.engine=vllm", "kl.coef=0.1", "eval.anchor_every=2"])


# ---------------------------------------------------------------- the engine's side, against a fake vLLM
class FakeLoRARequest:  # vllm.lora.request.LoRARequest
    def __init__(self, lora_name, lora_int_id, lora_path):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


@pytest.fixture
def lora_vllm(fake_vllm, monkeypatch):
    class FakeLoRALLM(FakeLLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.loras: dict[int, dict] = {}  # id -> the adapter config read at add_lora

            def add_lora(req):
                self.calls.append(("add_lora", req.lora_name, req.lora_int_id))
                self.loras[req.lora_int_id] = json.loads((Path(req.lora_path) / "adapter_config.json").read_text())
                return True

            def remove_lora(i):
                self.calls.append(("remove_lora", i))
                return self.loras.pop(i, None) is not None

            self.llm_engine.add_lora, self.llm_engine.remove_lora = add_lora, remove_lora

        def generate(self, requests, sampling, use_tqdm=True, lora_request=None):
            self.calls.append(("lora_request", lora_request and lora_request.lora_name))
            return super().generate(requests, sampling, use_tqdm)

    fake_vllm.LLM = FakeLoRALLM
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    return fake_vllm


class FakePeft(torch.nn.Module):
    """A peft-shaped model: `peft_config`, and save_pretrained writing its current `step` into the adapter config."""

    def __init__(self):
        super().__init__()
        self.peft_config = {"default": None}
        self.step = 0

    def save_pretrained(self, out, save_embedding_layers=True):
        import os

        os.makedirs(out)
        with open(os.path.join(out, "adapter_config.json"), "w") as f:
            json.dump({"step": self.step}, f)


def test_engine_loads_each_adapter_under_a_new_name_and_removes_the_old(lora_vllm):
    engine = make_engine(lora_rank=4)
    llm = engine.llm
    assert llm.kwargs["enable_lora"] is True and llm.kwargs["max_lora_rank"] == 8 and llm.kwargs["max_loras"] == 1
    policy = FakePeft()
    engine.load_weights(policy)  # at setup
    policy.step = 1
    engine.load_weights(policy)  # after the first update
    engine.generate([[1]], SamplingParams(n=1))
    assert [c for c in llm.calls if c[0] != "reset_prefix_cache"] == [
        ("add_lora", "emapg-1", 1), ("remove_lora", 1), ("add_lora", "emapg-2", 2), ("lora_request", "emapg-2"),
        ("generate", 1)]
    assert llm.loras == {2: {"step": 1}}  # vLLM holds one adapter: the latest
    assert sorted(p.name for p in engine._adapters.root.iterdir()) == ["2"]  # the old folder is gone
    assert llm.model.loaded == {}  # no tensor was pushed


def test_engine_without_lora_support_pushes_merged_weights(lora_vllm, monkeypatch):
    engine = make_engine()  # lora.sync=merged: started without LoRA
    assert "enable_lora" not in engine.llm.kwargs
    pushed = []
    monkeypatch.setattr("emapg_cli.engines.vllm.merged_named_weights", lambda model, dtype: pushed.append(dtype) or iter(()))
    engine.load_weights(FakePeft())
    assert pushed == [torch.bfloat16]  # merged, in the engine's dtype
    engine.generate([[1]], SamplingParams(n=1))
    assert ("lora_request", None) in engine.llm.calls

