"""End tokens: both engines stop on the tokenizer's EOS plus the generation config's EOS ids, and a
response holds only tokens the policy sampled (no pad token of a row that had already finished, even
when the tokenizer's pad token is its EOS), also inside the search agent's trajectories."""

from __future__ import annotations

import types

import pytest
import torch

from emapg_cli.engines.base import SamplingParams, end_token_ids
from emapg_cli.models.tiny import build_byte_tokenizer, build_tiny_model

#: Single characters as stop strings: on the near-uniform random tiny model (259 byte tokens) one of
#: these 20 is drawn with probability ~20/259 ~ 0.08 per step, so within 16 tokens most rows stop on a
#: stop string while others run on: rows that finished early get padded by `generate`. (No letters:
#: transformers' stop-string check also matches inside special tokens' text, e.g. "<|im_start|>".)
LETTERS = tuple("0123456789#$%&*+=?@!")


@pytest.fixture(scope="module")
def pad_is_eos():
    """A tiny Qwen2 and a byte tokenizer whose pad token is its EOS (as many chat tokenizers set it)."""
    tok = build_byte_tokenizer()
    tok.pad_token = tok.eos_token
    assert tok.pad_token_id == tok.eos_token_id
    lm = build_tiny_model(tok, seed=1).eval()
    lm.generation_config.eos_token_id = tok.eos_token_id
    lm.generation_config.pad_token_id = tok.pad_token_id
    return lm, tok


def prompts_of(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def trainer_logprobs(lm, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of each completion token given the prompt and the completion so far (one forward)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = lm(ids).logits[0, len(prompt) - 1:-1].float() / temperature  # [T, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]  # [T]


def test_end_token_ids_hand_values():
    tok = types.SimpleNamespace(eos_token_id=5)
    assert end_token_ids(tok) == (5,)
    assert end_token_ids(tok, types.SimpleNamespace(eos_token_id=None)) == (5,)
    assert end_token_ids(tok, types.SimpleNamespace(eos_token_id=7)) == (5, 7)  # an int
    assert end_token_ids(tok, types.SimpleNamespace(eos_token_id=[7, 5, 9])) == (5, 7, 9)  # a list: tokenizer's first, no repeats
    assert end_token_ids(types.SimpleNamespace(eos_token_id=None), types.SimpleNamespace(eos_token_id=[3])) == (3,)


def test_stop_string_row_keeps_no_pad_token_when_pad_is_eos(pad_is_eos):
    """Rows of a batch that stop on a stop string are padded by `generate` while the others run on; with
    pad == EOS the old cut (first EOS of the row) kept one of those pads as if the policy had ended there.
    Each completion must be exactly what the same row gives when generated alone (batch of one: nothing is
    ever padded), and every token's recorded log-prob the policy's log-prob of that token."""
    from emapg_cli.engines.hf import HFEngine

    lm, tok = pad_is_eos
    prompts = prompts_of(tok, ["Q: 1+1?", "another prompt", "x"])
    params = SamplingParams(n=4, max_new_tokens=16, temperature=1.0, seed=5, stop=LETTERS)
    batched = HFEngine(lm, tok, batch_size=12).generate(prompts, params)
    alone = HFEngine(lm, tok, batch_size=1).generate(prompts, params)
    stopped_on_string = 0
    for p, g, g1 in zip(prompts, batched, alone):
        for c, c1 in zip(g, g1):
            assert c.token_ids == c1.token_ids and c.finish_reason == c1.finish_reason
            assert len(c.logprobs) == len(c.token_ids)
            want = trainer_logprobs(lm, p, c.token_ids)
            assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-4)  # an unsampled pad would be off by nats
            text = tok.decode(c.token_ids, skip_special_tokens=True)
            if c.token_ids[-1] != tok.eos_token_id and any(s in text for s in LETTERS):
                stopped_on_string += 1  # ... and its last token completes the stop string
                assert not any(s in tok.decode(c.token_ids[:-1], skip_special_tokens=True) for s in LETTERS)
    # the batch really mixed early stops with rows that ran on (else nothing was padded)
    lengths = [len(c.token_ids) for g in batched for c in g]
    assert stopped_on_string >= 3 and min(lengths) < max(lengths)


def test_search_trajectory_has_no_unsampled_token_with_mask_1(pad_is_eos, monkeypatch):
    """The search agent on the hf engine (pad == EOS): every policy-masked token of every episode has the
    sampling log-prob the policy gives it in the full trajectory's context (one forward over prompt +
    trajectory, as the trainer computes it), so none is a token the policy did not sample."""
    from emapg_cli.agents import SearchAgent, protocol
    from emapg_cli.config.models import SearchConfig
    from emapg_cli.engines.hf import HFEngine

    lm, tok = pad_is_eos
    monkeypatch.setattr(protocol, "STOP", LETTERS)  # turns end on a stop string often (no real action: invalid turns)

    class NoRetriever:
        def search(self, queries, topk):
            raise AssertionError("no search action is expected from a random model")

    s = SearchConfig(enabled=True, max_obs_tokens=8, max_context_tokens=4096, invalid_message="\nno action\n")
    agent = SearchAgent(tok, NoRetriever(), s, max_turns=3)
    prompts = prompts_of(tok, ["Q: who?", "Q: where is it?"])
    groups = agent.generate(HFEngine(lm, tok, batch_size=8), prompts, SamplingParams(n=4, max_new_tokens=12, seed=2))
    policy_tokens = 0
    for p, g in zip(prompts, groups):
        for ep in g:
            assert ep.turns >= 2 and ep.obs_tokens > 0  # observations between policy turns
            want = trainer_logprobs(lm, p, ep.token_ids)
            mask = torch.tensor(ep.policy_mask)
            got = torch.tensor(ep.logprobs)
            assert torch.allclose(got[mask], want[mask], atol=1e-4)
            policy_tokens += int(mask.sum())
    assert policy_tokens > 50


def test_hf_engine_stops_on_a_generation_config_eos(pad_is_eos):
    """A generation-config EOS id that is not the tokenizer's EOS ends the response (kept, finish 'stop');
    before, the hf engine stopped on the tokenizer's EOS only."""
    from emapg_cli.engines.hf import HFEngine

    lm, tok = pad_is_eos
    prompt = prompts_of(tok, ["What is 2 + 3?"])
    params = SamplingParams(n=1, max_new_tokens=8, temperature=1.0, seed=4)
    free = HFEngine(lm, tok, end_token_ids=(tok.eos_token_id,)).generate(prompt, params)[0][0].token_ids
    assert len(free) == 8 and tok.eos_token_id not in free
    cut = next(t for t in range(1, 8) if free[t] not in free[:t])  # a token not drawn before it
    stop_id = free[cut]
    saved = lm.generation_config.eos_token_id
    lm.generation_config.eos_token_id = [tok.eos_token_id, stop_id]
    try:
        engine = HFEngine(lm, tok)  # end tokens read from the model's generation config
    finally:
        lm.generation_config.eos_token_id = saved
    assert engine.end_ids == (tok.eos_token_id, stop_id)
    c = engine.generate(prompt, params)[0][0]  # same seed: the same draws, up to the new end token
    assert c.token_ids == free[:cut + 1] and c.finish_reason == "stop" and len(c.logprobs) == cut + 1
