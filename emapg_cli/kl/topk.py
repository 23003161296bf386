"""Top-k KL: the exact sum over a top-k set q plus an importance-weighted sampled tail.

Inputs are log-probabilities gathered at q (see `common.gather_logprobs`, which takes the
gathered logits and each distribution's logsumexp), so no caller needs a [T, V] tensor of the
anchor:
  logp_q, ref_logp_q : [..., k]  log pi_theta and log pi_ref at q
  logp, ref_logp     : [...]     the same at the sampled token p
  in_q               : [...]     bool, 1[p in q]
  iw                 : [...]     s = sg(pi_theta(p)/pi_s(p)) or None (on-policy, s = 1)

q is the top-k of the sampling policy for the reverse KL and of the anchor for the forward KL
(paper Algorithms 1 and 2). Everything is computed in at least float32.

Four variants (docs/estimators.md derives each):
  topk_paper   Algorithms 1/2 as published: head + s 1[p not in q] K4 (reverse) / K5 (forward).
               Value unbiased; gradient biased by +grad P_theta(q) for k < |V|.
  topk         unbiased value *and* gradient. Reverse: the tail adds the zero-value term
               s 1[p not in q] (r - 1), whose expected gradient is grad P_theta(tail) = -grad P_theta(q).
               Forward: the tail uses sg(w) log w without K5's log r (which is mean-zero only over
               the whole vocabulary and contributes grad P_theta(tail) on the tail alone).
  topk_mass    unbiased value and gradient with topk_paper's variance: topk_paper with the head's
               mass gradient removed analytically, -/+ (P_theta(q) - sg P_theta(q)) (zero value,
               deterministic), instead of cancelling it with a sampled tail term as `topk` does.
  truncated    the exact head only (biased in value and gradient unless q holds all the mass).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from emapg_cli.kl.common import safe_exp_log_ratio, straight_through_ratio, tail_only, upcast, xlogratio_sum
from emapg_cli.kl.sampled import log_weight, k4, k5


def head_reverse(logp_q: Tensor, ref_logp_q: Tensor) -> Tensor:
    """sum_{j in q} pi_theta(j) [log pi_theta(j) - log pi_ref(j)]  (Algorithm 1, exact part). [...]"""
    return xlogratio_sum(upcast(logp_q), upcast(ref_logp_q))


def head_forward(logp_q: Tensor, ref_logp_q: Tensor) -> Tensor:
    """sum_{j in q} pi_ref(j) [log pi_ref(j) - log pi_theta(j)]  (Algorithm 2, exact part). [...]"""
    return xlogratio_sum(upcast(ref_logp_q), upcast(logp_q))


def topk_paper_reverse(logp_q, ref_logp_q, logp, ref_logp, in_q, iw: Optional[Tensor] = None) -> Tensor:
    """Algorithm 1: head + s 1[p not in q] K4(p)."""
    return head_reverse(logp_q, ref_logp_q) + tail_only(k4(logp, ref_logp), in_q, iw)


def topk_paper_forward(logp_q, ref_logp_q, logp, ref_logp, in_q, iw: Optional[Tensor] = None) -> Tensor:
    """Algorithm 2: head + s 1[p not in q] K5(p)."""
    return head_forward(logp_q, ref_logp_q) + tail_only(k5(logp, ref_logp), in_q, iw)


def topk_reverse(logp_q, ref_logp_q, logp, ref_logp, in_q, iw: Optional[Tensor] = None) -> Tensor:
    """Unbiased Top-k, reverse: head + s 1[p not in q] (K4(p) + r - 1).

    The extra r - 1 has value 0; its expected gradient sum_{j not in q} grad pi_theta(j)
    = -grad P_theta(q) cancels the grad P_theta(q) the head's gradient carries.
    """
    r = straight_through_ratio(upcast(logp))
    return head_reverse(logp_q, ref_logp_q) + tail_only(k4(logp, ref_logp) + (r - 1.0), in_q, iw)


def topk_forward(logp_q, ref_logp_q, logp, ref_logp, in_q, iw: Optional[Tensor] = None) -> Tensor:
    """Unbiased Top-k, forward: head + s 1[p not in q] sg(w) log w  (K5 without log r on the tail)."""
    log_w = log_weight(logp, ref_logp)
    tail = safe_exp_log_ratio(log_w).detach() * log_w
    return head_forward(logp_q, ref_logp_q) + tail_only(tail, in_q, iw)


def head_mass_gradient(logp_q: Tensor) -> Tensor:
    """P_theta(q) - sg P_theta(q): zero in value, gradient grad P_theta(q) = sum_{j in q} grad pi_theta(j). [...]"""
    mass = torch.exp(upcast(logp_q)).sum(-1)  # [...]
    return mass - mass.detach()


def topk_mass_reverse(logp_q, ref_logp_q, logp, ref_logp, in_q, iw: Optional[Tensor] = None) -> Tensor:
    """Unbiased Top-k, reverse, low variance: Algorithm 1 minus the head-mass gradient.

    E[grad topk_paper] = grad KL + grad P_theta(q) (docs/estimators.md); subtracting the zero-value,
    deterministic P_theta(q) - sg P_theta(q) removes the bias without adding a sampled term, so the
    per-sample gradient variance is exactly that of `topk_paper_reverse`.
    """
    return topk_paper_reverse(logp_q, ref_logp_q, logp, ref_logp, in_q, iw) - head_mass_gradient(logp_q)


def topk_mass_forward(logp_q, ref_logp_q, logp, ref_logp, in_q, iw: Optional[Tensor] = None) -> Tensor:
    """Unbiased Top-k, forward, low variance: Algorithm 2 plus the head-mass gradient.

    K5's log r on the tail contributes E = grad P_theta(tail) = -grad P_theta(q); adding the
    zero-value, deterministic P_theta(q) - sg P_theta(q) cancels it.
    """
    return topk_paper_forward(logp_q, ref_logp_q, logp, ref_logp, in_q, iw) + head_mass_gradient(logp_q)
