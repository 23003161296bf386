"""The anchor family (config/anchor_rules.py, train/anchor_rule.py, docs/anchors.md): each named rule is its (eta, N)
point of EMA(eta, N), bit for bit, on a tiny run; the conflicts are one line; the rule is in --dry-run and
`config show`; BEMA runs, resumes exactly and logs its coefficients; kl/to_initial measures the drift from the start."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from emapg_cli.config.loading import load_config
from emapg_cli.errors import UserError
from train_helpers import killed_and_resumed, tiny_overrides, train_cmd, write_dataset

#: Metrics that measure time, not computation: they differ between two identical runs.
CLOCK = ("time/", "throughput/")


def _cfg(*sets: str, preset: str = "toy"):
    return load_config(preset, None, list(sets))


@pytest.mark.parametrize("rule, eta, period", [
    ("fixed", 1.0, 5), ("reset", 0.0, 5), ("mixup", 0.4, 5), ("previous", 0.0, 1)])
def test_each_rule_writes_its_point_into_the_ema_section(rule, eta, period):
    # the toy preset says ema.decay 0.9 and update_period 5; the rule replaces eta (mixup: 1 - 0.6 = 0.4) and, for
    # previous, N = 1
    cfg = _cfg(f"anchor.rule={rule}")
    assert (cfg.ema.decay, cfg.ema.update_period) == (eta, period)
    assert cfg.derived.ema_updates == (0 if rule == "fixed" else 200 // period)  # fixed never moves: no updates


def test_ema_adaptive_and_bema_keep_the_ema_section():
    assert (_cfg().ema.decay, _cfg().anchor.rule) == (0.9, "ema")  # the default reproduces today's runs
    adaptive = _cfg("anchor.rule=adaptive", "ema.target_distance=0.03")
    assert (adaptive.ema.decay, adaptive.ema.target_distance) == (0.9, 0.03)
    bema = _cfg("anchor.rule=bema", "anchor.bema.lag=4")
    assert bema.ema.decay == 0.9 and bema.anchor.bema.lag == 4.0 and bema.ema.update_period == 5


@pytest.mark.parametrize("sets, message", [
    (("anchor.rule=fixed", "anchor.mixup_alpha=0.2"), "anchor.mixup_alpha applies to anchor.rule=mixup, not fixed"),
    (("anchor.rule=reset", "anchor.bema.ema_power=0.3"), "anchor.bema.ema_power applies to anchor.rule=bema, not reset"),
    (("anchor.rule=mixup", "ema.target_distance=0.1"), "ema.target_distance is the adaptive rule's target"),
    (("anchor.rule=adaptive",), "anchor.rule=adaptive needs ema.target_distance"),
    (("anchor.rule=previous", "lora.r=4"), None),  # LoRA takes the family's points
    (("anchor.rule=bema", "lora.r=4"), "lora.r > 0 does not support anchor.rule=bema yet"),
])
def test_conflicting_keys_are_one_line(sets, message):
    if message is None:
        assert _cfg(*sets).ema.update_period == 1
        return
    with pytest.raises(UserError, match=message.replace(".", r"\.").replace("(", r"\(")) as err:
        _cfg(*sets)
    assert "\n" not in str(err.value)


def test_a_teacher_takes_no_rule(tmp_path):
    with pytest.raises(UserError, match="anchor.rule=reset moves the EMA anchor, but anchor.source=teacher never moves"):
        load_config("toy-distill", None, ["anchor.rule=reset"])


def test_the_rule_in_dry_run_and_config_show(cli, emapg_home):
    wide = {"COLUMNS": "400"}  # the plan's table cells do not wrap, whatever the length of the temp paths in it
    plan = cli("train", "--preset", "toy", "--set", "anchor.rule=mixup", "--set", "anchor.mixup_alpha=0.25", "--dry-run",
               env=wide)
    assert plan.returncode == 0, plan.stderr
    assert "anchor.rule mixup: α 0.25, η = 1 - α = 0.75 (set by the rule) every 5 steps" in " ".join(plan.stdout.split())
    bema = cli("train", "--preset", "toy", "--set", "anchor.rule=bema", "--dry-run", env=wide)
    assert "anchor.rule bema: ρ 10, γ 1, κ 0.5, η_b 0.2 every 5 steps" in " ".join(bema.stdout.split())
    assert "BEMA buffers" not in bema.stdout or "memory" in bema.stdout
    shown = cli("config", "show", "--preset", "toy", "--set", "anchor.rule=previous")
    assert "rule: previous" in shown.stdout and "decay: 0.0" in shown.stdout and "update_period: 1" in shown.stdout
    bad = cli("train", "--preset", "toy", "--set", "anchor.rule=reset", "--set", "anchor.mixup_alpha=0.3", "--dry-run")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: anchor.mixup_alpha applies to anchor.rule=mixup, not reset"]


# --- the equivalences, run --------------------------------------------------------------------------------------


def _train(tmp_path: Path, name: str, model: Path, **sets) -> Path:
    """A 3-step tiny run in this process (one torch thread); its folder."""
    from emapg_cli.train import trainer as trainer_mod
    from train_launcher import install

    install()  # test_digit: a quarter of the tiny model's responses score, so the policy (and the anchor) move
    data = write_dataset(tmp_path / "data.jsonl")
    opts = tiny_overrides(model, data, steps=3, **{"train.save_every": 0, "eval.anchor_every": 0, **sets})
    cfg = load_config(overrides=[o for o in opts if o != "--set"])
    trainer_mod.Trainer(cfg, tmp_path / name).run()
    return tmp_path / name


def _fingerprint(run: Path) -> tuple[dict[str, str], list[dict]]:
    """sha256 of the final policy and anchor, and every metrics row without the clocks."""
    weights = {p: hashlib.sha256((run / "final" / p / "model.safetensors").read_bytes()).hexdigest() for p in ("policy", "anchor")}
    rows = [{k: v for k, v in json.loads(line).items() if not k.startswith(CLOCK)}
            for line in (run / "metrics.jsonl").read_text().splitlines()]
    return weights, rows


@pytest.mark.parametrize("rule, point", [
    ({"anchor.rule": "fixed"}, {"ema.decay": 1.0, "ema.update_period": 2}),
    ({"anchor.rule": "reset", "ema.update_period": 2}, {"ema.decay": 0.0, "ema.update_period": 2}),
    ({"anchor.rule": "mixup", "anchor.mixup_alpha": 0.25, "ema.update_period": 2}, {"ema.decay": 0.75, "ema.update_period": 2}),
    ({"anchor.rule": "previous", "ema.update_period": 3}, {"ema.decay": 0.0, "ema.update_period": 1}),
], ids=["fixed=eta1", "reset=eta0_N2", "mixup=eta0.75_N2", "previous=eta0_N1"])
def test_a_named_rule_is_its_point_bit_for_bit(rule, point, tiny_llama, tmp_path, one_torch_thread):
    # tiny_overrides sets ema.decay 0.5 every step: the rule must replace it, the point states it
    named, plain = _train(tmp_path, "named", tiny_llama, **rule), _train(tmp_path, "point", tiny_llama, **point)
    a, b = _fingerprint(named), _fingerprint(plain)
    assert a == b
    assert any(r.get("kl/value", 0) > 0 for r in a[1])  # the policy left its anchor (not a comparison of two idle runs)
    if rule["anchor.rule"] in ("reset", "previous"):  # eta 0 copies the policy exactly: distance 0 after each update
        period = point["ema.update_period"]
        assert [r["ema/distance"] for r in a[1] if r["step"] and r["step"] % period == 0] == [0.0] * (3 // period)


def test_the_default_rule_is_todays_ema(tiny_llama, tmp_path, one_torch_thread):
    """anchor.rule=ema written out changes nothing (the golden-weights test pins the default to the baseline)."""
    a = _fingerprint(_train(tmp_path, "implicit", tiny_llama))
    b = _fingerprint(_train(tmp_path, "explicit", tiny_llama, **{"anchor.rule": "ema"}))
    assert a == b


def test_kl_to_initial_leaves_training_unchanged(tiny_llama, tmp_path, one_torch_thread):
    """eval.initial_kl_every only measures: the same final weights and metrics as without it, plus kl/to_initial on
    the measured step (every 2 of 3 steps: step 2, sampled by the policy after one update, so above 0)."""
    plain = _fingerprint(_train(tmp_path, "plain", tiny_llama))
    run = _train(tmp_path, "measured", tiny_llama, **{"eval.initial_kl_every": 2})
    measured = _fingerprint(run)
    assert measured[0] == plain[0]
    assert [{k: v for k, v in r.items() if k != "kl/to_initial"} for r in measured[1]] == plain[1]
    kl = {r["step"]: r["kl/to_initial"] for r in measured[1] if "kl/to_initial" in r}
    assert list(kl) == [2] and kl[2] > 0  # step 2 samples from the policy after one update


def test_bema_moves_the_anchor_by_its_formula(tiny_llama, tmp_path, one_torch_thread):
    """anchor.rule=bema every step, a checkpoint after each: the anchor of step 3 is (B3-B4) recomputed here from the
    checkpointed policies theta_1..theta_3 and the initial weights theta_0: mu_0 = theta_0,
    mu_t = lerp(mu_{t-1}, theta_t, beta_t), anchor = mu_3 + alpha_3 (theta_3 - theta_0), with
    beta_t = (2 + t)^-0.5 and alpha_t = (2 + t)^-0.2 (lag 2); the metrics name the coefficients."""
    import torch
    from safetensors.torch import load_file

    from emapg_cli.grpo.bema import bema_coefficients

    run = _train(tmp_path, "bema", tiny_llama, **{"anchor.rule": "bema", "ema.update_period": 1, "anchor.bema.lag": 2.0,
                                                  "eval.initial_kl_every": 1, "train.save_every": 1})
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    coef = {t: bema_coefficients(t, 2.0, 1.0, 0.5, 0.2) for t in (1, 2, 3)}
    assert coef[3] == pytest.approx((5 ** -0.5, 5 ** -0.2), abs=1e-15)  # (0.4472, 0.7248)
    for t, (beta, alpha) in coef.items():
        assert rows[t]["ema/decay"] == pytest.approx(1 - beta, abs=1e-15) and rows[t]["ema/bema_alpha"] == pytest.approx(alpha, abs=1e-15)
    # kl/to_initial: 0 up to float rounding before the first update (the policy is the initial model), > 0 after
    assert abs(rows[1]["kl/to_initial"]) < 1e-6 and rows[3]["kl/to_initial"] > 1e-4
    ckpt = {t: torch.load(run / "checkpoints" / f"step_{t}" / "policy.pt", weights_only=True) for t in (1, 2, 3)}
    anchor = torch.load(run / "checkpoints" / "step_3" / "anchor.pt", weights_only=True)
    saved = torch.load(run / "checkpoints" / "step_3" / "anchor_rule.pt", weights_only=True)
    theta0 = load_file(tiny_llama / "model.safetensors")
    moved = 0
    for i, name in enumerate(anchor):
        if name not in theta0 or not anchor[name].is_floating_point():
            continue
        t0 = theta0[name].to(torch.float32)
        assert torch.equal(saved[f"theta0.{i}"], t0), name  # theta_0 is the model the run started from
        mu = t0.clone()
        for t in (1, 2, 3):
            mu = torch.lerp(mu, ckpt[t][name], coef[t][0])
        expected = mu + coef[3][1] * (ckpt[3][name] - t0)
        torch.testing.assert_close(anchor[name], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(saved[f"ema.{i}"], mu, rtol=0, atol=1e-6)
        moved += not torch.equal(ckpt[3][name], t0)
    assert moved > 0  # the policy moved: the formula was exercised, not only its fixed point


@pytest.mark.slow
def test_bema_resumes_bit_for_bit(tiny_llama, tmp_path):
    """SIGKILL after the first checkpoint, resume: BEMA's theta_0 and EMA come back from anchor_rule.pt, so the final
    weights and the BEMA metrics equal an uninterrupted run's."""
    opts = tiny_overrides(tiny_llama, write_dataset(tmp_path / "d.jsonl"), steps=3,
                          **{"anchor.rule": "bema", "ema.update_period": 1, "eval.anchor_every": 0})
    a, b = killed_and_resumed(opts, tmp_path)
    assert (b / "checkpoints" / "step_3" / "anchor_rule.pt").is_file()
    assert _fingerprint(a)[0] == _fingerprint(b)[0]
    assert train_cmd  # the launcher the helper runs


