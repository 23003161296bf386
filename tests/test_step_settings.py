"""The step settings decided once from the config (train/settings.py), the engines' own attributes, and the rule that
the passes, the update and the scorer never read the config themselves."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import emapg_cli
from emapg_cli.config.loading import load_config
from emapg_cli.train.settings import step_settings

# 2 prompts per step: one mini-batch of 1 prompt each (2 optimizer steps, not one on-policy step) unless overridden
TWO_MINI = ["rollout.prompts_per_step=2", "train.mini_batch_prompts=1"]
ONE_MINI = ["rollout.prompts_per_step=2", "train.mini_batch_prompts=2"]


def settings(*overrides: str, vocab: int = 1000):
    return step_settings(load_config(overrides=list(overrides)), vocab)


def test_k_is_capped_to_the_vocabulary():
    # kl.k = 8 over a vocabulary of 5 ids: q is all 5 of them; over 1000 ids kl.k stays 8
    assert settings("kl.estimator=topk", "kl.k=8", vocab=5).k == 5
    assert settings("kl.estimator=topk", "kl.k=8", vocab=1000).k == 8
    # the engine records the capped k too (reverse Top-k, old log-probs from the hf engine)
    assert settings("kl.estimator=topk", "kl.k=8", "train.old_logprobs=engine", *TWO_MINI, vocab=5).engine_topk == 5


def test_single_sample_estimator_needs_no_q():
    s = settings("kl.estimator=k1", "kl.coef=0.1", "train.old_logprobs=pass", *TWO_MINI)
    assert not s.topk and s.q_from is None and s.engine_topk == 0
    assert s.anchor_pass and not s.anchor_inside_loss  # k1 reads the anchor's log-probs of the sampled tokens
    assert s.old_pass  # two mini-batches: the old policy differs from the one the second step updates


def test_where_q_comes_from():
    # reverse Top-k reads the sampling policy's top-k: the engine's records (old log-probs from the engine)...
    s = settings("kl.estimator=topk", "kl.direction=reverse", "kl.k=4", "train.old_logprobs=engine", *TWO_MINI)
    assert (s.q_from, s.engine_topk, s.old_pass, s.old_from_engine) == ("engine", 4, False, True)
    # ... auto with the hf engine is the same; auto with vLLM, or pass: the old-policy pass computes q
    assert settings("kl.estimator=topk", "kl.k=4", "train.old_logprobs=auto", *TWO_MINI).q_from == "engine"
    s = settings("kl.estimator=topk", "kl.direction=reverse", "kl.k=4", "train.old_logprobs=pass", *TWO_MINI)
    assert (s.q_from, s.engine_topk, s.old_pass) == ("policy", 0, True)
    # forward Top-k reads the anchor's own top-k, gathered in the anchor pass: nothing from the engine
    s = settings("kl.estimator=topk", "kl.direction=forward", "kl.k=4", "train.old_logprobs=engine", *TWO_MINI)
    assert (s.q_from, s.engine_topk, s.anchor_pass) == ("anchor", 0, True)
    # no KL term: no q, no anchor pass
    s = settings("kl.estimator=topk", "kl.coef=0", *TWO_MINI)
    assert (s.topk, s.q_from, s.anchor_pass, s.engine_topk) == (False, None, False, 0)


def test_exact_reads_the_anchor_inside_the_loss():
    s = settings("kl.estimator=exact", "kl.coef=0.1", *TWO_MINI)
    assert s.anchor_inside_loss and not s.anchor_pass and s.q_from is None
    assert not settings("kl.estimator=exact", "kl.coef=0", *TWO_MINI).anchor_inside_loss  # no KL: no anchor at all


def test_old_policy_pass():
    # one epoch of one mini-batch: the update's own first pass is the old policy (k3 needs no q)
    s = settings("kl.estimator=k3", "train.old_logprobs=pass", *ONE_MINI)
    assert s.single_on_policy and not s.old_pass
    assert settings("kl.estimator=k3", "train.old_logprobs=pass", "train.epochs=2", *ONE_MINI).old_pass
    # reverse Top-k needs q before the update even then
    assert settings("kl.estimator=topk", "train.old_logprobs=pass", *ONE_MINI).old_pass
    # a sequence-level rollout correction needs every sequence's ratio before the fused loss's first chunk
    s = settings("kl.estimator=k3", "train.old_logprobs=pass", "train.rollout_correction=sequence_truncate", *ONE_MINI)
    assert s.correction_old_pass and s.old_pass


def test_pass_settings_and_loss_come_from_their_sections():
    s = settings("rollout.temperature=0.7", "train.logit_chunk=5", "train.logit_memory_mib=64", "train.pack_sequences=always",
                 "train.share_prompts=never", "train.micro_batch_size=3", "kl.estimator=k3", "kl.coef=0.25",
                 "train.clip_high=0.3", "train.loss_agg=token-mean", "train.epochs=2", "rollout.n=4", *TWO_MINI)
    p = s.passes
    assert (p.temperature, p.chunk, p.budget_mib, p.pack, p.share, p.micro_batch_size) == (0.7, 5, 64, "always", "never", 3)
    assert p.scorer_args(entropy=False) == {"temperature": 0.7, "chunk": 5, "budget_mib": 64, "pack": "always",
                                            "share": "never", "entropy": False}
    assert (s.loss.beta, s.loss.estimator, s.loss.clip_high, s.loss.agg) == (0.25, "k3", 0.3, "token-mean")
    # 2 prompts x 4 samples, mini-batches of 1 prompt: 4 sequences per optimizer step
    assert (s.epochs, s.group_size, s.sequences_per_mini_batch) == (2, 4, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.k = 3  # decided once


def test_engines_say_what_differs():
    from emapg_cli.engines.base import EngineBase
    from emapg_cli.engines.hf import HFEngine
    from emapg_cli.engines.vllm import VLLMEngine

    assert (HFEngine.shares_weights, HFEngine.records_topk) == (True, True)
    assert (VLLMEngine.shares_weights, VLLMEngine.records_topk) == (False, False)
    assert (EngineBase.shares_weights, EngineBase.records_topk) == (False, False)
    trainer = (Path(emapg_cli.__file__).parent / "train" / "trainer.py").read_text()
    assert "getattr(self.engine" not in trainer


def test_one_factory_serves_the_trainer(tiny_qwen2):
    """With the live policy module, the factory's hf engine samples from that very module (nothing loaded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.engines import make_engine

    lm, tok = AutoModelForCausalLM.from_pretrained(tiny_qwen2), AutoTokenizer.from_pretrained(tiny_qwen2)
    engine = make_engine("hf", str(tiny_qwen2), model=lm, tokenizer=tok, batch_size=3, share_prompts=False)
    assert engine.model is lm and engine.tokenizer is tok and engine.batch_size == 3 and not engine.share_prompts


NO_CONFIG = ("passes.py", "update.py", "logprobs.py", "loss.py")


@pytest.mark.parametrize("name", NO_CONFIG)
def test_passes_update_and_scorer_never_read_the_config(name):
    """train/passes.py, update.py, logprobs.py and loss.py take the step settings: no import of emapg_cli.config, no
    `cfg.` anywhere in their code (comments and docstrings included)."""
    path = Path(emapg_cli.__file__).parent / "train" / name
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("emapg_cli.config"), f"{name} imports {node.module}"
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("emapg_cli.config") for a in node.names), f"{name} imports the config"
    assert "cfg." not in text and "cfg)" not in text, f"{name} reads the config"
