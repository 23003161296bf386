"""Single-sample KL estimators K1-K5 and K3++ (paper Table 1).

Each takes l = log pi_theta(p) (carrying the gradient) and l_ref = log pi_ref(p) at the
sampled token, shape [...], and returns the per-token estimate [...] in at least float32.
Importance weighting by s (off-policy samples) is applied by the caller
(`emapg_cli.kl.registry.kl_per_token`): E_{pi_s}[s f] = E_{pi_theta}[f] for every f here.

Expectations under p ~ pi_theta (derived in docs/estimators.md):
  estimator  value            gradient
  K1         KL_rev           0                      (biased gradient)
  K2         E[(log w)^2]/2   grad KL_rev            (biased value)
  K3         KL_rev           grad KL_fwd            (biased gradient)
  K3++       KL_rev           grad KL_rev
  K4         KL_rev           grad KL_rev
  K5         KL_fwd           grad KL_fwd
"""

from __future__ import annotations

from torch import Tensor

from emapg_cli.kl.common import LOG_RATIO_CLAMP, safe_exp_log_ratio, straight_through_ratio, upcast


def log_weight(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log w = l_ref - l, clamped to +-LOG_RATIO_CLAMP (inactive for in-range values)."""
    return (upcast(ref_logp) - upcast(logp)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K1 = -log w  (Table 1, row K1)."""
    return -log_weight(logp, ref_logp)


def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K2 = (log w)^2 / 2  (Table 1, row K2)."""
    return 0.5 * log_weight(logp, ref_logp) ** 2


def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K3 = -log w + w - 1  (Table 1, row K3; Schulman's k3). w uses the clamped log-ratio."""
    log_w = log_weight(logp, ref_logp)
    return -log_w + safe_exp_log_ratio(log_w) - 1.0


def k3pp(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K3++ = r * (-log w + w - 1)  (Table 1, row K3++): K3's value with an unbiased reverse gradient."""
    return straight_through_ratio(upcast(logp)) * k3(logp, ref_logp)


def k4(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K4 = r * sg(-log w)  (Table 1, row K4): value KL_rev, REINFORCE-style gradient of KL_rev."""
    return straight_through_ratio(upcast(logp)) * (-log_weight(logp, ref_logp)).detach()


def k5(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K5 = sg(w) * log w + log r  (Table 1, row K5): forward KL, value and gradient unbiased.

    log r = l - sg l is zero in value; it is a control variate whose gradient has mean 0
    only when summed over the whole vocabulary (so Top-k must not apply it to its tail).
    """
    l = upcast(logp)
    log_w = log_weight(l, ref_logp)
    return safe_exp_log_ratio(log_w).detach() * log_w + (l - l.detach())
