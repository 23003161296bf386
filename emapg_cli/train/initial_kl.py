"""`kl/to_initial`: how far the policy has moved from the model it started as, measured every eval.initial_kl_every
RL steps on the step's own rollouts (docs/anchors.md, "KL to the initial model").

The initial policy is loaded again from model.path (frozen, in model.dtype): the weights every run starts from, so
a resumed run measures against the same model without saving it (with LoRA, model.path is the base, which the
policy equals at step 0: its adapters start at B = 0). On each measured step it scores the step's sampled response
tokens y ~ pi_theta (pi_theta: the policy that sampled them, at the rollout temperature), and the metric is the k3
estimate of KL(pi_theta || pi_0) per token (Schulman 2020, "Approximating KL divergence"):

    r = pi_0(y) / pi_theta(y),    k3 = r - 1 - log r >= 0,    E_{y ~ pi_theta}[k3] = KL(pi_theta || pi_0)

averaged over the policy's tokens of this process's rollouts. log pi_theta(y) is the old-policy log-prob the step
already has (the old-policy pass, or the engine's records when that pass is skipped); only without either does the
policy score the tokens again. The cost is one no-grad forward of the initial model over the step's rollouts on a
measured step, and the memory of one more policy-sized model.
"""

from __future__ import annotations

from typing import Optional

import torch

from emapg_cli.train.passes import score_tokens


class InitialPolicy:
    """The policy as it started (model.path), frozen, wrapped to score tokens as the anchor is."""

    def __init__(self, cfg, device: torch.device):
        from emapg_cli.models.loading import load_causal_lm
        from emapg_cli.train.logprobs import TokenScorer

        lm = load_causal_lm(cfg.model.path, cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
        lm.eval().requires_grad_(False)
        self.scorer = TokenScorer(lm).to(device)

    @torch.no_grad()
    def kl(self, batch, settings, policy_scorer) -> float:
        """k3 estimate of KL(pi_theta || pi_0) per policy token of `batch` (module docstring); NaN without tokens."""
        logp = batch.old_logp if batch.old_logp is not None else batch.sampling_logp  # [B, R] log pi_theta(y)
        if logp is None:
            logp = score_tokens(policy_scorer, batch, settings)
        logp0 = score_tokens(self.scorer, batch, settings)  # [B, R] log pi_0(y)
        mask = batch.policy_mask.bool()
        if not mask.any():
            return float("nan")
        log_r = (logp0 - logp)[mask].double()  # [tokens]
        return float((log_r.exp() - 1.0 - log_r).mean())


def make_initial(cfg, device: torch.device) -> Optional[InitialPolicy]:
    """The initial policy when eval.initial_kl_every > 0, else None."""
    return InitialPolicy(cfg, device) if cfg.eval.initial_kl_every > 0 else None


def initial_kl(initial: Optional[InitialPolicy], cfg, step: int, batch, settings, policy_scorer) -> dict[str, float]:
    """{"kl/to_initial": ...} on the steps eval.initial_kl_every measures, else {}."""
    if initial is None or step % cfg.eval.initial_kl_every:
        return {}
    return {"kl/to_initial": initial.kl(batch, settings, policy_scorer)}
