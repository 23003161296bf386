"""The anchor family in one place: `anchor.rule` names how the EMA anchor moves (docs/anchors.md).

Most named rules are points of one family, EMA(eta, N): every N = ema.update_period RL steps the anchor moves as
theta_anchor <- eta theta_anchor + (1 - eta) theta (paper Eq. 5). A named rule sets eta itself, written into
ema.decay (and, for `previous`, N into ema.update_period) when the config is validated, so the trainer runs the very
same code as the (eta, N) point, bit for bit (tests/test_anchor_rules.py). The table of rules, and the keys each
rule refuses when they are not at their default: docs/anchors.md.
"""

from __future__ import annotations

from typing import Optional

#: What each rule is, in one line (the --dry-run plan, `emapg config keys`).
SUMMARY = {
    "ema": "the EMA of the policy: eta = ema.decay (adaptive with ema.target_distance) every ema.update_period steps (EMA-PG)",
    "fixed": "a fixed reference, the initial policy: eta = 1 (GRPO, verl)",
    "reset": "a hard reset of the anchor to the policy every ema.update_period steps: eta = 0 (ProRL, slime's --ref-update-interval)",
    "mixup": "theta_anchor <- alpha theta + (1 - alpha) theta_anchor every ema.update_period steps: eta = 1 - anchor.mixup_alpha (TR-DPO, TRL's sync_ref_model)",
    "previous": "the previous policy, the one that sampled the step: eta = 0 every step (a KL to the behaviour policy, as prime-rl)",
    "adaptive": "the EMA with eta adapted at each update so the policy-anchor distance tracks ema.target_distance (docs/stability.md)",
    "bema": "BEMA, the bias-corrected EMA (Block & Zhang 2025): an EMA with a decaying step plus a correction along theta - theta_0, every ema.update_period steps (anchor.bema)",
}


def rule_point(anchor) -> tuple[Optional[float], Optional[int]]:
    """(eta, N) that the rule of `anchor` (the `anchor` section) fixes; None where the rule leaves it to the `ema`
    section (ema, adaptive, bema: eta; every rule but previous: N)."""
    return {"fixed": (1.0, None), "reset": (0.0, None), "mixup": (1.0 - anchor.mixup_alpha, None),
            "previous": (0.0, 1)}.get(anchor.rule, (None, None))


def changed_keys(section, keys: tuple[str, ...]) -> list[str]:
    """The keys of `section` whose values differ from their defaults."""
    fields = type(section).model_fields
    return [k for k in keys if getattr(section, k) != fields[k].get_default(call_default_factory=True)]


def apply_rule(cfg) -> None:
    """Check the keys of the run's anchor rule against each other and write the (eta, N) it fixes into the `ema`
    section (module docstring). ValueError, one line, on a conflict."""
    a, e = cfg.anchor, cfg.ema
    rule = a.rule
    if a.source == "teacher" and rule != "ema":
        raise ValueError(f"anchor.rule={rule} moves the EMA anchor, but anchor.source=teacher never moves: drop anchor.rule")
    if e.target_distance is not None and rule not in ("ema", "adaptive"):
        raise ValueError(f"ema.target_distance is the adaptive rule's target; anchor.rule={rule} sets eta itself: drop one")
    if rule == "adaptive" and e.target_distance is None:
        raise ValueError("anchor.rule=adaptive needs ema.target_distance (the policy-anchor distance to track, e.g. 0.03)")
    if rule != "mixup" and changed_keys(a, ("mixup_alpha",)):
        raise ValueError(f"anchor.mixup_alpha applies to anchor.rule=mixup, not {rule}")
    if rule == "previous" and cfg.rollout.max_staleness:
        raise ValueError(f"anchor.rule=previous anchors to the policy that sampled the step, and rollout.max_staleness="
                         f"{cfg.rollout.max_staleness} samples from weights up to that many updates older: drop one")
    bema = changed_keys(a.bema, tuple(type(a.bema).model_fields))
    if rule != "bema" and bema:
        raise ValueError(f"anchor.bema.{bema[0]} applies to anchor.rule=bema, not {rule}")
    eta, period = rule_point(a)
    if eta is not None and e.decay != eta:
        e.decay = eta
    if period is not None and e.update_period != period:
        e.update_period = period


def describe_decay(ema) -> str:
    """How the ema rule's eta is chosen: `adaptive η (target distance 0.01, [0.5, 0.999], from 0.9)` or `η 0.95`."""
    if ema.target_distance is not None:
        return f"adaptive η (target distance {ema.target_distance:g}, [{ema.decay_min:g}, {ema.decay_max:g}], from {ema.decay:g})"
    return f"η {ema.decay:g}"


def describe_rule(cfg) -> str:
    """The run's anchor in one line, for the --dry-run plan and the settings line: `ema: η 0.9 every 5 steps`,
    `reset: η 0 (set by the rule) every 5 steps`, `bema: ρ 10, γ 1, κ 0.5, η_b 0.2 every 5 steps`, `teacher PATH`."""
    a, e = cfg.anchor, cfg.ema
    if a.source == "teacher":
        return f"teacher {a.path} ({a.dtype or cfg.model.dtype}), never updated"
    every = "every step" if e.update_period == 1 else f"every {e.update_period} steps"
    start = getattr(cfg, "_anchor_from", None)  # a resume that changed the rule (cli/train_cmd.py)
    if a.rule == "fixed":
        return f"fixed: η 1 (set by the rule), {f'{start}, not the initial policy' if start else 'the initial policy'}, never updated"
    if start:
        return f"{_describe(cfg, every)}, starting from {start}, not the initial policy"
    return _describe(cfg, every)


def _describe(cfg, every: str) -> str:
    a, e = cfg.anchor, cfg.ema
    if a.rule == "bema":
        b = a.bema
        floor = f", β_min {b.min_beta:g}" if b.min_beta else ""
        return (f"bema: ρ {b.lag:g}, γ {b.multiplier:g}, κ {b.ema_power:g}, η_b {b.bias_power:g}{floor} {every} "
                "(β_t = (ρ + γt)^-κ, α_t = (ρ + γt)^-η_b)")
    if a.rule in ("reset", "previous"):
        return f"{a.rule}: η 0 (set by the rule) {every}" + (", N 1 (set by the rule)" if a.rule == "previous" else "")
    if a.rule == "mixup":
        return f"mixup: α {a.mixup_alpha:g}, η = 1 - α = {e.decay:g} (set by the rule) {every}"
    return f"{a.rule}: {describe_decay(e)} {every}"
