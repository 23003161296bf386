"""Rollout correction (train.rollout_correction): the pure weights, then through the trainer's own pieces with an
engine whose recorded log-probs are deliberately perturbed, the launch checks and the resolved defaults.

One table of ratios rho = pi_old / pi_engine serves every test (4 rows x 3 tokens, cap 2, band [0.5, 2]):
    row 0: [3, 0.25, 1]   geometric mean (0.75)^(1/3) = 0.908560
    row 1: [4, 4, 1]      (16)^(1/3)                  = 2.519842   > 2: truncated to 2 / masked
    row 2: [0.25, 1, 1]   (0.25)^(1/3)                = 0.629961   in the band
    row 3: [1.5, 1, 0.4]  (0.6)^(1/3)                 = 0.843433   in the band
tokens: 12; sum of rho = 4.25 + 9 + 2.25 + 2.9 = 18.4 (row sums), mean 18.4 / 12 = 1.533333; max 4
    token_truncate:   rho > 2 -> 3, 4, 4 truncated                          clipped 3/12 = 0.25
    token_mask:       outside [0.5, 2] -> 3, 0.25, 4, 4, 0.25, 0.4 -> 0     clipped 6/12 = 0.5
    sequence_*:       over 4 sequences: mean (0.908560 + 2.519842 + 0.629961 + 0.843433) / 4 = 1.225449,
                      max 2.519842, clipped 1/4 (row 1, above the cap; none below 0.5)
"""

from __future__ import annotations

import math

import pytest
import torch

from emapg_cli.config.loading import load_config
from emapg_cli.errors import UserError
from train_helpers import settings_of

RHO = [[3.0, 0.25, 1.0], [4.0, 4.0, 1.0], [0.25, 1.0, 1.0], [1.5, 1.0, 0.4]]
RHO_SUM = 4.25 + 9.0 + 2.25 + 2.9  # = 18.4 (row sums: 3 + 0.25 + 1, 4 + 4 + 1, 0.25 + 1 + 1, 1.5 + 1 + 0.4)
GEO = [0.75 ** (1 / 3), 16 ** (1 / 3), 0.25 ** (1 / 3), 0.6 ** (1 / 3)]  # 0.908560, 2.519842, 0.629961, 0.843433
# hand-computed weights w per mode (cap 2)
WEIGHTS = {
    "none": [[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]],
    "token_truncate": [[2, 0.25, 1], [2, 2, 1], [0.25, 1, 1], [1.5, 1, 0.4]],  # min(rho, 2)
    "token_mask": [[0, 0, 1], [0, 0, 1], [0, 1, 1], [1.5, 1, 0]],  # rho if 0.5 <= rho <= 2 else 0
    "sequence_truncate": [[GEO[0]] * 3, [2.0] * 3, [GEO[2]] * 3, [GEO[3]] * 3],
    "sequence_mask": [[GEO[0]] * 3, [0.0] * 3, [GEO[2]] * 3, [GEO[3]] * 3],
}
# (is_ratio_mean, is_ratio_max, is_clipped_frac)
STATS = {
    "none": (RHO_SUM / 12, 4.0, 0.0),
    "token_truncate": (RHO_SUM / 12, 4.0, 3 / 12),
    "token_mask": (RHO_SUM / 12, 4.0, 6 / 12),
    "sequence_truncate": (sum(GEO) / 4, GEO[1], 1 / 4),
    "sequence_mask": (sum(GEO) / 4, GEO[1], 1 / 4),
}
MODES = list(WEIGHTS)


