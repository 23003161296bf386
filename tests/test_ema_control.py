"""Adaptive and scheduled EMA decay: the rule by hand (grpo/ema_control.py), the schedule lookup, the config checks,
the trainer-side state (train/eta_control.py). The SIGKILL-and-resume run with adaptive eta (and beta) is in test_resume.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from emapg_cli.config.anchor_rules import describe_decay
from emapg_cli.config.models import Config, EMAConfig
from emapg_cli.grpo.ema_control import adapt_decay, adapt_decay_tensor, next_unit_lag
from emapg_cli.train.eta_control import decay_for_update, decay_in_force

LIMITS = dict(decay_min=0.5, decay_max=0.999)


def test_rule_by_hand():
    # eta 0.5: H = 1/(1-0.5) = 2. S = 1, D = 0.01, target 0.1: wanted H = 0.1*1/0.01 = 10 -> capped at 1.2*2 = 2.4
    # -> eta = 1 - 1/2.4 = 0.58333...
    assert adapt_decay(0.5, 1.0, 0.01, target=0.1, **LIMITS) == pytest.approx(1 - 1 / 2.4, abs=1e-15)
    # eta 0.9: H = 10. S = 8, D = 0.1, target 0.11: wanted H = 0.11*8/0.1 = 8.8, inside [10/1.2, 12] = [8.33, 12]
    # -> eta = 1 - 1/8.8 = 0.886363...
    assert adapt_decay(0.9, 8.0, 0.1, target=0.11, **LIMITS) == pytest.approx(1 - 1 / 8.8, abs=1e-12)
    # far too far: wanted H = 0.01*10/1 = 0.1 -> floored at 10/1.2 = 8.333 -> eta = 1 - 0.12 = 0.88
    assert adapt_decay(0.9, 10.0, 1.0, target=0.01, **LIMITS) == pytest.approx(0.88, abs=1e-12)
    # the clamp: eta 0.5, wanted H far below -> H = 2/1.2 = 1.667 -> eta = 0.4 -> decay_min 0.5
    assert adapt_decay(0.5, 1.0, 1.0, target=1e-3, **LIMITS) == 0.5
    # and at the top: eta 0.999 (H = 1000), wanted huge -> H = 1200 -> eta = 0.99917 -> decay_max 0.999
    assert adapt_decay(0.999, 1000.0, 1e-9, target=1.0, **LIMITS) == 0.999
    # no information: D = 0, nan or inf leaves eta as it is
    for d in (0.0, math.nan, math.inf):
        assert adapt_decay(0.7, 3.0, d, target=0.1, **LIMITS) == 0.7
    # the unit lag: S_{k+1} = 1 + eta_k S_k: 1 + 0.5 * 1 = 1.5; 1 + 0.9 * 1.5 = 2.35
    assert next_unit_lag(1.0, 0.5) == 1.5 and next_unit_lag(1.5, 0.9) == pytest.approx(2.35, abs=1e-15)
    # the tensor form (the stability simulation's) is the same arithmetic, element by element
    eta, lag, d = torch.tensor([0.5, 0.9, 0.7]), torch.tensor([1.0, 8.0, 3.0]), torch.tensor([0.01, 0.1, 0.0])
    out = adapt_decay_tensor(eta.double(), lag.double(), d.double(), target=0.11, **LIMITS)
    assert out.tolist() == [adapt_decay(float(a), float(b), float(c), target=0.11, **LIMITS) for a, b, c in zip(eta, lag, d)]


def test_sequence_on_a_steady_trend_by_hand():
    """The policy moves v = 1 per anchor update (scalar weights), target d* = 4, start eta 0.5: the lag before update k
    is D_k = v S_k, so the rule reads v exactly and heads for H = d*/v = 4 (eta 0.75), 20 % of H per update at most."""
    theta = anchor = 0.0
    eta, lag, etas, dists = 0.5, 1.0, [], []
    for _ in range(6):
        theta += 1.0
        dist = theta - anchor
        eta = adapt_decay(eta, lag, dist, target=4.0, **LIMITS)
        lag = next_unit_lag(lag, eta)
        anchor = eta * anchor + (1 - eta) * theta
        etas.append(eta)
        dists.append(dist)
    # k=1: D = 1, S = 1, wanted H = 4*1/1 = 4, H was 2 -> 2.4, eta = 1 - 1/2.4 = 0.583333; S_2 = 1 + 0.583333 = 1.583333
    # k=2: D = 1 + 0.583333*1 = 1.583333 = S_2 (the trend: D = v S) -> wanted 4, H 2.4 -> 2.88, eta = 0.652778
    # k=3: wanted 4, H 2.88 -> 3.456, eta = 1 - 1/3.456 = 0.710648
    # k=4: wanted 4 inside [3.456/1.2, 3.456*1.2] = [2.88, 4.147] -> H = 4, eta = 0.75; then 0.75 for good
    assert etas == pytest.approx([1 - 1 / 2.4, 1 - 1 / 2.88, 1 - 1 / 3.456, 0.75, 0.75, 0.75], abs=1e-12)
    assert dists[:2] == pytest.approx([1.0, 1 + (1 - 1 / 2.4)], abs=1e-12)
    # then the lag approaches d* = 4 = v / (1 - 0.75) geometrically: D_6 = 1 + 0.75 D_5 (2.8339 -> 3.1254)
    assert dists[5] == pytest.approx(1 + 0.75 * dists[4], abs=1e-12) and 3.1 < dists[5] < 4


def test_the_unit_lag_stops_windup():
    """Long run on the same trend, target 50 (eta* = 0.98) from eta 0.95: the rule reaches 0.98 by update 8 and stays;
    the textbook rule on H without S (H <- H clip(d*/D)) winds up to decay_max during the build-up of the lag."""
    def drive(textbook: bool) -> list[float]:
        theta = anchor = 0.0
        eta, lag, out = 0.95, 1.0, []
        for _ in range(100):
            theta += 1.0
            d = theta - anchor
            eta = adapt_decay(eta, 1 / (1 - eta) if textbook else lag, d, target=50.0, **LIMITS)
            lag = next_unit_lag(lag, eta)
            anchor = eta * anchor + (1 - eta) * theta
            out.append(eta)
        return out
    ours, textbook = drive(False), drive(True)
    assert all(e == pytest.approx(0.98, abs=1e-12) for e in ours[7:])
    assert max(textbook) == 0.999 and min(textbook[50:]) < 0.97  # wound up, then swinging back


def test_fixed_eta_is_ema_decay():
    e = EMAConfig(decay=0.97)
    assert decay_for_update(e, {}, lambda: pytest.fail("a fixed eta measures nothing")) == 0.97
    assert decay_in_force(e, {}) == 0.97
    assert describe_decay(e) == "η 0.97"


def test_removed_decay_schedule():
    """ema.decay_schedule is gone: a run's config.yaml holding it empty still loads (--resume); a plan is refused."""
    from emapg_cli.config.loading import validate
    from emapg_cli.errors import UserError

    assert validate({"ema": {"decay_schedule": []}}).ema == EMAConfig()
    with pytest.raises(UserError, match="ema.decay_schedule .* is gone"):
        validate({"ema": {"decay_schedule": [{"steps": 100, "decay": 0.9}]}})


