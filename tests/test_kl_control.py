"""The adaptive KL coefficient (kl.target, kl.horizon): the rule on hand-computed sequences, its guards, the config's
checks, how the trainer's state carries beta, and the lines that describe it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from emapg_cli.config import load_config
from emapg_cli.errors import UserError
from emapg_cli.grpo.kl_control import adaptive_kl_coef
from emapg_cli.train import beta_control
from emapg_cli.train.loss import PolicyLoss
from emapg_cli.train.settings import StepSettings
from train_helpers import tiny_overrides


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
    beta_control.update_state(fixed, state, 0.1, 5.0, 1024)
    assert state == {}  # a fixed beta writes nothing into state.json
    assert beta_control.current_beta(fixed, {beta_control.STATE_KEY: 0.3}) == 0.1  # and ignores a stale value

    # target 0.05, 1024 responses per step, horizon 10240: n / horizon = 0.1
    adaptive = load_config(overrides=["kl.coef=0.1", "kl.target=0.05", "kl.horizon=10240"])
    assert beta_control.current_beta(adaptive, state) == 0.1  # before the first step: kl.coef
    beta_control.update_state(adaptive, state, 0.1, 0.1, 1024)  # e = 0.2 -> 0.1 * 1.02 = 0.102
    assert state[beta_control.STATE_KEY] == pytest.approx(0.102, abs=1e-15)
    beta_control.update_state(adaptive, state, state[beta_control.STATE_KEY], None, 1024)  # no KL measured: unchanged
    assert beta_control.current_beta(adaptive, state) == pytest.approx(0.102, abs=1e-15)
    # n is the responses the step trained on, not the configured 1024 (issue 32): 512 trained (the rest dropped by
    # train.mask_truncated) moves beta half as far, 0.102 * (1 + 0.2 * 512 / 10240) = 0.102 * 1.01 = 0.10302; none: unchanged
    beta_control.update_state(adaptive, state, state[beta_control.STATE_KEY], 0.1, 512)
    assert state[beta_control.STATE_KEY] == pytest.approx(0.10302, abs=1e-15)
    beta_control.update_state(adaptive, state, state[beta_control.STATE_KEY], 0.1, 0)
    assert state[beta_control.STATE_KEY] == pytest.approx(0.10302, abs=1e-15)

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


def test_sequence_token_means_by_hand():
    from emapg_cli.train.update import sequence_token_means

    # rows [1, 2 | nan], [3 | 9, 9], [no token]: means 1.5 and 3 over the 2 rows with a token (masked values ignored)
    values = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 9.0, 9.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert sequence_token_means(values, mask) == (4.5, 2.0)


def test_adaptive_beta_measures_the_kl_per_token_on_the_trained_responses(tiny_qwen2, tmp_path):
    """issue 32, through the trainer. (a) kl/per_token is per token whatever train.loss_agg (verl's current_kl: the mean
    over sequences of each one's token mean): a teacher anchor (the tiny model with noise on its weights, so the KL
    is not 0 at step 1) and one mini-batch per step, so step 1's KL is measured before any update and two runs
    differing only in loss_agg measure the same numbers; with seq-mean-token-mean kl/value is that same mean, with
    seq-mean-token-sum it is a per-sequence sum (larger). (b) n is the trained responses: with train.mask_truncated
    the truncated ones are dropped, and beta moves by e * n / horizon with that n."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train_helpers import run_many, train_cmd, write_dataset  # noqa: I001

    teacher = tmp_path / "teacher"
    lm = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    with torch.no_grad():
        for i, p in enumerate(lm.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    lm.save_pretrained(teacher)
    AutoTokenizer.from_pretrained(tiny_qwen2).save_pretrained(teacher)
    data = write_dataset(tmp_path / "train.jsonl")
    common = {"data.eval": "null", "eval.anchor_every": 0, "train.mini_batch_prompts": 4, "train.save_every": 0}
    taught = {**common, "anchor.source": "teacher", "anchor.path": teacher}
    runs = {
        "mean": tiny_overrides(tiny_qwen2, data, steps=1, **taught, **{"train.loss_agg": "seq-mean-token-mean"}),
        "sum": tiny_overrides(tiny_qwen2, data, steps=1, **taught, **{"train.loss_agg": "seq-mean-token-sum"}),
        # the tiny byte-level model rarely draws EOS in 6 tokens: stop strings on 36 of its 259 tokens end some early
        "drop": tiny_overrides(tiny_qwen2, data, steps=2, **common, **{"kl.target": 0.01, "kl.horizon": 16,
                                                                       "train.mask_truncated": "true",
                                                                       "rollout.stop": "[" + ",".join(f"'{c}'" for c in "abcdefghijklmnopqrstuvwxyz0123456789") + "]"}),
    }
    done = run_many([train_cmd(*opts, "--out", str(tmp_path / name)) for name, opts in runs.items()])
    for r in done:
        assert r.returncode == 0, r.stderr[-2000:]
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()] for name in runs}
    mean, total = rows["mean"][-1], rows["sum"][-1]
    assert mean["kl/per_token"] == pytest.approx(total["kl/per_token"], rel=1e-6)
    assert mean["kl/value"] == pytest.approx(mean["kl/per_token"], rel=1e-5)  # seq-mean-token-mean: the same mean
    assert total["kl/value"] > 1.5 * total["kl/per_token"]  # responses of up to 6 tokens: a sum per sequence
    # (b) step 1: 16 responses, truncated_frac of them dropped; beta_2 = 0.1 * (1 + clip(KL / 0.01 - 1, +-0.2) * n / 16)
    first, second = rows["drop"][-2], rows["drop"][-1]
    n = round(16 * (1 - first["rollout/truncated_frac"]))
    assert 0 < n < 16, first["rollout/truncated_frac"]  # some dropped, some trained: n differs from the configured 16
    e = min(max(first["kl/per_token"] / 0.01 - 1, -0.2), 0.2)
    assert first["kl/coef"] == 0.1 and second["kl/coef"] == pytest.approx(0.1 * (1 + e * n / 16), rel=1e-12)
