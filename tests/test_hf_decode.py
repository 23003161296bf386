"""The hf engine's own decode loop (engines/hf_decode.py) samples exactly what transformers' `generate` path samples:
the same tokens, the same recorded log-probs (bit for bit), top-k ids, texts and finish reasons, for every
sampling setting the engine takes; rows that end leave the batch; a model the loop does not support falls back
to `generate` with a warning that names why."""

from __future__ import annotations

import warnings

import pytest
import torch

from emapg_cli.engines.base import SamplingParams
from emapg_cli.engines.hf import HFEngine
from emapg_cli.models.tiny import build_byte_tokenizer, build_tiny_model

PROMPTS = [b"12+34=", b"7+8=", b"100+250=", b"x", b"a much longer prompt: 3+4="]  # lengths 6 to 26: left padding


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request, tok):
    return build_tiny_model(tok, arch=request.param, seed=0).eval()


def ends(tok) -> tuple[int, ...]:
    """EOS and the ten digits: a random tiny model's nearly uniform next token (1 in ~260) ends a row at about 4% a
    step, so in 20 steps some rows end early and others run to the cap."""
    return (tok.eos_token_id, *tok.convert_tokens_to_ids(list("0123456789")))


def assert_same(old, new):
    for go, gn in zip(old, new, strict=True):
        for a, b in zip(go, gn, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert a.logprobs == b.logprobs  # bit for bit: the same float32 values
            assert (a.topk_index is None) == (b.topk_index is None)
            if a.topk_index is not None:
                assert torch.equal(a.topk_index, b.topk_index)


@pytest.mark.parametrize("settings", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.5, topk=3),
    dict(temperature=0.0),
    dict(temperature=1.0, stop=("a", "1"), topk=2),
    dict(temperature=1.0, n=8),  # 40 rows: rows end at many steps, the batch shrinks to MIN_ROWS
])
@pytest.mark.parametrize("engine_args", [dict(), dict(share_prompts=False), dict(batch_size=7)])
def test_decode_loop_samples_what_generate_samples(lm, tok, settings, engine_args, one_torch_thread):
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(**{"n": 4, "max_new_tokens": 20, "seed": 3, **settings})
    fast = HFEngine(lm, tok, end_token_ids=ends(tok), **engine_args)
    assert fast.decode_path == "fast"
    old = HFEngine(lm, tok, end_token_ids=ends(tok), fast_decode=False, **engine_args)
    assert old.decode_path == "generate: fast_decode is off"
    got = fast.generate(prompts, params)
    assert_same(old.generate(prompts, params), got)
    lengths = [len(c.token_ids) for g in got for c in g]
    if settings.get("temperature") != 0.0:  # the grid exercises rows that end early and rows that run to the cap
        assert min(lengths) < 20 and max(lengths) == 20


def test_pad_is_eos_and_a_generation_config_end_token(tok, one_torch_thread):
    """Pad == EOS (many chat tokenizers), and a second end token from the generation config."""
    t = build_byte_tokenizer()
    t.pad_token = t.eos_token
    lm = build_tiny_model(t, seed=1).eval()
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(n=4, max_new_tokens=16, temperature=1.0, seed=5, stop=("b",))
    end = ends(t)
    old = HFEngine(lm, t, end_token_ids=end, fast_decode=False).generate(prompts, params)
    assert_same(old, HFEngine(lm, t, end_token_ids=end).generate(prompts, params))
    assert any(c.token_ids and c.token_ids[-1] in end[1:] for g in old for c in g)  # the other end tokens did end rows


def test_finished_rows_leave_the_batch(lm, tok, one_torch_thread):
    """Each decode step runs only the rows still going, down to MIN_ROWS rows (forward pre-hook on the model)."""
    from emapg_cli.engines import hf_decode

    rows = []
    handle = lm.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                          with_kwargs=True)
    try:
        groups = HFEngine(lm, tok, end_token_ids=ends(tok)).generate([list(p) for p in PROMPTS],
                                                                     SamplingParams(n=8, max_new_tokens=20, seed=3))
    finally:
        handle.remove()
    lengths = [len(c.token_ids) for g in groups for c in g]
    # step 0 runs all 40 rows; step t >= 1 the rows whose response is longer than t, never fewer than MIN_ROWS (16)
    want = [len(lengths)] + [max(sum(n > t for n in lengths), hf_decode.MIN_ROWS) for t in range(1, max(lengths))]
    assert rows == want and rows[-1] < len(lengths)


def test_a_model_the_loop_does_not_support_uses_generate_and_says_so(tok, one_torch_thread):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=0,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(cfg).eval()
    engine = HFEngine(lm, tok)
    with pytest.warns(UserWarning, match="samples through transformers' generate .*sliding"):
        path = engine.decode_path
    assert path.startswith("generate: its cache has DynamicSlidingWindowLayer layers")
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per model class, not at every call
        got = engine.generate([list(b"1+1=")], params)
    assert_same(HFEngine(lm, tok, fast_decode=False).generate([list(b"1+1=")], params), got)


def test_preallocated_layer_returns_what_cat_would(one_torch_thread):
    from transformers.cache_utils import DynamicLayer

    from emapg_cli.engines.kv_cache import PreallocatedLayer

    g = torch.Generator().manual_seed(0)
    fixed, grown = PreallocatedLayer(capacity=8), DynamicLayer()
    for width in (4, 1, 1, 1):  # a prompt of 4 columns, then one column per step
        k, v = torch.randn(3, 2, width, 5, generator=g), torch.randn(3, 2, width, 5, generator=g)
        (k1, v1), (k2, v2) = fixed.update(k, v), grown.update(k, v)
        assert torch.equal(k1, k2) and torch.equal(v1, v2) and fixed.get_seq_length() == grown.get_seq_length()
    before = fixed.keys.clone()
    fixed.move(torch.tensor([2]), torch.tensor([0]), rows=2)  # row 0 ended: row 2 takes its slot
    assert torch.equal(fixed.update(k[:2], v[:2])[0], torch.cat([before[[2, 1]], k[:2]], 2))  # column 8 of 8
    with pytest.raises(RuntimeError, match="full"):
        fixed.update(k[:2], v[:2])


@pytest.mark.parametrize("kind", ["lora", "bfloat16", "autocast"])
def test_the_trainers_other_policies_sample_the_same(tok, kind, one_torch_thread):
    """A LoRA policy (peft: the loop runs its base model, where the adapters are injected), a bfloat16 model, and a
    float32 model under bfloat16 autocast (the trainer's master weights computing in bf16) sample what generate does."""
    import contextlib

    lm = build_tiny_model(tok, arch="llama", seed=0).eval()
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        lm = get_peft_model(lm, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    elif kind == "bfloat16":
        lm = lm.to(torch.bfloat16)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if kind == "autocast" else contextlib.nullcontext()
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(n=8, max_new_tokens=16, seed=2, topk=3)
    fast = HFEngine(lm, tok, end_token_ids=ends(tok))
    assert fast.decode_path == "fast"
    with context:
        assert_same(HFEngine(lm, tok, end_token_ids=ends(tok), fast_decode=False).generate(prompts, params),
                    fast.generate(prompts, params))