# ---------------------------------------------------------------- (a) the pure function
@pytest.mark.parametrize("mode", MODES)
def test_weights_and_stats_by_hand(mode):
    from emapg_cli.grpo import rollout_correction

    # old - sampling = ln rho; a 4th column that the mask drops holds a huge ratio (e^50) that must change nothing,
    # and a 5th row with no token at all is left out of the sequence statistics
    log_rho = torch.tensor([r + [50.0] for r in [[math.log(x) for x in row] for row in RHO]] + [[9.0] * 4])  # [5, 4]
    sampling = -torch.rand(5, 4, generator=torch.Generator().manual_seed(0)) * 5  # any engine log-probs
    mask = torch.ones(5, 4, dtype=torch.bool)
    mask[:, 3] = False
    mask[4] = False
    w, st = rollout_correction(sampling + log_rho, sampling, mask, mode, cap=2.0)
    want = torch.tensor([row + [1.0] for row in WEIGHTS[mode]] + [[1.0] * 4])  # masked positions: 1
    torch.testing.assert_close(w, want, rtol=1e-5, atol=1e-6)
    assert not w.requires_grad
    mean, mx, clipped = STATS[mode]
    assert float(st.ratio_mean) == pytest.approx(mean, rel=1e-5)
    assert float(st.ratio_max) == pytest.approx(mx, rel=1e-5)
    assert float(st.clipped_frac) == pytest.approx(clipped)
    assert float(st.count) == (4 if mode.startswith("sequence") else 12)


def test_overflow_and_empty():
    from emapg_cli.grpo import rollout_correction

    # a log-ratio of 1000 nats: clamped at 80 before exp, so rho = e^80 (finite in float32), truncated to the cap
    old, samp = torch.tensor([[1000.0, -1000.0]]), torch.zeros(1, 2)
    w, st = rollout_correction(old, samp, torch.ones(1, 2, dtype=torch.bool), "token_truncate", cap=2.0)
    assert torch.equal(w, torch.tensor([[2.0, math.exp(-80)]], dtype=torch.float32))
    assert float(st.ratio_max) == pytest.approx(math.exp(80), rel=1e-5) and math.isfinite(float(st.ratio_mean))
    w, _ = rollout_correction(old, samp, torch.ones(1, 2, dtype=torch.bool), "token_mask", cap=2.0)
    assert torch.equal(w, torch.zeros(1, 2))
    w, st = rollout_correction(old, samp, torch.zeros(1, 2, dtype=torch.bool), "sequence_mask", cap=2.0)
    assert torch.equal(w, torch.ones(1, 2)) and float(st.count) == 0 and math.isnan(float(st.ratio_mean))
    with pytest.raises(ValueError, match="unknown"):
        rollout_correction(old, samp, torch.ones(1, 2), "token", cap=2.0)


def test_metrics_names():
    from emapg_cli.grpo import rollout_correction
    from emapg_cli.train.metrics import rollout_correction_metrics

    _, st = rollout_correction(torch.tensor([[math.log(3.0), 0.0]]), torch.zeros(1, 2), torch.ones(1, 2), "token_mask", 2.0)
    assert rollout_correction_metrics(st) == pytest.approx(
        {"rollout/is_ratio_mean": 2.0, "rollout/is_ratio_max": 3.0, "rollout/is_clipped_frac": 0.5})  # (3 + 1) / 2
    assert rollout_correction_metrics(None) == {}


