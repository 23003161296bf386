"""Tail-aware Top-k estimators for on-policy distillation (docs/distill.md, "Estimators").

Same inputs as `emapg_cli.kl.topk` (log-probs gathered at the top-k set q, the sampled token's
log-probs, in_q, the importance weight s); pure tensor functions, at least float32.

Notation per position: pi = policy (student), rho = anchor (teacher), P = pi(q), A = rho(q),
P_t = 1 - P and A_t = 1 - A the leftover ("tail") masses, L = log(P_t / A_t) the log-ratio of the
merged tail token, H_q = sum_{j in q} pi_j log(pi_j / rho_j) the exact head, T_q the tail's share of
the reverse KL, KL_r = H_q + T_q.

The equations are our reading of the definitions in the papers (the issue tracker states them; the
papers' own equation numbers are not reproduced here):
  topk_tail          TA-OPD (arXiv 2608.14728), the "tail token": the KL between pi and rho coarsened
                     to q plus ONE token carrying the leftover mass, H_q + P_t L. Deterministic;
                     <= KL_r by the log-sum inequality (coarsening cannot increase a KL).
  topk_tail_sc       TA-OPD's sample-corrected form: topk_tail + s 1[p not in q] (log w_tail) with the
                     within-tail log-ratio log w_tail = l - l_ref - L. Unbiased in value and gradient.
  topk_resid         ResOPD (arXiv 2610.04882): topk_mass plus a zero-mean control variate on the tail
                     bucket, -sg(L) [s 1[p not in q] (r - 1) - (P_t - sg P_t)]: zero value for every
                     sample, zero-mean gradient. Same per-sample gradient as topk_tail_sc.
  teacher_support    "Revisiting On-Policy Distillation" (arXiv 2603.25562): the reverse KL on the
                     teacher's top-K support (q taken from the anchor), renormalised over q
                     (`teacher_support`) or not (`teacher_support_raw`, numerically `truncated`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from emapg_cli.kl.common import straight_through_ratio, tail_only, upcast, xlogratio_sum
from emapg_cli.kl.sampled import log_weight
from emapg_cli.kl.topk import head_forward, head_mass_gradient, head_reverse, topk_mass_reverse

#: A tail mass below TAIL_FLOOR_ULPS x the dtype's machine epsilon is below the rounding error of
#: 1 - sum_{j in q} pi_j and is treated as exactly 0 (float64: 1.4e-14, float32: 7.6e-6). This is
#: the "guard" of the stable tail: it keeps log(P_t / A_t) finite when q holds all the mass.
TAIL_FLOOR_ULPS = 64


def tail_floor(x: Tensor) -> float:
    """The smallest tail mass resolved in x's dtype (see TAIL_FLOOR_ULPS)."""
    return TAIL_FLOOR_ULPS * torch.finfo(x.dtype).eps


def log_tail_mass(logp_q: Tensor) -> tuple[Tensor, Tensor]:
    """(log(1 - sum_{j in q} exp(logp_q_j)) [...], empty [...]), computed stably as log1mexp(lse) with
    lse = logsumexp(logp_q).

    log1mexp(x) = log(-expm1(x)) for x > -ln 2 (a small tail) and log1p(-exp(x)) otherwise
    (Maechler 2012, "Accurately computing log(1 - exp(-|a|))"). Guard: where the tail mass is at most
    the floor (`empty`), lse is capped at log(1 - floor), so the log is log(floor): finite, with zero
    gradient.
    """
    logp_q = upcast(logp_q)  # [..., k]
    cap = math.log1p(-tail_floor(logp_q))
    lse = torch.logsumexp(logp_q, dim=-1)  # [...]
    empty = lse >= cap
    lse = lse.clamp(max=cap)
    small = lse > -math.log(2.0)
    # each branch gets an argument on which it is finite, so `where` leaks no NaN into the gradient
    a = torch.log(-torch.expm1(torch.where(small, lse, torch.full_like(lse, -1.0))))
    b = torch.log1p(-torch.exp(torch.where(small, torch.full_like(lse, -1.0), lse)))
    return torch.where(small, a, b), empty


def tail_token(logp_q: Tensor, ref_logp_q: Tensor) -> tuple[Tensor, Tensor]:
    """(P_t, L): the first distribution's tail mass [...] (with gradient; exactly 0 where at most the
    floor: 0 log(0 / a) = 0) and the tail token's log-ratio L = log P_t - log A_t [...] (A_t the second
    distribution's tail mass; a mass at most the floor counts as the floor, so L stays finite)."""
    log_pt, empty = log_tail_mass(logp_q)
    log_at, _ = log_tail_mass(ref_logp_q)
    pt = torch.where(empty, torch.zeros_like(log_pt), torch.exp(log_pt))
    return pt, log_pt - log_at


