"""Cascade attention (engines/cascade.py, `rollout.hf_attention: cascade`): each distinct prompt's keys and values
read once per decode step. It is the same attention as `sdpa`'s in another summation order, so these tests hold it
to float32 rounding, not to bits: the attention output of one step against sdpa's over the concatenated cache, and
whole generations (rows that end and leave the batch, several prompts with their own padding, LoRA, bf16) against
the default decode loop. A call from outside the loop (another thread's pass while a loop runs) is sdpa's, bit for
bit, and the model's attention is back to sdpa after the loop, also when it raises."""

from __future__ import annotations

import threading

import pytest
import torch

from emapg_cli.engines import cascade
from emapg_cli.engines.base import Cancelled, SamplingParams
from emapg_cli.engines.hf import HFEngine
from emapg_cli.models.tiny import build_byte_tokenizer, build_tiny_model
from test_hf_decode import PROMPTS, ends

#: float32 rounding over a 30-column softmax and 16-dim products: outputs agree to ~1e-7 (the bound leaves 10x)
ATOL = 1e-6


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def _sdpa(query, keys, values, mask):
    """sdpa over the whole cache: query [b, H, 1, d], keys/values [b, kv, T, d] (kv heads repeated), mask [b, T]."""
    rep = query.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask[:, None, None, :])
    return out.transpose(1, 2)  # [b, 1, H, d]


def test_one_step_equals_sdpa_over_the_concatenated_cache(one_torch_thread):
    """3 prompts (U) of 6 columns, left padding 0 / 2 / 5 columns, rows 0..6 of prompts [2, 0, 0, 1, 2, 2, 0] (out of
    order, 1 to 3 rows per prompt, as after compaction), 4 own columns each; 6 query heads on 2 key/value heads."""
    g = torch.Generator().manual_seed(0)
    u, w, s, kv, h, d = 3, 6, 4, 2, 6, 16
    groups = torch.tensor([2, 0, 0, 1, 2, 2, 0])
    prompt_mask = torch.ones(u, w, dtype=torch.bool)
    prompt_mask[1, :2] = prompt_mask[2, :5] = False
    pk, pv = torch.randn(u, kv, w, d, generator=g), torch.randn(u, kv, w, d, generator=g)
    own_k, own_v = torch.randn(7, kv, s, d, generator=g), torch.randn(7, kv, s, d, generator=g)
    query = torch.randn(7, h, 1, d, generator=g)

    class Prefix:
        layers = [type("L", (), {"keys": pk, "values": pv})()]

    cache = cascade.CascadeCache(Prefix(), prompt_mask, capacity=s)
    cache.layers[0].update(own_k, own_v)
    cache.set_rows(groups)
    assert cache.per == 3 and sorted(cache.flat.tolist()) == [0, 1, 2, 3, 6, 7, 8]  # prompt 0: 3 rows, 1: 1, 2: 3
    module = type("Attn", (), {"layer_idx": 0})()
    token = cascade._ACTIVE.set(cache)
    try:
        got, _ = cascade.cascade_attention(module, query, own_k, own_v, None, scaling=d ** -0.5)
    finally:
        cascade._ACTIVE.reset(token)
    want = _sdpa(query, torch.cat([pk[groups], own_k], 2), torch.cat([pv[groups], own_v], 2),
                 torch.cat([prompt_mask[groups], torch.ones(7, s, dtype=torch.bool)], 1))
    assert got.shape == (7, 1, h, d)
    assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()


def _cascade(lm, tok, prompts, params, monkeypatch):
    """The cascade engine's samples, and how many attention calls ran the cascade path (not sdpa)."""
    calls = []
    real = cascade._attend
    monkeypatch.setattr(cascade, "_attend", lambda *a: calls.append(1) or real(*a))
    got = HFEngine(lm, tok, end_token_ids=ends(tok), attention="cascade").generate(prompts, params)
    return got, len(calls)


