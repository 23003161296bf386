"""Distillation as a run (train.objective, docs/distill.md): the per-token OPD loss by hand, the estimator rule,
the config's refusals, and a 2-step CLI run that distils without calling the verifier."""

from __future__ import annotations

import json
import math

import pytest
import torch

from emapg_cli.grpo.distill import distill_estimator, tail_mass
from emapg_cli.kl import kl_per_token
from emapg_cli.kl.sampled import k1, k4

LN2 = math.log(2.0)


def test_the_opd_loss_k4_value_and_gradient_by_hand():
    # student pi(y_t) = 0.5, 0.2, 0.1 at three sampled tokens; teacher pi_T(y_t) = 0.25, 0.4, 0.1
    l = torch.log(torch.tensor([0.5, 0.2, 0.1], dtype=torch.float64)).requires_grad_()
    l_t = torch.log(torch.tensor([0.25, 0.4, 0.1], dtype=torch.float64))
    loss = k4(l, l_t)  # the sampled-token OPD loss: K1 trained in its score-function form
    # value: K1 = l - l_T = ln 2, ln 0.5 = -ln 2, 0
    assert loss.tolist() == pytest.approx([LN2, -LN2, 0.0], abs=1e-12)
    # gradient of the sum w.r.t. l_t: sg(l_t - l_T,t) * d r_t / d l_t = (l - l_T) * 1 = ln 2, -ln 2, 0
    (g,) = torch.autograd.grad(loss.sum(), l)
    assert g.tolist() == pytest.approx([LN2, -LN2, 0.0], abs=1e-12)
    # K1's own autograd gradient is d(l - l_T)/dl = 1 at every token whatever the teacher says: zero in expectation
    (g1,) = torch.autograd.grad(k1(l, l_t).sum(), l)
    assert g1.tolist() == [1.0, 1.0, 1.0]


def test_the_expected_opd_gradient_is_the_reverse_kl_gradient():
    # one position, student softmax(theta) = (0.5, 0.3, 0.2), teacher (0.2, 0.3, 0.5); the expectation over the sampled
    # token y ~ pi_theta is a sum weighted by pi(y) (exact, no sampling)
    theta = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)).requires_grad_()
    teacher = torch.log(torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64))
    logp = torch.log_softmax(theta, -1)
    pi = logp.exp().detach()
    expected = sum(pi[y] * k4(logp[y], teacher[y]) for y in range(3))
    (g,) = torch.autograd.grad(expected, theta)
    # KL = 0.5 ln 2.5 + 0.3 ln 1 + 0.2 ln 0.4 = 0.3 ln 2.5 = 0.274887; dKL/dtheta_j = pi_j (ln(pi_j / t_j) - KL):
    # 0.5 (0.916291 - 0.274887) = 0.320702, 0.3 (0 - 0.274887) = -0.082466, 0.2 (-0.916291 - 0.274887) = -0.238236
    assert g.tolist() == pytest.approx([0.320702, -0.082466, -0.238236], abs=1e-6)
    assert float(expected.detach()) == pytest.approx(0.3 * math.log(2.5), abs=1e-12)  # the value: the KL itself
    # the same expectation of K1 as a loss: sum_y pi_y grad l_y = grad sum_y pi_y = 0
    logp = torch.log_softmax(theta, -1)
    (g1,) = torch.autograd.grad(sum(pi[y] * k1(logp[y], teacher[y]) for y in range(3)), theta)
    assert g1.abs().max() < 1e-12


def test_the_distill_rule_swaps_only_k1_and_the_registry_agrees():
    assert distill_estimator("k1") == "k4"
    for name in ("k2", "k3", "k3pp", "k4", "topk", "topk_mass", "topk_paper", "truncated", "exact"):
        assert distill_estimator(name) == name
    l = torch.tensor([-0.7, -1.6], requires_grad=True)
    l_t = torch.tensor([-1.4, -0.9])
    via_registry = kl_per_token(distill_estimator("k1"), "reverse", logp=l, ref_logp=l_t)
    assert torch.equal(via_registry, k4(l, l_t))


def test_tail_mass_by_hand():
    # the student holds 0.5 + 0.3 of its mass on q: 0.2 is outside; a q holding everything leaves 0 (not -1e-8)
    logp_q = torch.log(torch.tensor([[0.5, 0.3], [0.6, 0.4]]))
    assert tail_mass(logp_q).tolist() == pytest.approx([0.2, 0.0], abs=1e-6)
    assert (tail_mass(logp_q) >= 0).all()


