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
