"""Which sampling log-probs the engines record, and the launch check that refuses to put them in the loss when they
are not the trainer's distribution (log softmax(logits / T) over the full vocabulary)."""

from __future__ import annotations

import pytest
import torch

from emapg_cli.config.loading import load_config
from emapg_cli.engines.base import SamplingParams
from emapg_cli.errors import UserError
from emapg_cli.train.preflight import config_checks


def vllm_cfg(*overrides: str):
    return load_config(preset="toy", overrides=["rollout.engine=vllm", *overrides])


@pytest.mark.parametrize("overrides,refused", [
    # T != 1 with top_p < 1: vLLM's records are renormalised over the nucleus
    (["rollout.temperature=0.7", "rollout.top_p=0.9"], None),  # the vllm default resolves to none there (config/models.py)
    (["rollout.temperature=0.7", "rollout.top_p=0.9", "train.rollout_correction=token_truncate"], "train.rollout_correction=token_truncate"),
    (["rollout.temperature=0.7", "rollout.top_p=0.9", "train.rollout_correction=sequence_mask"], "train.rollout_correction=sequence_mask"),
    (["rollout.temperature=0.7", "rollout.top_p=0.9", "train.rollout_correction=none", "train.old_logprobs=engine"],
     "train.old_logprobs=engine"),
    (["rollout.temperature=0.7", "rollout.top_p=0.9", "train.rollout_correction=none"], None),  # nothing uses them
    (["rollout.temperature=0.7", "rollout.top_p=0.9", "train.rollout_correction=none", "train.old_logprobs=pass"], None),
    (["rollout.temperature=1.0", "rollout.top_p=0.9", "train.old_logprobs=engine"], None),  # raw_logprobs: exact
    (["rollout.temperature=0.7", "rollout.top_p=1.0", "train.old_logprobs=engine"], None),  # processed_logprobs: exact
])
def test_launch_refuses_engine_logprobs_that_are_not_the_trainers(overrides, refused):
    cfg = vllm_cfg(*overrides)
    if refused is None:
        config_checks(cfg)
        return
    with pytest.raises(UserError) as err:
        config_checks(cfg)
    msg = str(err.value)
    assert "\n" not in msg and refused in msg and "rollout.top_p=1" in msg


def test_hf_engine_is_never_refused():
    # the hf engine records log softmax(z / T) at any top_p (test below); check_rollout_correction's own refusal of a
    # correction next to old_logprobs=engine (ratio 1) is another matter (tests/test_rollout_correction.py)
    for overrides in (["train.old_logprobs=engine", "train.rollout_correction=none"],
                      ["train.old_logprobs=pass", "train.rollout_correction=token_mask"]):
        config_checks(load_config(preset="toy", overrides=["rollout.temperature=0.7", "rollout.top_p=0.9", *overrides]))


def test_cli_dry_run_refuses_in_one_line(cli, emapg_home):
    out = cli("train", "--preset", "toy", "--dry-run", "--set", "rollout.engine=vllm", "--set", "rollout.temperature=0.7",
              "--set", "rollout.top_p=0.9", "--set", "train.rollout_correction=token_truncate")
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "renormalised over the nucleus" in lines[0]


def test_hf_engine_records_full_vocabulary_logprobs_under_top_p(tiny_qwen2):
    """At T = 0.7 and top_p = 0.5 the hf engine samples inside the nucleus but records log softmax(z / T) of the full
    vocabulary (what the trainer computes), not the nucleus-renormalised log-prob (which is larger by -log(kept mass))."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.engines.hf import HFEngine

    lm, tok = AutoModelForCausalLM.from_pretrained(tiny_qwen2).eval(), AutoTokenizer.from_pretrained(tiny_qwen2)
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in ("What is 2 + 3?", "x")]
    T, top_p = 0.7, 0.5
    engine = HFEngine(lm, tok)
    assert engine.full_vocab_logprobs(SamplingParams(temperature=T, top_p=top_p))
    groups = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=8, temperature=T, top_p=top_p, seed=1))
    diffs, kept_mass = [], []
    for p, g in zip(prompts, groups):
        for c in g:
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(lm(ids).logits[0, len(p) - 1:-1].float() / T, -1)  # [L, V]
            for t, (y, rec) in enumerate(zip(c.token_ids, c.logprobs)):
                probs, _ = logp[t].exp().sort(descending=True)
                keep = (probs.cumsum(0) - probs) < top_p  # the nucleus (sample_from_logits' rule)
                assert logp[t, y].exp() >= probs[keep].min() - 1e-6  # the sampled token lies inside it
                diffs.append(abs(rec - float(logp[t, y])))
                kept_mass.append(float(probs[keep].sum()))
    assert max(diffs) < 1e-4
    # the renormalised record would differ by -log(kept mass): the nucleus holds just over top_p = 0.5 of this
    # near-uniform random model's mass, so about -log(0.5) = 0.69 nats per token
    assert sum(-torch.tensor(kept_mass).log()) / len(kept_mass) > 0.3
