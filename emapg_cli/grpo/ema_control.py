"""Adaptive EMA decay: choose eta so that the policy-anchor distance tracks a target (docs/stability.md, "Adaptive eta").

Pure math: floats in, floats out (`adapt_decay`, `next_unit_lag`), and the same rule on float64 tensors for the
batched bandit simulation of `kl-check --stability` (`adapt_decay_tensor`). No config, no I/O.

**The rule** (docs/stability.md, section 5, derives it: Brown 1963's lag of exponential smoothing on a linear
trend, S11-S13). Just before anchor update k the policy-anchor distance on a trend of pace v is D_k = v S_k, where

    S_1 = 1,   S_{k+1} = 1 + eta_k S_k                                              (`next_unit_lag`)

is the lag behind a unit-speed trend (-> H = 1 / (1 - eta) for a constant eta), so v_hat = D_k / S_k and
(`adapt_decay`)

    H_new = clip(d* S_k / D_k, H / c, c H),   c = 1.2,   eta_new = clamp(1 - 1 / H_new, decay_min, decay_max):

in steady state (S_k = H) Ziegler et al.'s (2019) proportional controller with its +-20 % step limit, applied to H.
S_k in place of H is deliberate: the anchor starts on the policy, and the textbook rule winds eta up to decay_max
during the build-up, then overshoots (tests/test_ema_control.py). The distance, not the KL, is measured: exact, no
sampling noise, and independent of beta (no fight with kl.target).

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