def test_adaptive_state_in_the_trainer_dict():
    e = EMAConfig(target_distance=0.1, decay=0.5)
    state: dict = {}
    assert decay_in_force(e, state) == 0.5  # before the first anchor update: ema.decay
    # update 1: as in test_rule_by_hand, eta 0.5 -> 0.583333, S_2 = 1.583333
    assert decay_for_update(e, state, lambda: 0.01) == pytest.approx(1 - 1 / 2.4, abs=1e-15)
    assert state == {"ema_decay": pytest.approx(1 - 1 / 2.4, abs=1e-15), "ema_unit_lag": pytest.approx(2 - 1 / 2.4, abs=1e-15)}
    assert decay_in_force(e, state) == state["ema_decay"]
    assert json.loads(json.dumps(state)) == state  # checkpointed in state.json: floats round-trip exactly
    assert describe_decay(e) == "adaptive η (target distance 0.1, [0.5, 0.999], from 0.5)"


@pytest.mark.parametrize("values, message", [
    ({"decay_min": 0.9, "decay_max": 0.8}, "must not exceed ema.decay_max"),
    ({"target_distance": 0.1, "decay": 1.0}, "is the starting eta and must lie in"),
    ({"target_distance": 0.1, "decay_max": 1.0}, "ema.decay_max must be below 1"),
    ({"target_distance": 0.0}, "greater than 0"),
])
def test_config_refuses(values, message):
    with pytest.raises(ValueError, match=message):
        Config(ema=values)
