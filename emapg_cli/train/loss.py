"""The update's loss as one object, built once from the `train` and `kl` sections (`settings.policy_loss`): the
per-token PPO-clip + beta * KL that the fused output layer (`emapg_cli.kl.fused`) evaluates chunk by chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from emapg_cli.errors import UserError
from emapg_cli.grpo import ppo_clip_loss, rollout_correction, sequence_level, token_weights
from emapg_cli.grpo.distill import tail_mass
from emapg_cli.kl import INFO, importance_weight, kl_per_token, topk_membership
from emapg_cli.kl.fused import LossFn
from emapg_cli.train.rollout import RolloutBatch


def no_sampling_logprobs(mode: str) -> str:
    """The one-line error for a rollout correction without the engine's sampling log-probs."""
    return (f"train.rollout_correction={mode} needs the log-probs the rollout engine recorded while sampling, and "
            "this batch has none (search.retokenize, or a batch built without them); set train.rollout_correction=none")


def distill_extras(kl_tok: Tensor, logp_q: Optional[Tensor]) -> dict[str, Tensor]:
    """The distillation metrics' per-token inputs [c]: the KL estimate (`dkl`) and, with a top-k set q, the student's
    tail mass 1 - P_theta(q) (`tail`, `grpo.distill.tail_mass`)."""
    out = {"dkl": kl_tok.detach()}
    if logp_q is not None:
        out["tail"] = tail_mass(logp_q)
    return out


@dataclass(frozen=True)
class PolicyLoss:
    """The update's loss, built once from the `train` and `kl` sections (`settings.policy_loss`): PPO-clip
    (clip_low, clip_high, dual_clip), aggregated by `agg` (train.loss_agg), plus beta * the KL estimator
    (kl.coef, kl.estimator, kl.direction, its importance weight and clamps), with train.rollout_correction."""

    beta: float = 0.0
    estimator: str = "k3"
    direction: str = "reverse"
    iw: bool = False
    iw_clip: Optional[tuple[float, float]] = None
    log_ratio_clamp: Optional[float] = None
    estimate_clamp: Optional[float] = None
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    agg: str = "token-mean"
    correction: str = "none"
    correction_cap: float = 2.0
    distill: bool = False  # train.objective distill / rl+distill: also record the per-token KL and tail mass (extras)

    @property
    def topk(self) -> bool:
        """The KL term reads log-probs at a top-k set q."""
        return self.beta > 0 and INFO[self.estimator].uses_topk

    def per_token(self, mb: RolloutBatch, num_tokens: float, num_seqs: float, loss_mask: Tensor) -> LossFn:
        """The per-token loss w_t (c_t PPO-clip_t + beta * KL_t) of one micro-batch, for `emapg_cli.kl.fused`.

        Every per-token input is flattened over the response mask (the order the fused function walks);
        w_t is the token's weight in the aggregated loss (`grpo.token_weights` over `loss_mask` [b, R],
        with the mini-batch totals for gradient accumulation). Extras: `pg` and `kl` (w_t times each
        part), `clipped` and, with a KL term, `kl_tok` (the unweighted per-token KL estimate: adaptive beta's measure).

        c_t = sg(rollout-correction weight) (`grpo.rollout_correction`): `mb.is_weight` when the update computed it
        from the old-policy log-probs, else (token modes without an old-policy pass: one on-policy step, whose first
        pass is the old policy) from this pass's detached log-probs and the engine's. Mode none: no factor at all (the
        loss is bit-identical to the uncorrected one).
        With a mode on, the KL estimators' importance weight s = pi_theta / pi_sampling uses the engine's sampling
        log-probs (the distribution the tokens were drawn from) instead of the old policy's.
        """
        beta, topk, mode, cap = self.beta, self.topk, self.correction, self.correction_cap
        m = mb.response_mask.bool()
        w = token_weights(loss_mask.bool(), self.agg, num_tokens, num_seqs)[m]  # [N]
        adv = mb.advantages[:, None].expand(m.shape)[m].float()  # [N]
        old = mb.old_logp[m] if mb.old_logp is not None else None  # [N]
        ref = mb.ref_logp[m] if beta > 0 and mb.ref_logp is not None else None  # [N]
        ref_q = mb.ref_logp_q[m] if topk else None  # [N, k]
        in_q = topk_membership(mb.q_index, mb.targets)[m] if topk else None  # [N]
        correct = mode != "none"
        if correct and mb.sampling_logp is None:
            raise UserError(no_sampling_logprobs(mode))
        samp = mb.sampling_logp[m].float() if correct else None  # [N] the engine's log-probs of the sampled tokens
        is_w = mb.is_weight[m] if correct and mb.is_weight is not None else None  # [N]
        if correct and is_w is None and (old is not None or sequence_level(mode)):
            raise RuntimeError("rollout correction weights were not computed before the update")  # update_policy does

        def loss_fn(s: int, e: int, logp: Tensor, logp_q: Optional[Tensor], logits=None, ref_logits=None):
            o = old[s:e] if old is not None else logp.detach()
            pg_tok, clipped = ppo_clip_loss(logp, o, adv[s:e], self.clip_low, self.clip_high, self.dual_clip)  # [c]
            pg_w = w[s:e] * pg_tok
            if is_w is not None:
                pg_w = pg_w * is_w[s:e]
            elif correct:  # token mode, no old-policy pass: o is this first pass's log-probs, the old policy's
                pg_w = pg_w * rollout_correction(o, samp[s:e], torch.ones_like(o, dtype=torch.bool), mode, cap)[0]
            extras = {"pg": pg_w.detach(), "clipped": clipped.float()}
            if beta <= 0:
                return pg_w, extras
            iw = importance_weight(logp, samp[s:e] if correct else o, self.iw_clip) if self.iw else None
            kl_tok = kl_per_token(
                self.estimator, self.direction, logp=logp, ref_logp=ref[s:e] if ref is not None else None, iw=iw,
                logp_q=logp_q, ref_logp_q=ref_q[s:e] if ref_q is not None else None,
                in_q=in_q[s:e] if in_q is not None else None, logits=logits, ref_logits=ref_logits,
                log_ratio_clamp=self.log_ratio_clamp, estimate_clamp=self.estimate_clamp,
            )  # [c]
            kl_w = w[s:e] * kl_tok
            extras["kl"], extras["kl_tok"] = kl_w.detach(), kl_tok.detach()
            if self.distill:  # unweighted per-token estimate, and 1 - P_theta(q) when the estimator read a top-k set q
                extras.update(distill_extras(kl_tok, logp_q))
            return pg_w + beta * kl_w, extras

        return loss_fn
