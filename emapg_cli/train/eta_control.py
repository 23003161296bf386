"""The EMA decay eta of each anchor update: ema.decay, or the adaptive rule of ema.target_distance (the rule itself, pure math, is emapg_cli/grpo/ema_control.py; docs/stability.md, "Adaptive eta").

The adaptive rule's state lives in the trainer's `state` dict, so every checkpoint's state.json holds it and a resumed
run continues with the same eta (JSON floats round-trip exactly): `ema_decay` (the eta of the last anchor update; before
the first, ema.decay) and `ema_unit_lag` (S_k of the next update). Fixed runs store nothing: their eta is ema.decay.
"""

from __future__ import annotations

from typing import Any, Callable

DECAY_KEY, LAG_KEY = "ema_decay", "ema_unit_lag"


def decay_in_force(ema, state: dict[str, Any]) -> float:
    """The eta of the step (logged as ema/decay): the adaptive eta after the step's anchor update (if any), or
    ema.decay."""
    if ema.target_distance is not None:
        return float(state.get(DECAY_KEY, ema.decay))
    return ema.decay


def decay_for_update(ema, state: dict[str, Any], distance_now: Callable[[], float]) -> float:
    """The eta of an anchor update. Adaptive: `distance_now()` is ||theta - theta_ema|| / ||theta||
    measured before the update (the EMA lag D_k); eta_k from eta_{k-1} and S_k (`adapt_decay`), then S_{k+1} and eta_k
    are written into `state`. Otherwise ema.decay (no measurement)."""
    if ema.target_distance is None:
        return ema.decay
    from emapg_cli.grpo.ema_control import adapt_decay, next_unit_lag

    eta, lag = float(state.get(DECAY_KEY, ema.decay)), float(state.get(LAG_KEY, 1.0))
    eta = adapt_decay(eta, lag, distance_now(), target=ema.target_distance, decay_min=ema.decay_min, decay_max=ema.decay_max)
    state[DECAY_KEY], state[LAG_KEY] = eta, next_unit_lag(lag, eta)
    return eta
