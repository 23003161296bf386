"""BEMA (grpo/bema.py; Block & Zhang 2025, Algorithm 1) against steps computed by hand."""

from __future__ import annotations

import pytest
import torch

from emapg_cli.grpo.bema import bema_coefficients, bema_update_


def test_coefficients_by_hand():
    # rho 10, gamma 1, t 6: rho + gamma t = 16; beta = 16^-0.5 = 0.25, alpha = 16^-0.25 = 0.5
    assert bema_coefficients(6, 10.0, 1.0, 0.5, 0.25) == (0.25, 0.5)
    # gamma 2, t 3: 10 + 6 = 16 again
    assert bema_coefficients(3, 10.0, 2.0, 0.5, 0.25) == (0.25, 0.5)
    # kappa 0: beta = 1 (the EMA is the policy); eta_b 0: alpha = 1
    assert bema_coefficients(5, 10.0, 1.0, 0.0, 0.0) == (1.0, 1.0)
    # the floor: 16^-2 = 1/256 = 0.0039 < 0.1 -> beta = 0.1
    assert bema_coefficients(6, 10.0, 1.0, 2.0, 0.25, min_beta=0.1) == (0.1, 0.5)
    # TRL's defaults at t = 90: (10 + 90)^-0.5 = 0.1, 100^-0.2 = 0.398107...
    beta, alpha = bema_coefficients(90, 10.0, 1.0, 0.5, 0.2)
    assert beta == pytest.approx(0.1, abs=1e-15) and alpha == pytest.approx(0.3981071705534972, abs=1e-15)
    with pytest.raises(ValueError, match="lag \\+ multiplier \\* t > 0"):
        bema_coefficients(0, 0.0, 1.0, 0.5, 0.2)


def test_two_steps_by_hand():
    """theta_0 = 1 (the anchor and mu start there). Step t = 6 (rho 10, gamma 1, kappa 0.5, eta_b 0.5: base 16, beta =
    alpha = 0.25) with theta = 3:  mu = 1 + 0.25 (3 - 1) = 1.5,   anchor = 1.5 + 0.25 (3 - 1) = 2.0.
    Step t = 15 (base 25: beta = alpha = 0.2) with theta = 5:   mu = 1.5 + 0.2 (5 - 1.5) = 2.2,  anchor = 2.2 + 0.2 (5 - 1) = 3.0.
    A plain EMA at the same betas would sit at 2.2, 0.8 behind the trend the correction adds back."""
    theta0 = [torch.tensor([1.0, -2.0])]
    anchor, mu = [theta0[0].clone()], [theta0[0].clone()]
    beta, alpha = bema_coefficients(6, 10.0, 1.0, 0.5, 0.5)
    bema_update_(anchor, mu, theta0, [torch.tensor([3.0, -2.0])], beta, alpha)
    # the second weight never moved: it stays at theta_0 in both buffers
    assert mu[0].tolist() == [1.5, -2.0] and anchor[0].tolist() == [2.0, -2.0]
    beta, alpha = bema_coefficients(15, 10.0, 1.0, 0.5, 0.5)
    assert (beta, alpha) == pytest.approx((0.2, 0.2), abs=1e-15)
    bema_update_(anchor, mu, theta0, [torch.tensor([5.0, -2.0])], beta, alpha)
    assert mu[0].tolist() == pytest.approx([2.2, -2.0], abs=1e-6) and anchor[0].tolist() == pytest.approx([3.0, -2.0], abs=1e-6)
    assert theta0[0].tolist() == [1.0, -2.0]  # theta_0 is never written


def test_edge_cases():
    # beta = 1 copies the policy into mu bit for bit (lerp at weight 1); alpha = 0 leaves the anchor at mu
    theta0, theta = [torch.randn(5)], [torch.randn(5)]
    anchor, mu = [theta0[0].clone()], [theta0[0].clone()]
    bema_update_(anchor, mu, theta0, theta, 1.0, 0.0)
    assert torch.equal(mu[0], theta[0]) and torch.equal(anchor[0], theta[0])
    # a bf16 policy tensor is upcast to the float32 buffers first
    bema_update_(anchor, mu, theta0, [torch.full((5,), 0.5, dtype=torch.bfloat16)], 1.0, 0.0)
    assert mu[0].dtype == torch.float32 and mu[0].tolist() == [0.5] * 5
    # integer buffers (e.g. a position counter) are copied from the policy, as ema_update_ copies them
    ints = [torch.tensor([1, 2])]
    bema_update_(ints, [torch.tensor([0, 0])], [torch.tensor([0, 0])], [torch.tensor([7, 8])], 0.3, 0.5)
    assert ints[0].tolist() == [7, 8]
    with pytest.raises(ValueError, match="lists differ in length"):
        bema_update_(anchor, mu, [], theta, 0.5, 0.5)


