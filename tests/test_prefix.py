"""Each distinct prompt run once (`train.share_prompts`): the groups by hand, the auto rule's arithmetic, and
the shared passes equal to the padded ones (values and gradients) on both tiny architectures."""

from __future__ import annotations

import pytest
import torch

from emapg_cli.models.prefix import plan, prompt_groups
from train_helpers import assert_layout_equals_padded


def test_prompt_groups_by_hand():
    # prompt width 3; rows 0, 2, 3 share the prompt [0, 5, 6] (left-padded); row 1 has another; row 4 has the same
    # ids as row 0 but a real token where row 0 has padding (pad id 0 is also a real id here): another prompt
    ids = torch.tensor([[0, 5, 6, 7, 8], [4, 5, 6, 9, 0], [0, 5, 6, 1, 0], [0, 5, 6, 2, 3], [0, 5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    mask[[0, 2, 3], 0] = 0
    mask[[1, 2], 4] = 0
    g = prompt_groups(ids, mask, 3)
    assert g.distinct == 3
    inv = g.inverse.tolist()
    assert inv[0] == inv[2] == inv[3] and len({inv[0], inv[1], inv[4]}) == 3
    assert sorted(g.first.tolist()) == [0, 1, 4]  # the first row of each group
    assert all(inv[f] == u for u, f in enumerate(g.first.tolist()))


def test_auto_shares_when_it_runs_at_most_half_the_tokens():
    # 8 rows, prompt 6, response 4 (width 10): padded 8 * 10 = 80 tokens
    ids = torch.arange(1, 11).repeat(8, 1)
    mask = torch.ones_like(ids)
    # 1 distinct prompt: shared = 1 * 6 + 8 * (4 - 1) = 30 <= 0.5 * 80: auto shares
    assert plan(ids, mask, 6, "auto").distinct == 1
    # 4 distinct prompts (pairs): shared = 4 * 6 + 8 * 3 = 48 > 40: auto keeps the padded pass; always shares
    pairs = ids.clone()
    pairs[:, 0] = torch.arange(8) // 2 + 20
    assert plan(pairs, mask, 6, "auto") is None and plan(pairs, mask, 6, "always").distinct == 4
    # nothing repeats: no sharing even when asked; never / False: none
    distinct = ids.clone()
    distinct[:, 0] = torch.arange(8) + 20
    assert plan(distinct, mask, 6, "always") is None
    assert plan(ids, mask, 6, "never") is None and plan(ids, mask, 6, False) is None
    with pytest.raises(ValueError):
        plan(ids, mask, 6, "sometimes")


def _batch(vocab: int):
    """6 rows: prompts left-padded to 7 (3 distinct, of 7, 3 and 5 real tokens, each twice), responses
    right-padded to 9, one of them empty."""
    g = torch.Generator().manual_seed(0)
    p, r = 7, 9
    group_of, prompt_lens, response_lens = [0, 0, 1, 2, 1, 2], [7, 3, 5], [9, 4, 0, 9, 1, 6]
    prompts = torch.randint(3, vocab, (3, p), generator=g)
    ids = torch.cat([prompts[group_of], torch.randint(3, vocab, (6, r), generator=g)], dim=1)  # [6, P + R]
    attn = torch.ones(6, p + r, dtype=torch.long)
    for i, grp in enumerate(group_of):
        attn[i, : p - prompt_lens[grp]] = 0
        attn[i, p + response_lens[i]:] = 0
    return ids * attn, attn, p, attn[:, p:].clone()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_shared_passes_equal_the_padded_ones(arch):
    from emapg_cli.models.tiny import build_byte_tokenizer, build_tiny_model

    model = build_tiny_model(build_byte_tokenizer(), arch=arch, seed=0)
    ids, attn, p, resp = _batch(model.config.vocab_size)
    assert plan(ids, attn, p, True).distinct == 3  # the case shares: 6 rows, 3 prompts
    # and the shared prompt's gradient is the sum over its rows, through the gathered keys, values and last state
    assert_layout_equals_padded(model, ids, attn, p, resp, share=True)


def test_a_one_token_response_needs_only_the_prompt_pass():
    from emapg_cli.models.tiny import build_byte_tokenizer, build_tiny_model
    from emapg_cli.train.logprobs import token_stats

    model = build_tiny_model(build_byte_tokenizer(), arch="qwen2", seed=0)
    ids, attn, p, resp = _batch(model.config.vocab_size)
    ids, attn, resp = ids[:, : p + 1], attn[:, : p + 1], resp[:, :1]
    mask = resp.bool()
    a = token_stats(model, ids, attn, p, resp)
    b = token_stats(model, ids, attn, p, resp, share=True)
    torch.testing.assert_close(b.logp[mask], a.logp[mask], rtol=1e-5, atol=1e-6)


def test_sharing_check_accepts_a_sharing_model_and_refuses_a_wrong_cache(monkeypatch):
    from emapg_cli.errors import UserError
    from emapg_cli.models.tiny import build_byte_tokenizer, build_tiny_model
    from emapg_cli.models import prefix
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.passes import check_layouts
    from emapg_cli.train.rollout import RolloutBatch

    model = build_tiny_model(build_byte_tokenizer(), arch="llama", seed=0)
    ids, attn, p, resp = _batch(model.config.vocab_size)
    batch = RolloutBatch(input_ids=ids, attention_mask=attn, response_mask=resp, prompt_len=p, advantages=torch.zeros(6))
    checked = check_layouts(TokenScorer(model), batch, 1.0, "never", "always")
    assert set(checked) == {"share"} and checked["share"] < 1e-5
    # a model whose cache gave each row another prompt's keys and values: simulate it (each row gets the next group's)
    real = prefix.shared_hidden

    def wrong_rows(decoder, input_ids, attention_mask, prompt_len, groups, position_ids):
        shifted = prefix.Groups(first=groups.first.roll(1), inverse=groups.inverse)
        return real(decoder, input_ids, attention_mask, prompt_len, shifted, position_ids)

    monkeypatch.setattr(prefix, "shared_hidden", wrong_rows)
    with pytest.raises(UserError, match="share_prompts=never"):
        check_layouts(TokenScorer(model), batch, 1.0, "never", "always")


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_generation_with_shared_prompts_samples_what_it_would_without(arch, fast):
    # 3 prompts of different lengths (left padding), 4 samples each: the shared prefill must leave every row's
    # distribution as it was, so the seeded samples (tokens) are the same and their log-probs agree
    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.engines.hf import HFEngine
    from emapg_cli.models import prefix
    from emapg_cli.models.tiny import build_byte_tokenizer, build_tiny_model

    tok = build_byte_tokenizer()
    model = build_tiny_model(tok, arch=arch, seed=0)
    prompts = [list(b"12+34="), list(b"7+8="), list(b"100+250=")]
    params = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=3)
    calls = []
    real = prefix.prompt_cache

    def counted(*a, **kw):
        calls.append(real(*a, **kw))
        return calls[-1]

    import emapg_cli.engines.hf as hf
    import emapg_cli.engines.hf_decode as hf_decode

    hf.prompt_cache = hf_decode.prompt_cache = counted  # the generate path's and the decode loop's
    try:
        shared = HFEngine(model, tok, fast_decode=fast).generate(prompts, params)
    finally:
        hf.prompt_cache = hf_decode.prompt_cache = real
    assert len(calls) == 1 and calls[0] is not None  # the shared prefill ran
    plain = HFEngine(model, tok, share_prompts=False, fast_decode=fast).generate(prompts, params)
    for ga, gb in zip(shared, plain):
        for a, b in zip(ga, gb):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)
