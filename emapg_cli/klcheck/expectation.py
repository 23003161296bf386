"""Closed-form expectations of an estimator's value and gradient (no Monte Carlo).

The estimate depends on the sampled token p only; enumerating every token j of the vocabulary
as if it were p and weighting by its sampling probability gives the exact expectations
    E[v]     = sum_j pi_s(j) v_j(z)
    E[grad v] = grad_z sum_j sg(pi_s(j)) v_j(z)
(the sampling distribution does not move with the policy logits z in one estimate).
Tokens with pi_s(j) = 0 contribute exactly 0 (their v_j is masked before weighting).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from emapg_cli.kl import kl_per_token
from emapg_cli.klcheck.evaluate import Spec, values_at


def exact_reference(direction: str, policy: Tensor, anchor: Tensor) -> tuple[Tensor, Tensor]:
    """The exact KL [P] in `direction` and its gradient w.r.t. the policy logits [P, V]."""
    z = policy.detach().clone().requires_grad_()
    kl = kl_per_token("exact", direction, logits=z, ref_logits=anchor)  # [P]
    (grad,) = torch.autograd.grad(kl.sum(), z)
    return kl.detach(), grad  # [P], [P, V]


def expected(spec: Spec, policy: Tensor, anchor: Tensor, sampling: Optional[Tensor], q: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """E[v] [P] and E[grad_z v] [P, V] of one estimator under p ~ pi_s, by enumeration."""
    if spec.name == "exact":
        return exact_reference(spec.direction, policy, anchor)
    z = policy.detach().clone().requires_grad_()
    p_count, vocab = z.shape
    logp = torch.log_softmax(z, -1)  # [P, V]
    ref_logp = torch.log_softmax(anchor, -1)  # [P, V]
    s_logp = None if sampling is None else torch.log_softmax(sampling, -1)  # [P, V]
    pi_s = torch.exp(logp if s_logp is None else s_logp).detach()  # [P, V]
    tokens = torch.arange(vocab).expand(p_count, vocab)  # [P, V]: every token as the "sample"
    logp_q = ref_logp_q = None
    if q is not None:
        logp_q, ref_logp_q = logp.gather(-1, q), ref_logp.gather(-1, q)  # [P, k]
    v = values_at(spec, tokens, logp, ref_logp, s_logp, logp_q, ref_logp_q, q)  # [P, V]
    ev = (pi_s * torch.where(pi_s > 0, v, torch.zeros_like(v))).sum(-1)  # [P]
    (grad,) = torch.autograd.grad(ev.sum(), z)
    return ev.detach(), grad  # [P], [P, V]
