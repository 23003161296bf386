"""Adaptive EMA decay: choose eta so that the policy-anchor distance tracks a target (docs/stability.md, "Adaptive eta").

Pure math: floats in, floats out (`adapt_decay`, `next_unit_lag`), and the same rule on float64 tensors for the
batched bandit simulation of `kl-check --stability` (`adapt_decay_tensor`). No config, no I/O.

**The lag of an EMA behind a steady trend** (Brown 1963, "Smoothing, Forecasting and Prediction", the steady-state
lag of simple exponential smoothing on a linear trend). Let the policy move by a constant v per anchor update,
theta_k = theta_0 + k v, and the anchor follow theta_ema_k = eta theta_ema_{k-1} + (1 - eta) theta_k. The lag just
after update k, L_k = theta_k - theta_ema_k, obeys

    L_k = theta_k - eta theta_ema_{k-1} - (1 - eta) theta_k = eta (theta_{k-1} + v - theta_ema_{k-1}) = eta (L_{k-1} + v),

whose fixed point is L = v eta / (1 - eta) (Brown's lag). Just *before* update k the anchor is theta_ema_{k-1}, and
the lag is D_k = L_{k-1} + v -> v / (1 - eta) = v H, with H = 1 / (1 - eta) = 1 + eta / (1 - eta): the EMA's window
in anchor updates. D is what this rule measures (the distance the policy reached from the anchor it was regularised
towards during the period, the largest of the period), so the lag it controls is H, not eta / (1 - eta).

**From the start, not only in steady state.** The anchor starts at the policy, so the lag builds up: with the decays
eta_1, eta_2, ... actually used, D_k = v S_k exactly for the trend, where

    S_1 = 1,   S_{k+1} = 1 + eta_k S_k                                              (`next_unit_lag`)

is the lag of the same EMA behind a unit-speed trend (for a constant eta, S_k = (1 - eta^k) / (1 - eta) -> H: the
bias correction of Adam's moment estimates, Kingma & Ba 2015, in another guise). So v is read off one measurement,
v_hat = D_k / S_k, whatever the history, and the eta whose steady lag is the target d* is H_target = d* / v_hat =
d* S_k / D_k. The rule (`adapt_decay`):

    H_new = clip(d* S_k / D_k, H / c, c H),   c = 1.2,   eta_new = clamp(1 - 1 / H_new, decay_min, decay_max).

In steady state (S_k = H) it is the proportional rule H <- H clip(d* / D, 1/c, c) on the lag, with the +-20 % step
limit of Ziegler et al.'s adaptive KL controller (2019). The S_k in place of H is a deviation from that textbook rule,
on purpose: the anchor starts on the policy, so early distances are small whatever eta is (D_1 = v for every eta), and
the textbook rule reads that as "lag too short" and winds eta up to decay_max during the build-up, then overshoots
(on a steady trend with target 50 v, whose eta is 0.98, started at eta = 0.95: it reaches 0.999 by update 50 and still
swings between 0.953 and 0.996 over updates 100-400; this rule reaches 0.98 at update 8, as fast as the step limit
allows, and stays there; tests/test_ema_control.py). The fixed point is D = d* under any steady motion: a random walk (lag ~
sigma / sqrt(1 - eta^2)) still converges to it, only not in one step.

**Why the distance and not the KL.** ||theta - theta_ema|| / ||theta|| (`ema/distance`) is computed from the weights,
exactly and deterministically: no sampling noise to filter, and it does not depend on beta, so this loop does not fight
an adaptive KL coefficient (kl.target), which acts on the KL.

**Degenerate measurements.** D = 0 (the policy did not move: every update skipped, or lr 0) or a non-finite D carries
no information about the pace: eta stays as it is. The lag recursion S still advances with the eta used.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: Largest factor by which one anchor update may change H = 1 / (1 - eta) (Ziegler et al. 2019 clip their
#: proportional KL controller's error to +-0.2).
MAX_CHANGE = 1.2


def window(eta: float) -> float:
    """H = 1 / (1 - eta): the EMA's window in anchor updates (inf at eta = 1)."""
    return math.inf if eta >= 1.0 else 1.0 / (1.0 - eta)


def next_unit_lag(unit_lag: float, eta: float) -> float:
    """S_{k+1} = 1 + eta_k S_k: the lag, just before the next anchor update, of an EMA behind a unit-speed trend,
    after an update with decay eta_k (S_1 = 1 before the first update: the anchor started on the policy)."""
    return 1.0 + eta * unit_lag


def adapt_decay(eta: float, unit_lag: float, distance: float, *, target: float, decay_min: float, decay_max: float,
                max_change: float = MAX_CHANGE) -> float:
    """The decay of anchor update k, from eta_{k-1} = `eta`, S_k = `unit_lag` and D_k = `distance` measured just
    before the update: eta_k = clamp(1 - 1/H_new, decay_min, decay_max), H_new = clip(target S_k / D_k, H / c, c H),
    H = 1 / (1 - eta), c = max_change (module docstring). D_k = 0 or non-finite: eta unchanged.

    Needs eta < 1 (a frozen anchor's H is infinite; the config keeps decay_max < 1)."""
    return float(adapt_decay_tensor(torch.tensor(eta, dtype=torch.float64), torch.tensor(unit_lag, dtype=torch.float64),
                                    torch.tensor(distance, dtype=torch.float64), target=target, decay_min=decay_min,
                                    decay_max=decay_max, max_change=max_change))


def adapt_decay_tensor(eta: Tensor, unit_lag: Tensor, distance: Tensor, *, target: float, decay_min: float,
                       decay_max: float, max_change: float = MAX_CHANGE) -> Tensor:
    """`adapt_decay` elementwise on float64 tensors of one shape ([B]: one value per simulated run)."""
    h = 1.0 / (1.0 - eta)  # [B]
    usable = torch.isfinite(distance) & (distance > 0)  # [B]
    safe = torch.where(usable, distance, torch.ones_like(distance))  # [B]
    wanted = target * unit_lag / safe  # [B]  H whose steady lag is the target
    h_new = torch.minimum(torch.maximum(wanted, h / max_change), h * max_change)  # [B]
    eta_new = (1.0 - 1.0 / h_new).clamp(decay_min, decay_max)  # [B]
    return torch.where(usable, eta_new, eta)