# ---------------------------------------------------------------- (b) through the trainer, perturbed engine
class PerturbedEngine:
    """The hf engine, with every recorded log-prob lowered by ln rho (rho from RHO, row by row): the trainer's
    old-policy log-probs, computed on the weights that sampled, are then ln rho above the engine's."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, params):
        groups = self.engine.generate(prompts, params)
        for c, rho in zip([c for g in groups for c in g], RHO, strict=True):
            c.logprobs = [lp - math.log(r) for lp, r in zip(c.logprobs, rho, strict=True)]
        return groups


# advantages of the 4 rows (2 prompts x 2 samples), given directly
ADV = [1.0, -1.0, 0.5, 2.0]


@pytest.fixture(scope="module")
def sampled(tiny_qwen2):
    """(policy, anchor, batch): 4 completions of 3 tokens from the perturbed engine, old-policy (and q) passes run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.engines.hf import HFEngine
    from emapg_cli.train.loading import make_anchor
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.passes import reference_passes
    from emapg_cli.models.prompts import render_prompt
    from emapg_cli.train.rollout import build_batch

    lm, tok = AutoModelForCausalLM.from_pretrained(tiny_qwen2).eval(), AutoTokenizer.from_pretrained(tiny_qwen2)
    prompts = [render_prompt(tok, q) for q in ("1+2", "what is 13*17?")]
    groups = PerturbedEngine(HFEngine(lm, tok)).generate(prompts, SamplingParams(n=2, max_new_tokens=3, seed=3, topk=4))
    comps = [c for g in groups for c in g]
    assert [len(c.token_ids) for c in comps] == [3, 3, 3, 3]
    batch = build_batch([p for p in prompts for _ in range(2)], comps, torch.tensor(ADV), tok.pad_token_id)
    anchor = make_anchor(lm)
    with torch.no_grad():  # an anchor away from the policy, so the KL is not 0
        for p in anchor.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    cfg = _cfg("none")
    batch = reference_passes(TokenScorer(lm), TokenScorer(anchor), batch, settings_of(cfg))
    assert batch.old_logp is not None  # 2 mini-batches: the old-policy pass ran
    log_rho = (batch.old_logp - batch.sampling_logp)[batch.response_mask]  # [12] the perturbation, seen by the trainer
    torch.testing.assert_close(log_rho, torch.tensor(RHO).log().reshape(-1), rtol=0, atol=1e-4)
    return lm, anchor, batch


def _cfg(mode, *extra):
    # 2 mini-batches of 1 prompt (so the old-policy pass runs), reverse Top-k KL with its importance weight
    return load_config(overrides=["rollout.prompts_per_step=2", "rollout.n=2", "train.mini_batch_prompts=1",
                                  "train.old_logprobs=pass", f"train.rollout_correction={mode}", "train.rollout_correction_cap=2",
                                  "kl.estimator=topk", "kl.direction=reverse", "kl.k=4", "kl.coef=0.5", "kl.iw=true",
                                  "train.loss_agg=token-mean", "train.logit_chunk=5", *extra])


def _loss(lm, anchor, batch, cfg):
    """micro_batch_loss over the whole batch (token-mean over its 12 tokens) as the update computes it, and grads."""
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.update import correction_weights, micro_batch_loss

    batch, _ = correction_weights(batch, settings_of(cfg).loss)
    lm.zero_grad(set_to_none=True)
    parts = micro_batch_loss(TokenScorer(lm), batch, settings_of(cfg), 12.0, 4.0, anchor)
    parts.loss.backward()
    grads = [p.grad.detach().clone() for p in lm.parameters()]
    lm.zero_grad(set_to_none=True)
    return parts, grads


# loss/pg with token-mean over the 12 tokens, the policy still at the sampling weights: PPO's ratio is 1 (the update
# pass equals the old-policy pass), so pg_t = -A_i w_t and pg = -sum_i A_i sum_t w_it / 12 with A = [1, -1, 0.5, 2]
#   none:              row sums 3, 3, 3, 3                 -3 + 3 - 1.5 - 6                     = -7.5      / 12
#   token_truncate:    3.25, 5, 2.25, 2.9                  -3.25 + 5 - 1.125 - 5.8              = -5.175    / 12
#   token_mask:        1, 1, 2, 2.5                        -1 + 1 - 1 - 5                       = -6        / 12
#   sequence_truncate: 3 x (0.908560, 2, 0.629961, 0.843433) -2.725681 + 6 - 0.944941 - 5.060597 = -2.731219 / 12
#   sequence_mask:     3 x (0.908560, 0, 0.629961, 0.843433) -2.725681 + 0 - 0.944941 - 5.060597 = -8.731219 / 12
PG = {"none": -7.5 / 12, "token_truncate": -5.175 / 12, "token_mask": -6 / 12,
      "sequence_truncate": -2.731219 / 12, "sequence_mask": -8.731219 / 12}