def _same_samples(old, new, tol: float) -> int:
    """Every response's tokens equal, log-probs within `tol`; returns the tokens compared."""
    count = 0
    for go, gn in zip(old, new, strict=True):
        for a, b in zip(go, gn, strict=True):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) <= tol
            count += len(a.token_ids)
    return count


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("settings", [dict(temperature=1.0, n=8), dict(temperature=0.7, top_p=0.5, topk=3, n=4),
                                      dict(temperature=0.0, n=2)])
def test_generation_matches_the_default_loop(tok, arch, settings, one_torch_thread, monkeypatch):
    """5 prompts x n samples, 20 tokens, rows ending on EOS or a digit (they leave the batch, down to MIN_ROWS): the
    same tokens and finish reasons, log-probs within 1e-5 (a random tiny model's draws sit far from the CDF's
    boundaries at this seed; a flip would need a log-prob change of ~1e-6 relative to a probability ~1/260)."""
    lm = build_tiny_model(tok, arch=arch, seed=0).eval()
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=20, seed=3, **settings)
    default = HFEngine(lm, tok, end_token_ids=ends(tok)).generate(prompts, params)
    got, calls = _cascade(lm, tok, prompts, params, monkeypatch)
    tokens = _same_samples(default, got, 1e-5)
    assert tokens > 5 * settings["n"] and calls >= 2 * max(len(c.token_ids) for g in got for c in g)  # 2 layers a step
    assert lm.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("kind", ["lora", "bfloat16"])
def test_other_policies(tok, kind, one_torch_thread, monkeypatch):
    """A LoRA policy (the loop runs its base model) and a bfloat16 model (cascade computes in float32, sdpa in bf16
    with float32 sums: bf16's own rounding, ~4e-3, bounds the difference)."""
    lm = build_tiny_model(tok, arch="llama", seed=0).eval()
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        lm = get_peft_model(lm, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    else:
        lm = lm.to(torch.bfloat16)
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(n=4, max_new_tokens=12, seed=2, temperature=0.0)  # greedy: robust to bf16's rounding
    default = HFEngine(lm, tok, end_token_ids=ends(tok)).generate(prompts, params)
    got, calls = _cascade(lm, tok, prompts, params, monkeypatch)
    _same_samples(default, got, 1e-5 if kind == "lora" else 5e-2)
    assert calls


def test_a_pass_from_another_thread_during_a_loop_is_sdpa_bit_for_bit(tok, one_torch_thread):
    lm = build_tiny_model(tok, arch="qwen2", seed=0).eval()
    ids = torch.tensor([[0, 0, *b"12+34="], list(b"abcdefgh")])  # [2, 8], one left-padded row
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    with torch.no_grad():
        want = lm(input_ids=ids, attention_mask=mask).logits
    inside, other = threading.Event(), {}

    def pass_in_another_thread():
        inside.wait(30)
        with torch.no_grad():
            other["logits"] = lm(input_ids=ids, attention_mask=mask).logits

    worker = threading.Thread(target=pass_in_another_thread)
    worker.start()
    with cascade.active(lm, cascade.CascadeCache(type("P", (), {"layers": []})(), mask, 1)):
        assert lm.config._attn_implementation == cascade.NAME
        inside.set()
        worker.join(30)
    assert torch.equal(other["logits"], want)
    assert lm.config._attn_implementation == "sdpa"


def test_the_attention_is_restored_when_the_loop_raises(tok, one_torch_thread):
    lm = build_tiny_model(tok, arch="llama", seed=0).eval()
    engine = HFEngine(lm, tok, attention="cascade")
    calls = []
    with pytest.raises(Cancelled):
        engine.generate([list(b"1+1=")], SamplingParams(n=4, max_new_tokens=8, seed=0),
                        cancelled=lambda: calls.append(1) or len(calls) > 3)
    assert lm.config._attn_implementation == "sdpa" and not cascade._users


def test_unknown_attention_is_refused(tok):
    with pytest.raises(ValueError, match="unknown decode attention 'flash'"):
        HFEngine(build_tiny_model(tok, seed=0), tok, attention="flash")
