"""Moving the EMA anchor by the run's anchor.rule (config/anchor_rules.py; docs/anchors.md).

Every rule that is a point of the EMA(eta, N) family (ema, fixed, reset, mixup, previous, adaptive) moves the anchor
with `ema_update_` at the eta of `eta_control.decay_for_update`: config validation wrote the rule's eta into
ema.decay, so these rules run exactly the code of their (eta, N) point. `bema` keeps two more copies of the anchor's
tensors, theta_0 and BEMA's EMA mu (`BemaBuffers`), and moves the anchor with `grpo.bema.bema_update_`; the two
copies are saved in every checkpoint (`BEMA_FILE`, anchor_rule.pt), so a resumed run continues bit for bit. Its coefficients are a
pure function of the step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from emapg_cli.grpo import ema_update_
from emapg_cli.train.eta_control import decay_for_update, decay_in_force

from emapg_cli.train.checkpoint import ANCHOR_RULE_FILE as BEMA_FILE  # {"theta0.<i>", "ema.<i>"}: the anchor's tensors


class BemaBuffers:
    """theta_0 and BEMA's EMA mu (grpo/bema.py), copies of the anchor's tensors made before the first update, when the
    anchor is the policy it started from."""

    def __init__(self, tensors: list[Tensor]):
        self.theta0 = [t.detach().clone() for t in tensors]
        self.ema = [t.detach().clone() for t in tensors]

    def snapshot(self, tensors: list[Tensor]) -> None:
        """theta_0 and mu become `tensors` (the policy's): the end of BEMA's burn-in (anchor.bema.update_after)."""
        for mine, t in zip(self.theta0 + self.ema, tensors + tensors):
            mine.copy_(t.detach())

    def state_dict(self) -> dict[str, Tensor]:
        return {**{f"theta0.{i}": t for i, t in enumerate(self.theta0)}, **{f"ema.{i}": t for i, t in enumerate(self.ema)}}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Copy a checkpoint's buffers in; ValueError when their names or shapes do not fit."""
        mine = self.state_dict()
        if set(state) != set(mine):
            raise ValueError(f"{BEMA_FILE} holds {len(state)} tensors, this run's BEMA {len(mine)}")
        for name, t in mine.items():
            if tuple(state[name].shape) != tuple(t.shape):
                raise ValueError(f"{BEMA_FILE}: {name} has shape {tuple(state[name].shape)}, this run's {tuple(t.shape)}")
            t.copy_(state[name])


def make_bema(cfg, strategy, anchor) -> Optional[BemaBuffers]:
    """BEMA's buffers for anchor.rule=bema with an EMA anchor (None otherwise), from the anchor as built."""
    if anchor is None or cfg.anchor.source != "ema" or cfg.anchor.rule != "bema":
        return None
    with torch.no_grad():
        return BemaBuffers(strategy.ema_tensors(anchor))


def bema_coefficients_at(cfg, step: int) -> tuple[float, float]:
    """(beta_t, alpha_t) of the anchor update at RL step `step` (anchor.bema; grpo/bema.py B1-B2)."""
    from emapg_cli.grpo.bema import bema_coefficients

    b = cfg.anchor.bema
    return bema_coefficients(step, b.lag, b.multiplier, b.ema_power, b.bias_power, b.min_beta)


def anchor_due(cfg, step: int, skipped: bool) -> bool:
    """Whether RL step `step` moves the anchor: every ema.update_period steps, not after a skipped update, never for
    anchor.rule=fixed; bema's every N steps from its burn-in tau = anchor.bema.update_after on (TRL's BEMACallback: at
    step tau, θ_0 and mu are taken from the policy, skipped update or not, and the anchor stays where it is)."""
    tau = cfg.anchor.bema.update_after  # 0 for every rule but bema (config/anchor_rules.py)
    if cfg.anchor.rule == "fixed" or step < tau or (step - tau) % cfg.ema.update_period:
        return False
    return step == tau or not skipped


@torch.no_grad()
def move_anchor(cfg, state: dict[str, Any], step: int, strategy, policy, anchor, bema: Optional[BemaBuffers]) -> None:
    """The anchor update of RL step `step` (the trainer calls it every ema.update_period steps, not after a skipped
    optimizer step): BEMA's (B3-B4) with `bema`, else the EMA step at the rule's eta."""
    if bema is not None:
        from emapg_cli.grpo.bema import bema_update_

        if step == cfg.anchor.bema.update_after:  # the burn-in's end: θ_0 and mu become the policy (anchor_due)
            return bema.snapshot(strategy.ema_tensors(policy))
        beta, alpha = bema_coefficients_at(cfg, step)
        bema_update_(strategy.ema_tensors(anchor), bema.ema, bema.theta0, strategy.ema_tensors(policy), beta, alpha)
        return
    decay = decay_for_update(cfg.ema, state, lambda: strategy.ema_distance(policy, anchor))
    ema_update_(strategy.ema_tensors(anchor), strategy.ema_tensors(policy), decay)


def anchor_metrics(cfg, state: dict[str, Any], step: int) -> dict[str, float]:
    """`ema/decay`: the eta in force after step `step`; for bema 1 - beta_t of its latest update (of its first before
    it, at tau + N), with `ema/bema_alpha` = alpha_t, the correction's weight."""
    if cfg.anchor.rule != "bema":
        return {"ema/decay": decay_in_force(cfg.ema, state)}
    n, tau = cfg.ema.update_period, cfg.anchor.bema.update_after
    beta, alpha = bema_coefficients_at(cfg, tau + max(n, (step - tau) // n * n))
    return {"ema/decay": 1.0 - beta, "ema/bema_alpha": alpha}