@pytest.mark.parametrize("mode", MODES)
def test_perturbed_engine_weights_the_pg_term(sampled, mode):
    from emapg_cli.train.update import correction_weights

    lm, anchor, batch = sampled
    cfg = _cfg(mode)
    weighted, st = correction_weights(batch, settings_of(cfg).loss)
    if mode == "none":
        assert weighted.is_weight is None and st is None
    else:
        torch.testing.assert_close(weighted.is_weight[batch.response_mask], torch.tensor(WEIGHTS[mode]).reshape(-1),
                                   rtol=2e-4, atol=1e-6)
        mean, mx, clipped = STATS[mode]
        assert float(st.ratio_mean) == pytest.approx(mean, rel=2e-4) and float(st.ratio_max) == pytest.approx(mx, rel=2e-4)
        assert float(st.clipped_frac) == pytest.approx(clipped)
    parts, _ = _loss(lm, anchor, batch, cfg)
    assert parts.pg == pytest.approx(PG[mode], rel=2e-4)


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_sequence_weights_act_as_scaled_advantages(sampled, mode):
    """sg(w_i) constant over a sequence: the pg loss and its gradient equal those of none with advantages A_i * w_i
    (no gradient flows through the weights)."""
    lm, anchor, batch = sampled
    w = torch.tensor([row[0] for row in WEIGHTS[mode]])  # [4]
    a, ga = _loss(lm, anchor, batch, _cfg(mode, "kl.coef=0"))
    b, gb = _loss(lm, anchor, batch.with_(advantages=batch.advantages * w), _cfg("none", "kl.coef=0"))
    assert a.pg == pytest.approx(b.pg, rel=1e-5)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=2e-3, atol=1e-6)


def test_kl_importance_weight_uses_the_sampling_log_probs(sampled):
    """With a correction on, the Top-k tail's s = pi_theta / pi_sampling reads the engine's log-probs: its KL equals
    the uncorrected loss's KL when that loss's old policy is the engine's records (and differs from the default).
    (kl.iw_clip=null: the correction's default cap on s is tested below.)"""
    lm, anchor, batch = sampled
    on, _ = _loss(lm, anchor, batch, _cfg("token_truncate", "kl.iw_clip=null"))
    as_engine, _ = _loss(lm, anchor, batch.with_(old_logp=batch.sampling_logp), _cfg("none"))
    off, _ = _loss(lm, anchor, batch, _cfg("none"))
    assert on.kl == pytest.approx(as_engine.kl, rel=1e-6) and abs(on.kl - off.kl) > 1e-3 * abs(off.kl)


def test_kl_importance_weight_is_capped_with_a_correction():
    """issue 32: kl.iw_clip defaults to [0, train.rollout_correction_cap] when a correction is on, so a token the engine
    under-weights cannot multiply the KL term without bound. One token by hand (kl.estimator=k1, token-mean over 1
    token: w = 1): pi_theta = 0.5, pi_engine = 0.05, pi_anchor = 0.25, so s = 0.5 / 0.05 = 10, capped at C = 2, and
    k1 = log(0.5 / 0.25) = log 2: the KL part of the loss is s k1 = 2 log 2 = 1.386294 (10 log 2 = 6.931472 uncapped)."""
    from emapg_cli.train.rollout import RolloutBatch
    from emapg_cli.train.settings import policy_loss

    one = torch.ones(1, 1)
    batch = RolloutBatch(input_ids=torch.tensor([[0, 7]]), attention_mask=torch.ones(1, 2, dtype=torch.long),
                         response_mask=one.bool(), prompt_len=1, advantages=torch.zeros(1),
                         sampling_logp=one * math.log(0.05), ref_logp=one * math.log(0.25))
    base = ["rollout.engine=vllm", "train.old_logprobs=pass", "kl.estimator=k1", "kl.coef=0.1", "train.loss_agg=token-mean"]
    for extra, s in (([], 2.0), (["kl.iw_clip=null"], 10.0), (["train.rollout_correction_cap=4"], 4.0)):
        cfg = load_config(overrides=base + extra)
        assert cfg.train.rollout_correction == "token_truncate"
        loss = policy_loss(cfg)
        _, extras = loss.per_token(batch, 1.0, 1.0, batch.response_mask)(0, 1, torch.tensor([math.log(0.5)]), None)
        assert float(extras["kl"][0]) == pytest.approx(s * math.log(2), rel=1e-6), extra
    # without a correction s = pi_theta / pi_old stays unclipped (kl.iw_clip null) unless set
    assert load_config(overrides=["rollout.engine=hf"]).kl.iw_clip is None
    assert load_config(overrides=["rollout.engine=vllm", "kl.iw_clip=[0.5,3]"]).kl.iw_clip == (0.5, 3.0)