class _Lists:
    """A strategy whose models are plain lists of tensors (train/anchor_rule.py reads them through ema_tensors)."""

    @staticmethod
    def ema_tensors(model):
        return model


def test_burn_in_by_hand():
    """anchor.bema.update_after = tau = 2, every step (N = 1), rho 3, gamma 1, kappa = eta_b = 1; the policy is
    theta_t = t after step t (theta_0 = 0), float64.
      step 1: 1 < tau, no update: the anchor stays the initial policy 0.
      step 2: = tau: θ_0 and mu become the policy, 2; the anchor stays 0 (TRL's BEMACallback).
      step 3: base 3 + 1*3 = 6, beta = alpha = 1/6: mu = (5/6)*2 + (1/6)*3 = 13/6,
              anchor = 13/6 + (1/6)*(3 - 2) = 14/6 = 7/3.
      step 4: base 7, beta = alpha = 1/7: mu = (6/7)*(13/6) + (1/7)*4 = 17/7, anchor = 17/7 + (1/7)*(4 - 2) = 19/7.
    Without the burn-in, step 1 alone (base 4, 1/4) would move the anchor to 0.25*1 + 0.25*(1 - 0) = 0.5."""
    from emapg_cli.config.loading import load_config
    from emapg_cli.train.anchor_rule import anchor_due, anchor_metrics, make_bema, move_anchor

    cfg = load_config("toy", None, ["anchor.rule=bema", "anchor.bema.update_after=2", "ema.update_period=1",
                                    "anchor.bema.lag=3", "anchor.bema.ema_power=1", "anchor.bema.bias_power=1",
                                    "train.steps=10"])
    anchor = [torch.zeros(1, dtype=torch.float64)]
    bema = make_bema(cfg, _Lists, anchor)
    seen = []
    for step in (1, 2, 3, 4):
        policy = [torch.full((1,), float(step), dtype=torch.float64)]
        if anchor_due(cfg, step, skipped=False):
            move_anchor(cfg, {}, step, _Lists, policy, anchor, bema)
        seen.append(anchor[0].item())
    assert seen[:2] == [0.0, 0.0]
    assert seen[2:] == pytest.approx([7 / 3, 19 / 7], abs=1e-12)
    assert bema.theta0[0].item() == 2.0
    # ema/decay before the first update is that update's (step tau + N = 3): 1 - 1/6
    assert anchor_metrics(cfg, {}, 1)["ema/decay"] == pytest.approx(5 / 6, abs=1e-15)
    # updates at steps 3..10: 10 - 2 = 8 of them
    assert cfg.derived.ema_updates == 8
    # N = 2, tau = 1: the snapshot at 1 (even after a skipped update), updates at 3, 5, ...; (10 - 1) // 2 = 4 updates
    cfg2 = load_config("toy", None, ["anchor.rule=bema", "anchor.bema.update_after=1", "ema.update_period=2", "train.steps=10"])
    assert [s for s in range(1, 8) if anchor_due(cfg2, s, skipped=(s == 1))] == [1, 3, 5, 7]
    assert cfg2.derived.ema_updates == 4


def test_bema_coefficients_stay_in_range():
    """beta_t = (rho + gamma t)^-kappa lies in [0, 1] for all t >= 1 iff rho + gamma >= 1 (the base grows with t):
    lag 0, multiplier 0.001 gave beta_1 = 0.001^-0.5 = 31.6, ema/decay = 1 - 31.6 = -30.6; with bias_power 50,
    alpha_1 = 0.5^-50 = 1.1e15 (and 0.001^-200 overflows a float: bias_power is also bounded, at most 100). Refused in
    one line; rho + gamma = 1 exactly is the edge that passes (beta_1 = 1)."""
    from emapg_cli.config.loading import load_config
    from emapg_cli.errors import UserError

    for sets in (["anchor.bema.lag=0", "anchor.bema.multiplier=0.001"],
                 ["anchor.bema.lag=0", "anchor.bema.multiplier=0.5", "anchor.bema.ema_power=0", "anchor.bema.bias_power=50"]):
        with pytest.raises(UserError, match="must be at least 1") as err:
            load_config("toy", None, ["anchor.rule=bema", *sets])
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="anchor.bema.bias_power: Input should be less than or equal to 100"):
        load_config("toy", None, ["anchor.rule=bema", "anchor.bema.bias_power=200"])
    edge = load_config("toy", None, ["anchor.rule=bema", "anchor.bema.lag=0.5", "anchor.bema.multiplier=0.5"])
    assert bema_coefficients(1, 0.5, 0.5, 0.5, 0.2) == (1.0, 1.0) and edge.anchor.bema.lag == 0.5
    # kappa = eta_b = 0: both coefficients are 1 whatever the base
    load_config("toy", None, ["anchor.rule=bema", "anchor.bema.lag=0", "anchor.bema.multiplier=0.5",
                              "anchor.bema.ema_power=0", "anchor.bema.bias_power=0"])
