"""GRPO pieces pinned with hand-computed values: advantages, PPO clip (clip-higher, dual-clip), aggregation, EMA, skip on non-finite."""

from __future__ import annotations

import math

import pytest
import torch

from emapg_cli.grpo import aggregate, ema_distance, ema_update_, grpo_advantages, ppo_clip_loss
from train_helpers import OneProcess


# ---------------------------------------------------------------- advantages
def test_group_advantages_hand_computed():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735
    # A = +-0.5 / 0.57735 = +-0.866025 ; group [1, 1, 1, 1]: all equal -> A = 0 (0 / (0 + eps))
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = grpo_advantages(r, "group", eps=1e-6)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert torch.allclose(a[0], torch.tensor([expected, -expected, -expected, expected]), atol=1e-6)
    assert torch.equal(a[1], torch.zeros(4))


def test_no_std_and_batch_std_advantages():
    r = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    # none: r - group mean = [[1, -1], [0, 0]]
    assert torch.equal(grpo_advantages(r, "none"), torch.tensor([[1.0, -1.0], [0.0, 0.0]]))
    # batch: batch std of [2, 0, 1, 1] = sqrt(((1)^2 + 1 + 0 + 0) / 3) = sqrt(2/3) = 0.816497
    a = grpo_advantages(r, "batch", eps=0.0)
    assert torch.allclose(a, torch.tensor([[1.0, -1.0], [0.0, 0.0]]) / math.sqrt(2 / 3), atol=1e-6)


# ---------------------------------------------------------------- PPO clip
def _loss(logratio: float, adv: float, dual=None):
    logp = torch.tensor([logratio], requires_grad=True)
    loss, clipped = ppo_clip_loss(logp, torch.zeros(1), torch.tensor([adv]), 0.2, 0.28, dual)
    loss.sum().backward()
    return float(loss.detach()), bool(clipped), float(logp.grad)


def test_ppo_clip_higher_bounds():
    # A = +1, ratio 1.5 > 1 + 0.28: loss = -1.28 (clipped, no gradient)
    loss, clipped, grad = _loss(math.log(1.5), 1.0)
    assert loss == pytest.approx(-1.28) and clipped and grad == 0.0
    # A = +1, ratio 1.2 inside [0.8, 1.28]: loss = -1.2, d/dlogp(-rho) = -rho = -1.2
    loss, clipped, grad = _loss(math.log(1.2), 1.0)
    assert loss == pytest.approx(-1.2) and not clipped and grad == pytest.approx(-1.2)
    # A = -1, ratio 0.5 < 0.8: max(0.5, 0.8) = 0.8 (clipped)
    loss, clipped, grad = _loss(math.log(0.5), -1.0)
    assert loss == pytest.approx(0.8) and clipped and grad == 0.0
    # A = +1, ratio 0.5: max(-0.5, -0.8) = -0.5, unclipped (pessimistic bound keeps the gradient)
    loss, clipped, grad = _loss(math.log(0.5), 1.0)
    assert loss == pytest.approx(-0.5) and not clipped and grad == pytest.approx(-0.5)


def test_dual_clip_bounds_negative_advantages():
    # A = -1, ratio 5: PPO loss max(5, 1.28) = 5; dual-clip c = 3 caps it at -c A = 3 (no gradient)
    loss, clipped, grad = _loss(math.log(5.0), -1.0, dual=3.0)
    assert loss == pytest.approx(3.0) and clipped and grad == 0.0
    loss, _, grad = _loss(math.log(5.0), -1.0, dual=None)
    assert loss == pytest.approx(5.0) and grad == pytest.approx(5.0)
    # A = -1, ratio 2 < c: unchanged, loss 2
    loss, clipped, _ = _loss(math.log(2.0), -1.0, dual=3.0)
    assert loss == pytest.approx(2.0) and not clipped
    # positive advantage: dual-clip does not apply (ratio 5 -> -1.28 as plain clip-higher)
    loss, _, _ = _loss(math.log(5.0), 1.0, dual=3.0)
    assert loss == pytest.approx(-1.28)


# ---------------------------------------------------------------- aggregation
def test_aggregation_modes_hand_computed():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
    assert float(aggregate(v, m, "token-mean")) == pytest.approx(2.5)
    # seq-mean-token-mean: (6 / 3 + 4 / 1) / 2 = 3.0
    assert float(aggregate(v, m, "seq-mean-token-mean")) == pytest.approx(3.0)
    # seq-mean-token-sum: (6 + 4) / 2 = 5.0
    assert float(aggregate(v, m, "seq-mean-token-sum")) == pytest.approx(5.0)