def test_config_show_prints_the_kl_weight_cap(cli):
    r = cli("config", "show", "--set", "rollout.engine=vllm", "--set", "train.rollout_correction_cap=3")
    assert r.returncode == 0, r.stderr
    assert "iw_clip:\n  - 0.0\n  - 3.0\n" in r.stdout and "rollout_correction: token_truncate" in r.stdout


def _head_loss_fn(cfg, mb, num_tokens, num_seqs, loss_mask):
    """The per-token loss as it was before the rollout correction (verbatim, reading the config), the reference for
    mode none."""
    from emapg_cli.grpo import ppo_clip_loss, token_weights
    from emapg_cli.kl import INFO, importance_weight, kl_per_token, topk_membership

    kl_cfg, t = cfg.kl, cfg.train
    beta, info = kl_cfg.coef, INFO[kl_cfg.estimator]
    m = mb.response_mask.bool()
    w = token_weights(loss_mask.bool(), t.loss_agg, num_tokens, num_seqs)[m]  # [N]
    adv = mb.advantages[:, None].expand(m.shape)[m].float()  # [N]
    old = mb.old_logp[m] if mb.old_logp is not None else None  # [N]
    topk = beta > 0 and info.uses_topk
    ref = mb.ref_logp[m] if beta > 0 and mb.ref_logp is not None else None  # [N]
    ref_q = mb.ref_logp_q[m] if topk else None  # [N, k]
    in_q = topk_membership(mb.q_index, mb.targets)[m] if topk else None  # [N]

    def loss_fn(s, e, logp, logp_q, logits=None, ref_logits=None):
        o = old[s:e] if old is not None else logp.detach()
        pg_tok, clipped = ppo_clip_loss(logp, o, adv[s:e], t.clip_low, t.clip_high, t.dual_clip)  # [c]
        pg_w = w[s:e] * pg_tok
        extras = {"pg": pg_w.detach(), "clipped": clipped.float()}
        if beta <= 0:
            return pg_w, extras
        iw = importance_weight(logp, o, kl_cfg.iw_clip) if kl_cfg.iw else None
        kl_tok = kl_per_token(
            kl_cfg.estimator, kl_cfg.direction, logp=logp, ref_logp=ref[s:e] if ref is not None else None, iw=iw,
            logp_q=logp_q, ref_logp_q=ref_q[s:e] if ref_q is not None else None,
            in_q=in_q[s:e] if in_q is not None else None, logits=logits, ref_logits=ref_logits,
            log_ratio_clamp=kl_cfg.log_ratio_clamp, estimate_clamp=kl_cfg.estimate_clamp,
        )  # [c]
        kl_w = w[s:e] * kl_tok
        extras["kl"] = kl_w.detach()
        return pg_w + beta * kl_w, extras

    return loss_fn