def test_fixed_reports_no_updates_and_previous_refuses_stale_samples(cli, emapg_home):
    """Issue 40 item 8: anchor.rule=fixed made 200 // 5 = 40 "EMA anchor updates", every one a no-op (eta = 1): it
    makes none (train/anchor_rule.anchor_due) and the plan says so. Issue 41: anchor.rule=previous with
    rollout.max_staleness = 1 anchors to the policy one update before the one that sampled the step: refused."""
    from emapg_cli.train.anchor_rule import anchor_due

    fixed = _cfg("anchor.rule=fixed")
    assert fixed.derived.ema_updates == 0 and not any(anchor_due(fixed, s, False) for s in range(1, 201))
    assert _cfg().derived.ema_updates == 200 // 5  # the toy's ema rule: 40
    wide = {"COLUMNS": "400"}
    plan = cli("train", "--preset", "toy", "--set", "anchor.rule=fixed", "--dry-run", env=wide)
    assert plan.returncode == 0 and "(no anchor updates)" in plan.stdout and "EMA anchor updates" not in plan.stdout
    stale = cli("train", "--preset", "toy", "--set", "anchor.rule=previous", "--set", "rollout.max_staleness=1",
                "--set", "rollout.engine_url=http://127.0.0.1:9", "--dry-run", env=wide)
    assert stale.returncode == 2 and stale.stderr.strip().splitlines() == [
        "error: anchor.rule=previous anchors to the policy that sampled the step, and rollout.max_staleness=1 samples "
        "from weights up to that many updates older: drop one"]