def test_objective_config_rules():
    from pydantic import ValidationError

    from emapg_cli.config.models import Config
    from emapg_cli.train.settings import policy_loss

    assert Config().train.objective == "rl"
    rl = policy_loss(Config.model_validate({"kl": {"estimator": "k1", "coef": 0.1}}))
    assert rl.estimator == "k1" and not rl.distill  # rl keeps k1 as it was (bit-identical)
    both = policy_loss(Config.model_validate({"train": {"objective": "rl+distill"}, "kl": {"estimator": "k1", "coef": 0.1}}))
    assert both.estimator == "k4" and both.distill
    with pytest.raises(ValidationError, match="train.objective=distill needs kl.coef > 0"):
        Config.model_validate({"train": {"objective": "distill"}, "kl": {"coef": 0}})
    with pytest.raises(ValidationError):
        Config.model_validate({"train": {"objective": "sft"}})


def test_a_distill_run_calls_no_verifier_and_records_the_teacher(tiny_llama, tmp_path):
    """2 steps of train.objective=distill with the `test_nan` reward: had the verifier been called, every reward and
    advantage would be NaN and every optimizer step skipped (steps/skipped > 0). The anchor is the frozen EMA copy
    (ema.decay=1), whose accuracy at step 0 is the policy's: teacher_accuracy == eval_accuracy_initial.
    (With a teacher as the anchor, anchor.source=teacher, the same run distils toward it: docs/distill.md.)"""
    from train_helpers import run, tiny_overrides, train_cmd, write_dataset

    data = write_dataset(tmp_path / "d.jsonl")
    opts = tiny_overrides(tiny_llama, data, steps=2, **{"train.objective": "distill", "rollout.reward": "test_nan",
                                                        "ema.decay": 1.0, "eval.anchor_every": 0, "train.save_every": 0,
                                                        "optim.weight_decay": 0.0, "kl.estimator": "k1"})
    proc = run(train_cmd(*opts, "--out", str(tmp_path / "run")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["teacher_accuracy"] == summary["eval_accuracy_initial"]
    assert summary["steps_skipped"] == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0 and "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["reward/mean"] == 0.0 and r["loss/pg"] == 0.0  # no reward, no advantage, no policy-gradient term
        # the teacher is the (frozen) starting policy: k1 trained in its score-function form (K4) has the gradient
        # sg(l - l_T) grad l = 0 at every token, so nothing moves and the KL stays 0 (k1's own gradient, grad l, is not 0)
        assert r["distill/kl"] == 0.0 and r["grad/norm"] == 0.0
        assert r["distill/entropy"] == r["entropy"] and "distill/tail_mass" not in r  # k1 reads no top-k set


def test_prepare_toy_distill_snapshots_the_student_and_trains_on_to_the_teacher(tmp_path, monkeypatch, one_torch_thread):
    """One tiny supervised run with scripted dev accuracies (checks every 2 steps, smoothed over 1 check):
    step 2: 0.0, step 4: 0.4 >= 0.3 -> the student is the model after step 4; then teacher checks every 2 steps:
    step 6: 0.5, step 8: 0.9 >= 0.85 -> stop, the teacher is the model after step 8. The last two calls are the
    greedy test accuracies (student 0.25, teacher 0.8)."""
    from transformers import AutoTokenizer

    from emapg_cli.tasks.toy import prepare as toy_prepare
    from emapg_cli.tasks.toy_distill import prepare as distill_prepare
    from emapg_cli.tasks.toy.sft import SFTConfig
    from train_helpers import load_weights

    for name, value in (("N_TRAIN", 300), ("N_TEST", 40), ("N_DEV", 20)):
        monkeypatch.setattr(distill_prepare, name, value)
        monkeypatch.setattr(toy_prepare, name, value)
    monkeypatch.setattr(distill_prepare, "TEACHER_CHECK_EVERY", 2)
    scripted = iter([0.0, 0.4, 0.5, 0.9, 0.25, 0.8])
    monkeypatch.setattr(distill_prepare, "greedy_accuracy", lambda *a, **k: next(scripted))
    cfg = SFTConfig(hidden=32, layers=1, heads=2, kv_heads=1, batch_size=8, warmup=1, lr=1e-2, max_steps=20,
                    check_every=2, fine_every=1, fine_from=0.5, smooth=1, target_accuracy=0.3)
    lines: list[str] = []
    m = distill_prepare.prepare_toy_distill(tmp_path, seed=1, say=lines.append, sft=cfg)
    out = tmp_path / "toy-distill"
    assert json.loads((out / "manifest.json").read_text()) == m
    assert (m["student_steps"], m["teacher_steps"]) == (4, 8)
    assert (m["student_test_accuracy"], m["teacher_test_accuracy"]) == (0.25, 0.8)
    student, teacher = load_weights(out / "student"), load_weights(out / "teacher")
    assert student.keys() == teacher.keys() and any(not torch.equal(student[k], teacher[k]) for k in student)
    a, b = AutoTokenizer.from_pretrained(out / "student"), AutoTokenizer.from_pretrained(out / "teacher")
    assert a.get_vocab() == b.get_vocab()
    assert any(line.startswith("student: step 4") for line in lines)