def test_none_reproduces_the_uncorrected_loss_exactly(sampled, monkeypatch):
    """Mode none: loss and every gradient bit-identical to the loss function before the correction existed, with
    the perturbed engine log-probs present in the batch (they must enter nothing)."""
    import emapg_cli.train.update as update

    lm, anchor, batch = sampled
    moved = batch.with_(old_logp=batch.old_logp - 0.05)  # ratios != 1, so PPO's ratio and s are not trivially 1
    cfg = _cfg("none")
    now, g_now = _loss(lm, anchor, moved, cfg)
    monkeypatch.setattr(update.PolicyLoss, "per_token", lambda loss, *args: _head_loss_fn(cfg, *args))
    before, g_before = _loss(lm, anchor, moved, cfg)
    assert torch.equal(now.loss, before.loss) and now.pg == before.pg and now.kl == before.kl
    assert all(torch.equal(x, y) for x, y in zip(g_now, g_before))


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_one_on_policy_step_takes_the_weights_from_its_own_pass(sampled, mode):
    """One mini-batch, one epoch: no old-policy pass (old_logp None); the update's first pass is the old policy and
    gives the same weights, loss and gradient as the precomputed ones, and the same statistics."""
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.parallel import Replicated
    from emapg_cli.train.setup import make_scheduler
    from emapg_cli.train.update import update_policy
    from train_helpers import OneProcess

    lm, anchor, batch = sampled
    one = _cfg(mode, "train.mini_batch_prompts=2", "kl.coef=0")
    assert not settings_of(one).old_pass
    a, ga = _loss(lm, anchor, batch.with_(old_logp=None), one)
    b, gb = _loss(lm, anchor, batch, one)
    assert a.pg == pytest.approx(PG[mode], rel=2e-4) and a.pg == pytest.approx(b.pg, rel=1e-5)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-6)
    opt = torch.optim.SGD(lm.parameters(), lr=0.0)
    stats = update_policy(Replicated(OneProcess()), TokenScorer(lm), batch.with_(old_logp=None), settings_of(one), opt,
                          make_scheduler(opt, one), torch.Generator().manual_seed(0))
    lm.zero_grad(set_to_none=True)
    mean, mx, clipped = STATS[mode]
    assert stats.pg[0] == pytest.approx(PG[mode], rel=2e-4)
    assert float(stats.correction.ratio_mean) == pytest.approx(mean, rel=2e-4)
    assert float(stats.correction.ratio_max) == pytest.approx(mx, rel=2e-4)
    assert float(stats.correction.clipped_frac) == pytest.approx(clipped)


def test_update_reports_the_metrics(sampled):
    """update_policy with 2 mini-batches: the weights are computed once from the old-policy pass; step_metrics
    carries rollout/is_* (token_mask: mean 18.4 / 12, max 4, clipped 6 / 12)."""
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.metrics import step_metrics
    from emapg_cli.train.parallel import Replicated
    from emapg_cli.train.setup import make_scheduler
    from emapg_cli.train.update import update_policy
    from train_helpers import OneProcess

    lm, _, batch = sampled
    cfg = _cfg("token_mask", "kl.coef=0")
    opt = torch.optim.SGD(lm.parameters(), lr=0.0)
    upd = update_policy(Replicated(OneProcess()), TokenScorer(lm), batch, settings_of(cfg), opt, make_scheduler(opt, cfg),
                        torch.Generator().manual_seed(0))
    lm.zero_grad(set_to_none=True)
    # each mini-batch (one prompt, 6 tokens) is its own token-mean: the two pg values sum to 2 x the 12-token mean
    assert sum(upd.pg) == pytest.approx(2 * PG["token_mask"], rel=2e-4)
    m = step_metrics(rewards=torch.zeros(2, 2), reward_errors=0, response_lens=[3] * 4, truncated=0, max_new_tokens=3,
                     upd=upd, beta=0.0, lr=0.0, t_rollout=1.0, t_update=1.0, skipped_total=0, ema_distance=None)
    assert m["rollout/is_ratio_mean"] == pytest.approx(RHO_SUM / 12, rel=2e-4)
    assert m["rollout/is_ratio_max"] == pytest.approx(4.0, rel=2e-4)
    assert m["rollout/is_clipped_frac"] == pytest.approx(0.5)


