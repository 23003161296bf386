"""The KL coefficient beta of each step: kl.coef throughout, or adapted after every step to track kl.target
(`emapg_cli.grpo.kl_control.adaptive_kl_coef`). The trainer keeps the current beta in its checkpointed state
(`STATE_KEY`, a JSON float, which round-trips exactly), so a resumed run continues with the beta it stopped at."""

from __future__ import annotations

import dataclasses
from typing import Any

#: Key of the current beta in the trainer's state (state.json of each checkpoint).
STATE_KEY = "kl_coef"


def adaptive(cfg) -> bool:
    """Beta adapts (kl.target set, with a KL term at all)."""
    return cfg.kl.target is not None and cfg.kl.coef > 0


def current_beta(cfg, state: dict[str, Any]) -> float:
    """The beta of the next step: kl.coef for a fixed beta (whatever a checkpoint holds), else the state's
    (kl.coef before the first update)."""
    if not adaptive(cfg):
        return cfg.kl.coef
    return float(state.get(STATE_KEY, cfg.kl.coef))


def for_step(cfg, state: dict[str, Any], settings) -> tuple[float, Any]:
    """The beta of the step about to run (`current_beta`) and the step settings whose loss uses it (the same object
    when it already does)."""
    beta = current_beta(cfg, state)
    if settings.loss.beta == beta:
        return beta, settings
    return beta, dataclasses.replace(settings, loss=dataclasses.replace(settings.loss, beta=beta))


def kl_coef_text(cfg) -> str:
    """How beta is set, for the run's settings line and the dry-run plan: "β 0.001" or
    "adaptive β (target KL 0.05, horizon 10000, from 0.001)"."""
    k = cfg.kl
    if k.target is None:
        return f"β {k.coef:g}"
    return f"adaptive β (target KL {k.target:g}, horizon {k.horizon}, from {k.coef:g})"


def update_state(cfg, state: dict[str, Any], beta: float, kl, n: int) -> None:
    """After a step that used `beta` and measured `kl` (its kl/per_token, the same on every rank; None without a KL
    term) on `n` trained responses (all ranks; train.mask_truncated's dropped ones are not among them): the next step's
    beta into `state`, by the adaptive rule; unchanged when no response was trained (n = 0: no KL was measured).
    Only an adaptive beta is stored (a fixed beta's state.json is as before)."""
    if not adaptive(cfg):
        return
    from emapg_cli.grpo.kl_control import adaptive_kl_coef  # the grpo package imports torch; the settings line does not

    kl = float("nan") if kl is None else float(kl)
    state[STATE_KEY] = beta if n <= 0 else adaptive_kl_coef(beta, kl, cfg.kl.target, n, cfg.kl.horizon)
