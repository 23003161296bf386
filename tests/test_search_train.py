"""The search agent on the real engines' path, on CPU: hf token-in/token-out, a short `emapg train`, a server that is down."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from emapg_cli.retrieval.bm25 import build_index
from emapg_cli.retrieval.corpus import paragraph_contents
from train_helpers import free_port, run, train_cmd

DOCS = [("Paris", "Paris is the capital of France."), ("Rome", "Rome is the capital of Italy."),
        ("Madrid", "Madrid is the capital of Spain."), ("Berlin", "Berlin is the capital of Germany.")]


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("search")
    corpus = d / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": paragraph_contents(t, x)}) + "\n" for i, (t, x) in enumerate(DOCS)))
    build_index(corpus, d / "index")
    return d / "index"


def qa_data(path: Path) -> Path:
    rows = [{"id": f"q{i}", "question": f"What is the capital of {c}", "answers": [a], "source": src}
            for i, (c, a, src) in enumerate([("France", "Paris", "nq"), ("Italy", "Rome", "hotpotqa"),
                                              ("Spain", "Madrid", "nq"), ("Germany", "Berlin", "hotpotqa")])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_hf_episodes_are_exactly_what_the_policy_sampled(tiny_qwen2, index):
    """hf engine + agent: at every policy token of the multi-turn sequence, the trainer's log-prob over the whole
    sequence equals the engine's sampling log-prob (so the trained context is the one the policy saw)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.agents import SearchAgent
    from emapg_cli.agents.protocol import format_question, load_template
    from emapg_cli.config.models import SearchConfig
    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.engines.hf import HFEngine
    from emapg_cli.retrieval.bm25 import BM25Retriever
    from emapg_cli.train.logprobs import token_stats
    from emapg_cli.models.prompts import render_prompt

    lm, tok = AutoModelForCausalLM.from_pretrained(tiny_qwen2).eval(), AutoTokenizer.from_pretrained(tiny_qwen2)
    s = SearchConfig(enabled=True, retriever="bm25", max_obs_tokens=40, max_context_tokens=2048)
    agent = SearchAgent(tok, BM25Retriever.load(index), s, max_turns=2)
    prompts = [render_prompt(tok, format_question(q, load_template())) for q in ("Capital of France", "Capital of Spain")]
    groups = agent.generate(HFEngine(lm, tok), prompts, SamplingParams(n=2, max_new_tokens=10, seed=3))
    for p, group in zip(prompts, groups):
        for ep in group:
            assert ep.turns >= 1 and len(ep.token_ids) == len(ep.policy_mask) == len(ep.logprobs)
            ids = torch.tensor([p + ep.token_ids])
            with torch.no_grad():
                st = token_stats(lm, ids, torch.ones_like(ids), len(p), torch.ones(1, len(ep.token_ids), dtype=torch.bool))
            m = torch.tensor(ep.policy_mask)
            assert torch.allclose(st.logp[0][m], torch.tensor(ep.logprobs)[m], atol=1e-4)
            assert ep.outcome in ("answer", "no_answer")  # a random model: mostly invalid turns with observations


def _opts(model, data, index, steps, *extra):
    values = [f"model.path={model}", f"data.train={data}", f"data.eval={data}", "data.eval_limit=2", "data.max_prompt_tokens=1000",
              "rollout.reward=em", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8", "search.max_turns=2",
              f"train.steps={steps}", "train.mini_batch_prompts=1", "train.micro_batch_size=2", "train.save_every=1",
              "kl.estimator=topk", "kl.k=8", "kl.coef=0.1", "ema.update_period=1", "eval.max_new_tokens=8",
              "search.enabled=true", "search.retriever=bm25", f"search.index={index}", "search.max_obs_tokens=32",
              "search.max_context_tokens=1024", *extra]
    return [x for kv in values for x in ("--set", kv)]


def test_train_search_agent_hf_two_turns(tiny_qwen2, index, tmp_path):
    """`emapg train` with the search agent (hf, max_turns 2, bm25): search/* metrics, reward per source, checkpoints;
    then a resume against a retrieval server that is down stops with one line and leaves the checkpoint intact."""
    data = qa_data(tmp_path / "qa.jsonl")
    out = tmp_path / "run"
    proc = run(train_cmd(*_opts(tiny_qwen2, data, index, 1), "--out", str(out)), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the eval file mixes sources nq and hotpotqa: data.eval_limit=2 keeps 2 of each, scored per source; with
    # 2 items each, eval/accuracy (over all 4) is the mean of the two
    for row in (rows[0], rows[-1]):
        per = [row["eval/accuracy/nq"], row["eval/accuracy/hotpotqa"]]
        assert all(a in (0.0, 0.5, 1.0) for a in per) and row["eval/accuracy"] == pytest.approx(sum(per) / 2)
    step = rows[1]
    for key in ("search/calls_per_episode", "search/invalid_action_rate", "search/turns", "search/obs_tokens_frac",
                "kl/value", "loss/pg"):
        assert key in step, key
    sources = {k for k in step if k.startswith("reward/source/")}  # this step's 2 prompts: one or both sources
    assert sources and sources <= {"reward/source/nq", "reward/source/hotpotqa"}
    # 2 search turns + the final one: between 1 and 3 turns; a random model's turns are mostly invalid actions,
    # whose observations (the invalid-action message, cut at 32 tokens) are in the trajectory with mask 0
    assert 1 <= step["search/turns"] <= 3 and 0 < step["search/obs_tokens_frac"] < 1
    assert step["search/invalid_action_rate"] > 0
    ckpt = out / "checkpoints" / "step_1"
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.rglob("*")) if p.is_file()}

    port = free_port()  # nothing listens there
    down = ["train.steps=2", "search.retriever=http", f"search.url=http://127.0.0.1:{port}/retrieve", "search.retries=1",
            "search.backoff_s=0.01"]
    proc = run(train_cmd("--resume", str(out), *[x for kv in down for x in ("--set", kv)]), timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "failed after 2 tries" in errors[0], proc.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.rglob("*")) if p.is_file()} == digest
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]


def test_multi_turn_needs_the_search_agent(tiny_qwen2, tmp_path, index):
    """The turn limit lives with the environment: rollout.max_turns is one line naming search.max_turns, and a
    user environment cannot be combined with search.enabled=true (exit 2, before anything runs)."""
    data = qa_data(tmp_path / "qa.jsonl")
    opts = [o.replace("search.max_turns=2", "rollout.max_turns=2") for o in _opts(tiny_qwen2, data, index, 1)]
    proc = run(train_cmd(*opts, "--out", str(tmp_path / "r")))
    assert proc.returncode == 2 and "search.max_turns" in proc.stderr.strip().splitlines()[-1]
    proc = run(train_cmd(*_opts(tiny_qwen2, data, index, 1), "--set", "rollout.env=calc", "--out", str(tmp_path / "r")))
    assert proc.returncode == 2 and "rollout.env" in proc.stderr.strip().splitlines()[-1]
