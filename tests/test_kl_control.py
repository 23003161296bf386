"""The adaptive KL coefficient (kl.target, kl.horizon): the rule on hand-computed sequences, its guards, the config's
checks, how the trainer's state carries beta, and the lines that describe it."""

from __future__ import annotations

import math

import pytest

from emapg_cli.config import load_config
from emapg_cli.errors import UserError
from emapg_cli.grpo.kl_control import adaptive_kl_coef
from emapg_cli.train import beta_control
from emapg_cli.train.loss import PolicyLoss
from emapg_cli.train.settings import StepSettings


def test_adaptive_kl_coef_hand_computed_sequence():
    # target 0.05, n = 256 responses, horizon 2560: n / horizon = 0.1, so one step moves beta by at most +-2%
    step = lambda beta, kl: adaptive_kl_coef(beta, kl, 0.05, 256, 2560)  # noqa: E731
    beta = step(0.1, 0.1)  # e = clip(0.1/0.05 - 1 = 1, +-0.2) = 0.2 -> 0.1 * (1 + 0.2*0.1) = 0.1 * 1.02 = 0.102
    assert beta == pytest.approx(0.102, abs=1e-15)
    beta = step(beta, 0.05)  # e = 0.05/0.05 - 1 = 0 -> unchanged, exactly
    assert beta == pytest.approx(0.102, abs=1e-15) and step(0.102, 0.05) == 0.102
    beta = step(beta, 0.0)  # e = clip(-1) = -0.2 -> 0.102 * (1 - 0.02) = 0.102 * 0.98 = 0.09996
    assert beta == pytest.approx(0.09996, abs=1e-15)
    beta = step(beta, 0.055)  # e = 0.055/0.05 - 1 = 0.1 (inside the clip) -> 0.09996 * 1.01 = 0.1009596
    assert beta == pytest.approx(0.1009596, abs=1e-15)
    beta = step(beta, 0.04)  # e = 0.04/0.05 - 1 = -0.2 -> 0.1009596 * 0.98 = 0.098940408
    assert beta == pytest.approx(0.098940408, abs=1e-15)
    # a negative estimate (k1 can be below 0): e = clip(-0.01/0.05 - 1 = -1.2) = -0.2 -> 0.1 * 0.98 = 0.098
    assert step(0.1, -0.01) == pytest.approx(0.098, abs=1e-15)
    # a huge KL is clipped like any KL above 1.2 x target: 0.1 * 1.02
    assert step(0.1, 1e30) == pytest.approx(0.102, abs=1e-15)


def test_adaptive_kl_coef_non_finite_kl_leaves_beta_and_bad_arguments_raise():
    for kl in (math.nan, math.inf, -math.inf):  # a skipped or diverged step: beta unchanged, not poisoned
        assert adaptive_kl_coef(0.1, kl, 0.05, 256, 2560) == 0.1
    # n / horizon = 4.99: the largest step down keeps beta positive, 0.1 * (1 - 0.2 * 4.99) = 0.1 * 0.002 = 0.0002
    assert adaptive_kl_coef(0.1, 0.0, 0.05, 499, 100) == pytest.approx(0.0002, abs=1e-15)
    for target, n, horizon in ((0.0, 256, 2560), (-1.0, 256, 2560), (0.05, 500, 100), (0.05, 0, 100), (0.05, 1, 0)):
        with pytest.raises(ValueError):
            adaptive_kl_coef(0.1, 0.1, target, n, horizon)  # 500 = 5 x 100 could reach beta = 0


def test_config_checks_of_target_and_horizon():
    cfg = load_config()
    assert cfg.kl.target is None and cfg.kl.horizon == 10000  # default: a fixed beta = kl.coef
    with pytest.raises(UserError, match=r"kl.target \(adaptive beta\) needs kl.coef > 0"):
        load_config(overrides=["kl.target=0.1", "kl.coef=0"])
    for bad in ("kl.target=0", "kl.target=-1", "kl.horizon=0"):
        with pytest.raises(UserError):
            load_config(overrides=[bad])
    # the default config rolls out 1024 responses per step: horizon 204 x 5 = 1020 <= 1024 could drive beta to 0
    responses = load_config().derived.responses_per_step
    assert responses == 1024
    with pytest.raises(UserError, match=r"kl.horizon \(204\) must exceed the responses per step / 5 \(1024 / 5\)"):
        load_config(overrides=["kl.target=0.1", "kl.horizon=204"])
    assert load_config(overrides=["kl.target=0.1", "kl.horizon=205"]).kl.horizon == 205  # 5 x 205 = 1025 > 1024


def test_beta_in_the_state_and_the_step_settings():
    fixed = load_config(overrides=["kl.coef=0.1"])
    state: dict = {}
    assert beta_control.current_beta(fixed, state) == 0.1
    beta_control.update_state(fixed, state, 0.1, 5.0)
    assert state == {}  # a fixed beta writes nothing into state.json
    assert beta_control.current_beta(fixed, {beta_control.STATE_KEY: 0.3}) == 0.1  # and ignores a stale value

    # target 0.05, 1024 responses per step, horizon 10240: n / horizon = 0.1
    adaptive = load_config(overrides=["kl.coef=0.1", "kl.target=0.05", "kl.horizon=10240"])
    assert beta_control.current_beta(adaptive, state) == 0.1  # before the first step: kl.coef
    beta_control.update_state(adaptive, state, 0.1, 0.1)  # e = 0.2 -> 0.1 * 1.02 = 0.102
    assert state[beta_control.STATE_KEY] == pytest.approx(0.102, abs=1e-15)
    beta_control.update_state(adaptive, state, state[beta_control.STATE_KEY], None)  # no KL measured: unchanged
    assert beta_control.current_beta(adaptive, state) == pytest.approx(0.102, abs=1e-15)

    settings = StepSettings(k=1, topk=False, q_from=None, old_from_engine=False, engine_required=False, single_on_policy=True,
                            correction_old_pass=False, old_pass_fallback=False, old_pass=False, anchor_pass=True,
                            anchor_inside_loss=False, anchor_autocast=False, engine_topk=0, loss=PolicyLoss(beta=0.1))
    beta, same = beta_control.for_step(fixed, {}, settings)
    assert beta == 0.1 and same is settings  # a fixed beta: the settings object as it was
    beta, moved = beta_control.for_step(adaptive, state, settings)
    assert moved.loss.beta == beta == state[beta_control.STATE_KEY] and moved.loss.estimator == settings.loss.estimator
    assert settings.loss.beta == 0.1  # frozen settings: replaced, not changed


def test_settings_line_and_dry_run_plan_name_the_rule():
    from emapg_cli.train.plan import make_plan
    from emapg_cli.train.progress import config_line

    cfg = load_config(preset="toy", overrides=["kl.target=0.05", "kl.horizon=2560"])
    assert f"KL adaptive β (target KL 0.05, horizon 2560, from {cfg.kl.coef:g})" in config_line(cfg)
    assert make_plan(cfg).kl_coef == f"adaptive β (target KL 0.05, horizon 2560, from {cfg.kl.coef:g})"
    fixed = load_config(preset="toy")
    assert f"KL β {fixed.kl.coef:g} " in config_line(fixed) and make_plan(fixed).kl_coef == ""