def test_sequence_mode_runs_the_old_policy_pass(sampled):
    """A sequence mode needs each sequence's ratio before the fused loss's first chunk: one on-policy step still runs
    the old-policy pass and keeps its log-probs."""
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.passes import reference_passes

    lm, anchor, batch = sampled
    one = _cfg("sequence_truncate", "train.mini_batch_prompts=2", "kl.coef=0")
    assert settings_of(one).old_pass and not settings_of(_cfg("token_truncate", "train.mini_batch_prompts=2", "kl.coef=0")).old_pass
    out = reference_passes(TokenScorer(lm), TokenScorer(anchor), batch.with_(old_logp=None), settings_of(one))
    torch.testing.assert_close(out.old_logp, batch.old_logp)


def test_no_engine_log_probs_is_a_user_error(sampled):
    from emapg_cli.train.update import correction_weights

    _, _, batch = sampled
    with pytest.raises(UserError, match="train.rollout_correction=token_truncate needs the log-probs"):
        correction_weights(batch.with_(sampling_logp=None), settings_of(_cfg("token_truncate")).loss)
    assert correction_weights(batch.with_(sampling_logp=None), settings_of(_cfg("none")).loss)[1] is None


# ---------------------------------------------------------------- config
def test_defaults_per_engine_and_launch_checks():
    from emapg_cli.train.preflight import config_checks

    assert load_config(overrides=["rollout.engine=hf"]).train.rollout_correction == "none"
    vllm = load_config(overrides=["rollout.engine=vllm"])
    assert vllm.train.rollout_correction == "token_truncate" and vllm.train.rollout_correction_cap == 2.0
    config_checks(vllm)
    # where the correction could not work the default is none: the old policy is the engine's records (ratio 1), or
    # the search agent re-tokenises them away
    assert load_config(overrides=["rollout.engine=vllm", "train.old_logprobs=engine"]).train.rollout_correction == "none"
    search = ["rollout.engine=vllm", "search.enabled=true", "search.retokenize=true", "search.max_turns=2",
              "rollout.max_new_tokens=500"]
    assert load_config(overrides=search).train.rollout_correction == "none"
    # given explicitly there, one line at launch (and in --dry-run)
    for over in (["rollout.engine=vllm", "train.old_logprobs=engine"], ["rollout.engine=hf"]):
        with pytest.raises(UserError, match="the ratio is 1"):
            config_checks(load_config(overrides=over + ["train.rollout_correction=token_mask"]))
    with pytest.raises(UserError, match="search.retokenize"):
        config_checks(load_config(overrides=search + ["train.rollout_correction=sequence_mask"]))
    config_checks(load_config(overrides=["rollout.engine=hf", "train.old_logprobs=pass", "train.rollout_correction=token_mask"]))
    # issue 32, per engine: with stale samples (rollout.max_staleness >= 1) an hf rollout server records the full-vocabulary
    # log-probs at any temperature and top_p, so the correction is on; vLLM at T != 1 with top_p < 1 cannot: refused
    stale = ["rollout.max_staleness=1", "rollout.engine_url=http://127.0.0.1:8100", "rollout.temperature=0.7", "rollout.top_p=0.9"]
    assert load_config(overrides=stale).train.rollout_correction == "token_truncate"
    with pytest.raises(UserError, match="rollout.max_staleness=1 samples from older weights, and vLLM at rollout.temperature=0.7 "
                                        "with rollout.top_p=0.9 records no full-vocabulary log-probs"):
        load_config(overrides=stale + ["rollout.engine=vllm"])
    assert load_config(overrides=stale + ["rollout.engine=vllm", "train.rollout_correction=none"]).train.rollout_correction == "none"
    assert load_config(overrides=stale[2:] + ["rollout.engine=vllm"]).train.rollout_correction == "none"  # synchronous: as before
    for fine in (["rollout.temperature=1"], ["rollout.top_p=1"]):  # vLLM records the full distribution at T = 1 or top_p = 1
        assert load_config(overrides=stale + ["rollout.engine=vllm"] + fine).train.rollout_correction == "token_truncate"
    with pytest.raises(Exception, match="rollout_correction_cap"):
        load_config(overrides=["train.rollout_correction_cap=0.5"])
