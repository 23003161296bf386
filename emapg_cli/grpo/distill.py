"""On-policy distillation (OPD) as pure tensor functions: the per-token loss that pulls the student toward a teacher.

Notation per position t of a student sample y ~ pi_theta (docs/distill.md, "The objective"):
  l_t = log pi_theta(y_t | y_<t) (carries the gradient),  l_T,t = log pi_T(y_t | y_<t) (the teacher, a constant).

The per-position reverse KL D_t = KL(pi_theta(.|y_<t) || pi_T(.|y_<t)) has the gradient (prefix held fixed)
  grad D_t = E_{y_t ~ pi_theta}[(l_t - l_T,t) grad l_t]         (E[grad l_t] = 0 removes the pathwise term)
which is the REINFORCE estimate with the per-token reward -(l_t - l_T,t): Thinking Machines' "On-Policy
Distillation" (2025) per-token advantage A_t = -(log pi_theta - log pi_teacher), with discount 0, and GKD's
(Agarwal et al. 2023, Eq. 2-3) on-policy divergence with the student's samples held fixed.

The single-sample estimator K1 = l_t - l_T,t has the right value but its autograd gradient grad l_t has
expectation 0 (the paper's Table 1, row K1): used as a loss it trains nothing in expectation. So every
objective that distils swaps K1 for its score-function form, Table 1's K4 (`kl.sampled.k4`: value K1, gradient
sg(l_t - l_T,t) grad l_t); the other estimators are already surrogates whose autograd gradient is (for the unbiased
ones) the per-position gradient, and `kl-check` measures each (`distill_estimator` names the row that applies).
"""

from __future__ import annotations

import torch
from torch import Tensor

from emapg_cli.kl.common import upcast

#: Estimators whose autograd gradient is zero in expectation, and the registry name of their score-function form
#: (value unchanged, gradient sg(K1) grad l): K1 -> K4 (Table 1, `kl.sampled.k4`).
SCORE_FUNCTION_FORM = {"k1": "k4"}


def distill_estimator(name: str) -> str:
    """The estimator an objective that distils trains with, for kl.estimator `name`: K1's score-function form
    (K4) for K1, `name` itself for every other (their autograd gradients are what `kl-check` measures)."""
    return SCORE_FUNCTION_FORM.get(name, name)


def tail_mass(logp_q: Tensor) -> Tensor:
    """1 - P_theta(q) = 1 - sum_{j in q} pi_theta(j): the student's probability outside the top-k set q (TA-OPD's
    "tail mass"), clamped at 0 against rounding. logp_q [..., k] -> [...] float32, detached."""
    return (1.0 - torch.exp(upcast(logp_q.detach())).sum(-1)).clamp(min=0.0)
