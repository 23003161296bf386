"""The search agent on the vLLM engine: against the fake `vllm` module (always), and vLLM's CPU build (`-m vllm`)."""

from __future__ import annotations

import pytest

from emapg_cli.agents import SearchAgent
from emapg_cli.config.models import SearchConfig
from emapg_cli.engines.base import SamplingParams
from emapg_cli.models.tiny import build_byte_tokenizer
from emapg_cli.retrieval.base import Hit
from test_vllm_engine import FakeCompletionOutput, FakeLLM, FakeLogprob, FakeRequestOutput, fake_vllm, make_engine  # noqa: F401

TOK = build_byte_tokenizer()
SCRIPT = {ord("A"): ["<search> q </search>", "<answer> x </answer>"], ord("B"): ["<answer> y </answer>"]}


class ScriptedLLM(FakeLLM):
    """vLLM-shaped outputs: each request gets its episode's next scripted turn, per-token log-probs -0.5 - 0.1 * turn."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.turn: dict[int, int] = {}
        self.requests: list[list[tuple]] = []

    def generate(self, requests, sampling, use_tqdm=True):
        self.requests.append([(req["prompt_token_ids"], sp.n, tuple(sp.stop), sp.seed) for req, sp in zip(requests, sampling)])
        out = []
        for r, req in enumerate(requests):
            key = req["prompt_token_ids"][0]
            t = self.turn.get(key, 0)
            self.turn[key] = t + 1
            ids = TOK(SCRIPT[key][t], add_special_tokens=False)["input_ids"]
            lp = [{i: FakeLogprob(-0.5 - 0.1 * t)} for i in ids]
            out.append(FakeRequestOutput(str(r), None, req["prompt_token_ids"],
                                         [FakeCompletionOutput(0, "", ids, None, lp, finish_reason="stop")]))
        return out


class OneDoc:
    def search(self, queries, topk):
        return [[Hit("1", "T", "T\nbody", 1.0)] for _ in queries]

    def close(self):
        pass


def test_agent_on_vllm_engine_keeps_vllm_logprobs(fake_vllm):
    fake_vllm.LLM = ScriptedLLM
    engine = make_engine(max_model_len=4096)
    agent = SearchAgent(TOK, OneDoc(), SearchConfig(enabled=True), max_turns=4)
    groups = agent.generate(engine, [[ord("A"), 9], [ord("B")]], SamplingParams(n=1, max_new_tokens=50, seed=1))
    a, b = groups[0][0], groups[1][0]
    t0 = TOK(SCRIPT[ord("A")][0], add_special_tokens=False)["input_ids"]
    t1 = TOK(SCRIPT[ord("A")][1], add_special_tokens=False)["input_ids"]
    n_obs = len(a.token_ids) - len(t0) - len(t1)
    assert a.token_ids[:len(t0)] == t0 and a.token_ids[-len(t1):] == t1 and n_obs > 0
    assert a.policy_mask == [True] * len(t0) + [False] * n_obs + [True] * len(t1)
    # vLLM's per-token sampling log-probs at policy tokens (turn 0: -0.5, turn 1: -0.6), 0 at the observation
    assert a.logprobs == pytest.approx([-0.5] * len(t0) + [0.0] * n_obs + [-0.6] * len(t1))
    assert (a.outcome, b.outcome, a.searches) == ("answer", "answer", 1)
    llm = engine.llm
    # turn 0: both episodes in one call; turn 1: only A, whose prompt is its whole context so far
    assert [len(c) for c in llm.requests] == [2, 1]
    assert llm.requests[1][0][0] == [ord("A"), 9] + a.token_ids[:len(t0) + n_obs]
    assert all(n == 1 and stop == ("</search>", "</answer>") for call in llm.requests for _, n, stop, _ in call)
    assert llm.requests[0][0][3] != llm.requests[1][0][3]  # each turn has its own seeds


@pytest.mark.vllm
def test_agent_on_real_vllm_cpu_matches_trainer(tmp_path):
    """vLLM's CPU build: a multi-turn episode's policy tokens carry vLLM log-probs equal to the trainer's full-sequence pass."""
    pytest.importorskip("vllm")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.engines.vllm import VLLMEngine, vllm_device
    from emapg_cli.models.tiny import save_tiny
    from emapg_cli.train.logprobs import token_stats
    from emapg_cli.models.prompts import render_prompt

    if vllm_device() != "cpu":
        pytest.skip("for vLLM's CPU build")
    model = save_tiny(tmp_path / "tiny", arch="qwen2", hidden=128, heads=2, kv_heads=1, init_std=0.3)
    tok, lm = AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    engine = VLLMEngine(str(model), dtype="float32", gpu_memory_utilization=0.5, seed=0, max_model_len=1024,
                        enable_sleep_mode=False, kv_cache_memory_bytes=256 * 2**20)
    agent = SearchAgent(tok, OneDoc(), SearchConfig(enabled=True, max_obs_tokens=40, max_context_tokens=1024), max_turns=2)
    prompts = [render_prompt(tok, q) for q in ("Capital of France?", "Who wrote Hamlet?")]
    for p, group in zip(prompts, agent.generate(engine, prompts, SamplingParams(n=2, max_new_tokens=16, seed=0))):
        for ep in group:
            ids = torch.tensor([p + ep.token_ids])
            with torch.no_grad():
                st = token_stats(lm, ids, torch.ones_like(ids), len(p), torch.ones(1, len(ep.token_ids), dtype=torch.bool))
            m = torch.tensor(ep.policy_mask)
            assert torch.allclose(st.logp[0][m], torch.tensor(ep.logprobs)[m], atol=1e-3)