def topk_tail_reverse(logp_q, ref_logp_q, logp=None, ref_logp=None, in_q=None, iw: Optional[Tensor] = None) -> Tensor:
    """TA-OPD's tail token, reverse: H_q + P_t log(P_t / A_t). [...]

    KL(pi_c || rho_c) of the two distributions coarsened to the k tokens of q plus one tail token;
    by the log-sum inequality sum_{j not in q} pi_j log(pi_j/rho_j) >= P_t log(P_t/A_t), so the value
    is <= KL_r (equal iff pi/rho is constant on the tail). Deterministic: the sampled token is unused.
    Its gradient is the gradient of the coarsened KL, not of KL_r (biased).
    """
    pt, log_ratio = tail_token(logp_q, ref_logp_q)
    return head_reverse(logp_q, ref_logp_q) + pt * log_ratio


def topk_tail_forward(logp_q, ref_logp_q, logp=None, ref_logp=None, in_q=None, iw: Optional[Tensor] = None) -> Tensor:
    """TA-OPD's tail token, forward: H^f_q + A_t log(A_t / P_t) <= KL_f (the same log-sum inequality). [...]"""
    at, log_ratio = tail_token(ref_logp_q, logp_q)  # A_t and log(A_t / P_t), gradient through P_t
    return head_forward(logp_q, ref_logp_q) + at.detach() * log_ratio


def topk_tail_sc_reverse(logp_q, ref_logp_q, logp, ref_logp, in_q, iw: Optional[Tensor] = None) -> Tensor:
    """TA-OPD's sample-corrected tail token, reverse:
        H_q + P_t L + s 1[p not in q] r sg(l - l_ref - L).   [...]

    Value: E[s 1[p not in q] (l - l_ref - L)] = T_q - P_t L, so E[value] = KL_r (unbiased); the
    correction is P_t x KL(pi_tail || rho_tail) of the renormalised tails, estimated by its K1/K4 term.
    Gradient: (L + 1) grad P_t from the tail token plus E[s 1[p not in q] (l - l_ref - L) grad l]
    = sum_{j not in q} pi_j (l_j - l_ref,j) grad l_j - L grad P_t, in total grad H_q + grad T_q
    = grad KL_r (unbiased). L is a baseline inside the tail: the sampled term's coefficient is
    l - l_ref - L instead of topk_mass's l - l_ref.
    """
    pt, log_ratio = tail_token(logp_q, ref_logp_q)
    r = straight_through_ratio(upcast(logp))
    within = (-log_weight(logp, ref_logp) - log_ratio).detach()  # l - l_ref - L: the within-tail log-ratio
    return head_reverse(logp_q, ref_logp_q) + pt * log_ratio + tail_only(r * within, in_q, iw)


def topk_resid_reverse(logp_q, ref_logp_q, logp, ref_logp, in_q, iw: Optional[Tensor] = None) -> Tensor:
    """ResOPD's tail residualisation on top of the mass-corrected Top-k, reverse:
        topk_mass - sg(L) [s 1[p not in q] (r - 1) - (P_t - sg P_t)].   [...]

    The bracket is 0 in value for every sample (r = 1, P_t - sg P_t = 0); its gradient
    s 1[p not in q] grad l - grad P_t has expectation grad P_t - grad P_t = 0 (score identity on the
    tail). So the estimator keeps topk_mass's value and expected gradient (both unbiased) and, per
    sample, the tail's REINFORCE coefficient becomes the residual l - l_ref - L: the tail bucket's
    log-ratio L is the control variate's coefficient. (P_t - sg P_t = -(P - sg P) = -head_mass_gradient.)
    """
    _, log_ratio = tail_token(logp_q, ref_logp_q)
    r = straight_through_ratio(upcast(logp))
    control = tail_only(r - 1.0, in_q, iw) + head_mass_gradient(logp_q)  # [...] value 0, mean gradient 0
    return topk_mass_reverse(logp_q, ref_logp_q, logp, ref_logp, in_q, iw) - log_ratio.detach() * control


def teacher_support_reverse(logp_q, ref_logp_q, logp=None, ref_logp=None, in_q=None, iw: Optional[Tensor] = None) -> Tensor:
    """Reverse KL on the support q, both distributions renormalised over q:
        sum_{j in q} (pi_j / P) log((pi_j / P) / (rho_j / A)) = H_q / P - log(P / A).   [...]
    With q the anchor's top-K this is Revisiting-OPD's teacher top-K support matching (our reading).
    Deterministic; >= 0, and 0 iff pi is proportional to rho on q (biased against KL_r: another target).
    """
    lp, lr = upcast(logp_q), upcast(ref_logp_q)  # [..., k]
    lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)
    lr = lr - torch.logsumexp(lr, dim=-1, keepdim=True)
    return xlogratio_sum(lp, lr)
