"""Closed-form expectations of an estimator's value and gradient (no Monte Carlo).

The estimate depends on the sampled token p only; enumerating every token j of the vocabulary
as if it were p and weighting by its sampling probability gives the exact expectations
    E[v]     = sum_j pi_s(j) v_j(z)
    E[grad v] = grad_z sum_j sg(pi_s(j)) v_j(z)
(the sampling distribution does not move with the policy logits z in one estimate).
Tokens with pi_s(j) = 0 contribute exactly 0 (their v_j is masked before weighting). Under nucleus sampling
(`kl-check --top-p`) pi_s is the nucleus distribution: the tokens outside the nucleus get weight 0, which is
why the sampled estimators lose their support condition there (docs/estimators.md).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from emapg_cli.kl import kl_per_token
from emapg_cli.kl.common import nucleus
from emapg_cli.klcheck.evaluate import Spec, values_at


def exact_reference(direction: str, policy: Tensor, anchor: Tensor) -> tuple[Tensor, Tensor]:
    """The exact KL [P] in `direction` and its gradient w.r.t. the policy logits [P, V]."""
    z = policy.detach().clone().requires_grad_()
    kl = kl_per_token("exact", direction, logits=z, ref_logits=anchor)  # [P]
    (grad,) = torch.autograd.grad(kl.sum(), z)
    return kl.detach(), grad  # [P], [P, V]


def expected(spec: Spec, policy: Tensor, anchor: Tensor, sampling: Optional[Tensor], q: Optional[Tensor],
             top_p: float = 1.0) -> tuple[Tensor, Tensor]:
    """E[v] [P] and E[grad_z v] [P, V] of one estimator under p ~ pi_s, by enumeration; with top_p < 1 under p ~ the
    nucleus of pi_s (`kl.common.nucleus`), while the estimator's importance weight keeps reading the full-vocabulary
    pi_s, as the trainer's does (it reads the engine's full-vocabulary records)."""
    if spec.name == "exact":
        return exact_reference(spec.direction, policy, anchor)
    z = policy.detach().clone().requires_grad_()
    p_count, vocab = z.shape
    logp = torch.log_softmax(z, -1)  # [P, V]
    ref_logp = torch.log_softmax(anchor, -1)  # [P, V]
    s_logp = None if sampling is None else torch.log_softmax(sampling, -1)  # [P, V]
    pi_s = nucleus(torch.exp(logp if s_logp is None else s_logp).detach(), top_p)  # [P, V] what the tokens are drawn from
    tokens = torch.arange(vocab).expand(p_count, vocab)  # [P, V]: every token as the "sample"
    logp_q = ref_logp_q = None
    if q is not None:
        logp_q, ref_logp_q = logp.gather(-1, q), ref_logp.gather(-1, q)  # [P, k]
    v = values_at(spec, tokens, logp, ref_logp, s_logp, logp_q, ref_logp_q, q)  # [P, V]
    ev = (pi_s * torch.where(pi_s > 0, v, torch.zeros_like(v))).sum(-1)  # [P]
    (grad,) = torch.autograd.grad(ev.sum(), z)
    return ev.detach(), grad  # [P], [P, V]
