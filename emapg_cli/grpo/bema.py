"""BEMA, the bias-corrected exponential moving average (Block & Zhang 2025, "EMA Without the Lag: Bias-Corrected
Iterate Averaging Schemes", arXiv:2508.00180, Algorithm 1), as an anchor rule (`anchor.rule: bema`). Pure math on
lists of tensors: no config, no I/O.

An EMA of the iterates lags behind them: on a trend it trails by pace / (1 - eta) (docs/stability.md, S11). BEMA
removes that lag with a correction along the whole displacement since the start:

    beta_t  = max((rho + gamma t)^(-kappa), beta_min)        the EMA's step (eta_t = 1 - beta_t)      (B1)
    alpha_t = (rho + gamma t)^(-eta_b)                       the correction's weight                   (B2)
    mu_t    = (1 - beta_t) mu_{t-1} + beta_t theta_t,  mu_0 = theta_0                               (B3)
    anchor  = mu_t + alpha_t (theta_t - theta_0)                                                     (B4)

rho is the lag (a virtual starting age), gamma the multiplier, kappa the EMA power and eta_b the bias power; t counts
RL steps here (the paper's and TRL's BEMACallback count optimizer steps; TRL's defaults rho 10, gamma 1, kappa 0.5,
eta_b 0.2 are `anchor.bema`'s). kappa = 0 makes beta_t = 1 (mu_t = theta_t); eta_b = 0 makes alpha_t = 1 (the
anchor is then mu_t + theta_t - theta_0); a large rho with kappa > 0 makes beta_t small (a slow EMA).

The burn-in tau (anchor.bema.update_after; the paper's tau) follows TRL's BEMACallback: no update before RL step tau
(the anchor stays the initial policy); at step tau, theta_0 and mu are set to the policy and the anchor is left as it
is; then an update every N steps from tau + N, at the coefficients of the step t itself, not of t - tau
(train/anchor_rule.py). On a steady trend the correction overshoots: the anchor runs ahead of the policy
(docs/anchors.md).

At t = 0 the anchor is theta_0: mu_0 = theta_0 and the correction is 0. The correction needs theta_0 and mu kept
beside the anchor (`bema_update_`'s `ema` and `theta0`): two more copies of the anchor's tensors.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def bema_coefficients(t: int, lag: float, multiplier: float, ema_power: float, bias_power: float,
                      min_beta: float = 0.0) -> tuple[float, float]:
    """(beta_t, alpha_t) of RL step t >= 1: beta_t = max((rho + gamma t)^-kappa, min_beta) (B1) and
    alpha_t = (rho + gamma t)^-eta_b (B2). Needs rho + gamma t > 0."""
    base = lag + multiplier * t
    if base <= 0:
        raise ValueError(f"BEMA needs lag + multiplier * t > 0, got {lag} + {multiplier} * {t}")
    return max(base ** -ema_power, min_beta), base ** -bias_power


def bema_update_(anchor: Sequence[Tensor], ema: Sequence[Tensor], theta0: Sequence[Tensor], current: Sequence[Tensor],
                 beta: float, alpha: float) -> None:
    """In place, one BEMA step: ema <- (1 - beta) ema + beta theta (B3), anchor <- ema + alpha (theta - theta0) (B4).

    The four are matching lists (`current`, the policy's, is cast to the buffers' dtype first); `ema` and `theta0`
    hold copies in the anchor's dtype. (B3) is lerp(ema, theta, beta), exact at beta = 1 (ema becomes theta bit for bit)
    and at beta = 0 (unchanged). Non-floating tensors (integer buffers) are copied from the policy, as `ema_update_`
    copies them."""
    if not len(anchor) == len(ema) == len(theta0) == len(current):
        raise ValueError(f"BEMA lists differ in length: anchor {len(anchor)}, ema {len(ema)}, theta0 {len(theta0)}, "
                         f"policy {len(current)}")
    floats = [i for i, a in enumerate(anchor) if a.is_floating_point()]
    for i, a in enumerate(anchor):
        if not a.is_floating_point():
            a.copy_(current[i])
    if not floats:
        return
    mu = [ema[i] for i in floats]
    theta = [current[i].detach() if current[i].dtype == ema[i].dtype else current[i].detach().to(ema[i].dtype) for i in floats]
    torch._foreach_lerp_(mu, theta, beta)  # (B3)
    shift = torch._foreach_sub(theta, [theta0[i] for i in floats])  # theta - theta0
    torch._foreach_mul_(shift, alpha)
    torch._foreach_add_(shift, mu)  # alpha (theta - theta0) + ema   (B4)
    for i, s in zip(floats, shift):
        anchor[i].copy_(s)