def test_micro_batch_sums_equal_full_batch():
    # gradient accumulation: micro-batch losses with the mini-batch totals sum to the full loss
    torch.manual_seed(0)
    v, m = torch.randn(6, 5), torch.rand(6, 5) > 0.3
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        full = aggregate(v, m, mode)
        parts = sum(aggregate(v[i:i + 2], m[i:i + 2], mode, float(m.sum()), 6.0) for i in (0, 2, 4))
        assert float(parts) == pytest.approx(float(full), abs=1e-6)


# ---------------------------------------------------------------- EMA
def test_ema_update_hand_computed_and_fp32_shadow():
    # eta = 0.9: 0.9 * 1 + 0.1 * 3 = 1.2 ; 0.9 * 0 + 0.1 * (-2) = -0.2 ; integer buffer copied
    shadow = [torch.tensor([1.0, 0.0]), torch.tensor([5])]
    current = [torch.tensor([3.0, -2.0], dtype=torch.bfloat16), torch.tensor([7])]
    ema_update_(shadow, current, 0.9)
    assert shadow[0].dtype == torch.float32
    assert torch.allclose(shadow[0], torch.tensor([1.2, -0.2]), atol=1e-7)
    assert shadow[1].item() == 7


def test_ema_decay_one_is_a_fixed_anchor_and_equal_values_stay_exact():
    a = torch.tensor([0.1, 0.7])
    shadow = [a.clone()]
    ema_update_(shadow, [torch.tensor([9.0, 9.0])], 1.0)
    assert torch.equal(shadow[0], a)
    # theta_ema == theta: lerp leaves the value bit-exact (rotary buffers, frozen weights)
    x = torch.tensor([0.1234567, -3.3])
    s = [x.clone()]
    ema_update_(s, [x.clone()], 0.95)
    assert torch.equal(s[0], x)


def test_ema_distance():
    # ||theta - ema|| / ||theta|| = ||(3, 4) - (0, 4)|| / ||(3, 4)|| = 3 / 5
    assert ema_distance([torch.tensor([3.0, 4.0])], [torch.tensor([0.0, 4.0])]) == pytest.approx(0.6)


# ---------------------------------------------------------------- skip on non-finite
@pytest.mark.parametrize("bad", ["loss", "grad"])
def test_non_finite_step_is_skipped(bad):
    from emapg_cli.train.parallel import Replicated
    from emapg_cli.train.update import finite_step

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    # one good step so the optimizer has state to protect
    model(torch.ones(1, 3)).sum().backward()
    assert finite_step(Replicated(OneProcess()), list(model.parameters()), opt, 1.0, True)[1]
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    loss = model(torch.ones(1, 3)).sum() * (float("nan") if bad == "grad" else 1.0)
    loss.backward()
    norm, stepped = finite_step(Replicated(OneProcess()), list(model.parameters()), opt, 1.0, loss_finite=bad != "loss")
    assert not stepped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(state_before[k], v) for k, v in opt.state[model.weight].items())
    assert all(p.grad is None for p in model.parameters())


def test_token_mean_over_ranks_is_the_global_token_mean():
    """token-mean with each rank's N_tokens = (all ranks' tokens) / world: the mean of the ranks' losses
    (what DDP/FSDP gradient averaging applies) is the token-mean of the whole mini-batch.

    rank 0: values [1, 2, 3] (3 tokens, sum 6); rank 1: values [4, 5, 6, 7, 8] (5 tokens, sum 30).
    Whole batch: 36 / 8 = 4.5. Per-rank token-mean would give (6/3 + 30/5) / 2 = (2 + 6) / 2 = 4.0.
    With the share 8 / 2 = 4: (6/4 + 30/4) / 2 = (1.5 + 7.5) / 2 = 4.5.
    """
    from emapg_cli.train.update import global_token_share

    class TwoRanks:
        num_processes, device = 2, torch.device("cpu")

        def __init__(self, other: float):
            self.other = other

        def reduce(self, t, reduction):
            assert reduction == "sum"
            return t + self.other

    v0, m0 = torch.tensor([[1.0, 2.0, 3.0, 0.0, 0.0]]), torch.tensor([[1, 1, 1, 0, 0]])
    v1, m1 = torch.tensor([[4.0, 5.0, 6.0, 7.0, 8.0]]), torch.tensor([[1, 1, 1, 1, 1]])
    share0 = global_token_share(TwoRanks(other=5.0), float(m0.sum()))
    share1 = global_token_share(TwoRanks(other=3.0), float(m1.sum()))
    assert share0 == share1 == 4.0
    averaged = (aggregate(v0, m0, "token-mean", share0) + aggregate(v1, m1, "token-mean", share1)) / 2
    assert float(averaged) == pytest.approx(4.5)
    whole = aggregate(torch.cat([v0, v1]), torch.cat([m0, m1]), "token-mean")
    assert float(averaged) == pytest.approx(float(whole))
