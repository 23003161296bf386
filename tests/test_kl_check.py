"""kl-check: statistics helpers, the Monte-Carlo gradient algebra against brute-force autograd,
the closed-form expectations, and the CLI end to end (acceptance cases, bad input, a tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from emapg_cli.kl import importance_weight, kl_per_token, topk_membership
from emapg_cli.klcheck.evaluate import Spec, topk_set
from emapg_cli.klcheck.expectation import expected
from emapg_cli.klcheck.montecarlo import draw_tokens, gradient_variance, mean_gradient, projections, sample_gradients
from emapg_cli.klcheck.stats import t_test
from emapg_cli.stats import student_t_two_sided_p


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "emapg_cli", "kl-check", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


# ---- statistics ----

@pytest.mark.parametrize("t,df,p", [
    (12.706, 1, 0.05), (4.303, 2, 0.05), (2.776, 4, 0.05), (2.131, 15, 0.05),  # two-sided 5% critical values
    (4.073, 15, 0.001), (0.0, 7, 1.0),                                         # 0.1% critical value at df = 15
])
def test_student_t_p_values_match_tables(t, df, p):
    # printed tables give 3 decimals of t, hence the 1e-3 relative tolerance on p
    assert student_t_two_sided_p(t, df) == pytest.approx(p, rel=1e-3)


def test_t_test_deterministic_branch():
    # identical batch statistics: no spread, so the verdict is |mean| > atol
    assert t_test(torch.full((16,), 0.5), atol=1e-9).p == 0.0
    assert t_test(torch.full((16,), 1e-12), atol=1e-9).p == 1.0


# ---- Monte-Carlo gradient algebra vs brute force ----

def brute_force_gradients(spec, z, z_ref, z_s, tokens, q):
    """Per-sample gradient g_i [P, N, V] by autograd of each sample's estimate w.r.t. the logits."""
    p_count, n = tokens.shape
    out = torch.zeros(p_count, n, z.shape[1], dtype=torch.float64)
    for p in range(p_count):
        for i in range(n):
            zz = z[p].clone().requires_grad_()
            logp, ref_logp = torch.log_softmax(zz, -1), torch.log_softmax(z_ref[p], -1)
            t = tokens[p, i]
            iw = None if z_s is None else importance_weight(logp[t], torch.log_softmax(z_s[p], -1)[t])
            kw = {}
            if q is not None:
                kw = dict(logp_q=logp[q[p]], ref_logp_q=ref_logp[q[p]], in_q=topk_membership(q[p], t))
            v = kl_per_token(spec.name, spec.direction, logp=logp[t], ref_logp=ref_logp[t], iw=iw, **kw)
            (out[p, i],) = torch.autograd.grad(v, zz)
    return out


@pytest.mark.parametrize("spec,off_policy", [
    (Spec("k3", "reverse"), False), (Spec("k5", "forward"), True),
    (Spec("topk", "reverse", 2), True), (Spec("topk_paper", "forward", 2), False), (Spec("truncated", "reverse", 2), False),
    (Spec("topk_tail", "forward", 2), False), (Spec("topk_tail_sc", "reverse", 2), True), (Spec("topk_resid", "reverse", 2), True),
    (Spec("teacher_support", "reverse", 2), False),
])
def test_montecarlo_gradients_match_brute_force(spec, off_policy):
    g = torch.Generator().manual_seed(3)
    z, z_ref = torch.randn(2, 6, generator=g, dtype=torch.float64), torch.randn(2, 6, generator=g, dtype=torch.float64)
    z_s = torch.randn(2, 6, generator=g, dtype=torch.float64) if off_policy else None
    tokens = draw_tokens(z if z_s is None else z_s, 24, g)  # [2, 24]
    q = topk_set(spec.direction, spec.k, z, z_ref, z_s) if spec.k else None
    logp, ref_logp = torch.log_softmax(z, -1), torch.log_softmax(z_ref, -1)
    s_logp = None if z_s is None else torch.log_softmax(z_s, -1)
    sg = sample_gradients(spec, tokens, logp, ref_logp, s_logp, q)
    pi = logp.exp()
    brute = brute_force_gradients(spec, z, z_ref, z_s, tokens, q)  # [P, N, V]
    torch.testing.assert_close(mean_gradient(sg, pi), brute.mean(1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mean_gradient(sg, pi, slice(0, 10)), brute[:, :10].mean(1), rtol=1e-10, atol=1e-12)
    dev = brute - brute.mean(1, keepdim=True)
    torch.testing.assert_close(gradient_variance(sg, pi), (dev**2).sum(-1).sum(1) / 23, rtol=1e-9, atol=1e-12)
    u = torch.randn(2, 6, generator=g, dtype=torch.float64)
    torch.testing.assert_close(projections(sg, pi, u), (brute * u[:, None, :]).sum(-1), rtol=1e-10, atol=1e-12)


def test_expected_topk_paper_bias_is_grad_head_mass():
    # V = 3 example of tests/test_kl_estimators.py: q = {0}, grad P(q) = [0.25, -0.15, -0.10]
    z = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    z_ref = torch.log(torch.tensor([[0.25, 0.25, 0.5]], dtype=torch.float64))
    q = topk_set("reverse", 1, z, z_ref, None)
    _, g_paper = expected(Spec("topk_paper", "reverse", 1), z, z_ref, None, q)
    _, g_exact = expected(Spec("exact", "reverse"), z, z_ref, None, None)
    torch.testing.assert_close(g_paper - g_exact, torch.tensor([[0.25, -0.15, -0.10]], dtype=torch.float64))


# ---- acceptance: --from-logits on new distributions ----

def independent_kl(policy: np.ndarray, anchor: np.ndarray) -> tuple[float, float]:
    """Mean reverse and forward KL over positions, plain numpy (no emapg code)."""
    def log_softmax(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    lp, lr = log_softmax(policy.astype(np.float64)), log_softmax(anchor.astype(np.float64))
    p, r = np.exp(lp), np.exp(lr)
    return float((p * (lp - lr)).sum(1).mean()), float((r * (lr - lp)).sum(1).mean())


def acceptance_cases(rng):
    pv = (6, 40)
    policy = 2 * rng.standard_normal(pv)
    anchor = policy + 0.7 * rng.standard_normal(pv)
    support = np.full(pv, -1000.0)  # exp(-1000) underflows to exactly 0 in float64
    for p in range(pv[0]):
        support[p, rng.choice(pv[1], 5, replace=False)] = rng.standard_normal(5)
    small = rng.standard_normal((6, 12))
    return {
        "generic": (dict(policy=policy, anchor=anchor), "1,4,8"),
        "off_policy": (dict(policy=policy, anchor=anchor, sampling=policy + 0.5 * rng.standard_normal(pv)), "1,4,8"),
        "support_in_topk": (dict(policy=support, anchor=rng.standard_normal(pv)), "1,4,8"),  # top-8 holds the 5-token support
        "k_equals_vocab": (dict(policy=small.astype(np.float32), anchor=(small + rng.standard_normal((6, 12))).astype(np.float32)), "12,20"),
    }


@pytest.mark.parametrize("case", ["generic", "off_policy", "support_in_topk", "k_equals_vocab"])
def test_acceptance_from_logits(case, tmp_path):
    arrays, ks = acceptance_cases(np.random.default_rng(1))[case]
    np.savez(tmp_path / "d.npz", **arrays)
    extra = ["--plot", str(tmp_path / "p.png")] if case == "generic" else []
    res = run_cli("--from-logits", str(tmp_path / "d.npz"), "--samples", "2048", "--k", ks, "--seed", "0",
                  "--json", str(tmp_path / "r.json"), *extra)
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "r.json").read_text())
    rev, fwd = independent_kl(arrays["policy"], arrays["anchor"])
    for row in out["rows"]:
        assert row["exact_kl"] == pytest.approx(rev if row["direction"] == "reverse" else fwd, rel=1e-4)
        # every verdict (a test at 99.9% confidence, fixed seed) agrees with the closed form on this data
        assert row["value_biased"] == row["value_expected_biased"], row
        assert row["grad_biased"] == row["grad_expected_biased"], row
        assert row["value_consistent"] and row["grad_consistent"], row
    rows = {(r["estimator"], r["direction"], r["k"]): r for r in out["rows"]}
    # 8 k-independent rows (exact x2, k1..k5) + 4 Top-k-family estimators x 2 directions x each distinct k
    assert len(rows) == 8 + 4 * 2 * len(set(min(int(k), 40 if case != "k_equals_vocab" else 12) for k in ks.split(",")))
    if case == "generic":  # the claims of Table 1, visibly
        assert (tmp_path / "p.png").stat().st_size > 10_000
        assert rows[("k1", "reverse", None)]["grad_biased"] and rows[("k3", "reverse", None)]["grad_biased"]
        assert rows[("k2", "reverse", None)]["value_biased"] and not rows[("k4", "reverse", None)]["grad_biased"]
        for k in (1, 4, 8):
            for d in ("reverse", "forward"):
                assert rows[("topk_paper", d, k)]["grad_biased"] and not rows[("topk", d, k)]["grad_biased"]
                assert rows[("truncated", d, k)]["value_biased"]
    if case == "off_policy":
        assert out["off_policy"] and not rows[("topk", "reverse", 8)]["grad_biased"]
    if case == "support_in_topk":  # q holds all the policy's mass: nothing is sampled outside it
        for name in ("topk", "topk_paper", "truncated"):
            r = rows[(name, "reverse", 8)]
            assert not (r["value_biased"] or r["grad_biased"]) and r["grad_variance"] == 0.0
    if case == "k_equals_vocab":
        assert out["notes"] == ["k=20 exceeds |V|=12; measured as k=12"] and "k=20 exceeds" in res.stdout
        for (name, _, k), r in rows.items():
            if k is not None:
                assert r["grad_bias_test"]["deterministic"]  # nothing sampled outside q = V
                assert abs(r["value_bias"]) < 1e-12 and r["grad_bias_rel"] < 1e-9


# ---- bad input: one clear line, exit code 2 ----

BAD_INPUT = {
    "missing": "missing array 'anchor'",
    "shape": "has shape (3, 5) but 'policy' has (3, 4)",
    "nan": "array 'policy' contains NaN",
    "samples": "--samples must be at least 4",
    "unreadable": "cannot read",
}


def bad_input_args(case: str, tmp_path) -> list[str]:
    f = tmp_path / "d.npz"
    good = np.zeros((3, 4))
    if case == "missing":
        np.savez(f, policy=good)
    elif case == "shape":
        np.savez(f, policy=good, anchor=np.zeros((3, 5)))
    elif case == "nan":
        bad = good.copy()
        bad[1, 2] = np.nan
        np.savez(f, policy=bad, anchor=good)
    elif case == "samples":
        np.savez(f, policy=good, anchor=good)
    else:
        f.write_bytes(b"not a zip file")
    return ["--from-logits", str(f), *(["--samples", "0"] if case == "samples" else [])]


def assert_one_error_line(stderr: str, needle: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], stderr
    assert "Traceback" not in stderr


def test_bad_input_subprocess():
    """The real console entry point in a fresh interpreter: exit code 2, one line on stderr."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        res = run_cli(*bad_input_args("nan", Path(d)))
    assert res.returncode == 2
    assert_one_error_line(res.stderr, BAD_INPUT["nan"])


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_exits_2_with_one_line(case, tmp_path, monkeypatch, capsys):
    """Every bad-input case through `main()` in-process (same code path as the console script,
    without paying an interpreter start per case)."""
    from emapg_cli.cli.app import main

    monkeypatch.setattr(sys, "argv", ["emapg", "kl-check", *bad_input_args(case, tmp_path)])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    assert_one_error_line(capsys.readouterr().err, BAD_INPUT[case])


# ---- --model on a tiny local Qwen2 ----

def test_model_source(tmp_path):
    from emapg_cli.klcheck.model_source import logits_from_model
    from emapg_cli.models.tiny import save_tiny

    policy_dir, anchor_dir = save_tiny(tmp_path / "policy", seed=0), save_tiny(tmp_path / "anchor", seed=1)
    perturbed = logits_from_model(str(policy_dir), None, "Hello world, this is text.", 4, 0.05, 0)
    assert perturbed.policy.shape == (4, 259) and perturbed.policy.dtype == torch.float64
    assert 0 < float(kl_per_token("exact", "reverse", logits=perturbed.policy, ref_logits=perturbed.anchor).mean()) < 1
    # "Hi" is 2 byte tokens: asking for 4 positions measures 2, and the source name says so
    short = logits_from_model(str(policy_dir), None, "Hi", 4, 0.05, 0)
    assert short.policy.shape == (2, 259) and "only 2 positions" in short.source
    res = run_cli("--model", str(policy_dir), "--anchor-model", str(anchor_dir), "--positions", "6", "--samples", "256",
                  "--k", "4", "--estimators", "exact,k3,topk", "--json", str(tmp_path / "r.json"))
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["positions"] == 6 and out["vocab"] == 259 and len(out["rows"]) == 2 + 1 + 2
    assert all(r["exact_kl"] > 0 and r["grad_consistent"] for r in out["rows"])


def test_model_that_is_no_local_folder_is_refused_before_any_hub_lookup(tmp_path, monkeypatch):
    # kl-check reads local folders only; the tokenizer used to be loaded first, so a hub-style name (or a typo)
    # went to the hub: without network, 2 x 5 retries (1+2+4+8+8 s each) before the one-line error
    import transformers

    from emapg_cli.errors import UserError
    from emapg_cli.klcheck.model_source import logits_from_model

    def no_hub(*args, **kwargs):
        raise AssertionError("AutoTokenizer.from_pretrained was called")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    with pytest.raises(UserError, match="missing-model: not a local model directory"):
        logits_from_model("missing-model", None, None, 4, 0.05, 0)
    # a folder for the policy (a config.json: every model folder is checked for one), a hub id for the anchor:
    # refused before the policy's tokenizer loads
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UserError, match="org/anchor: not a local model directory"):
        logits_from_model(str(tmp_path), "org/anchor", None, 4, 0.05, 0)


@pytest.mark.slow
def test_default_run_within_60_seconds(tmp_path):
    # the speed target: |V| = 32000, 64 positions, 4096 samples, k in {1, 8, 32} in <= 60 s on 2 cores
    start = time.monotonic()
    res = run_cli("--json", str(tmp_path / "r.json"), timeout=300)
    elapsed = time.monotonic() - start
    assert res.returncode == 0, res.stderr
    assert elapsed <= 60, f"default kl-check run took {elapsed:.1f} s (load average {os.getloadavg()})"


def test_stability_is_wired(tmp_path):
    # the simulation itself is tested with its own module; here: the options reach run_stability
    res = run_cli("--stability", "--alphas", "0.1,10", "--etas", "0.5", "--period", "10", "--beta", "5", "--tau", "0.5",
                  "--steps", "200", "--json", str(tmp_path / "s.json"))
    assert res.returncode == 0, res.stderr
    (run,) = json.loads((tmp_path / "s.json").read_text())["stability"]
    assert run["alphas"] == [0.1, 10.0] and run["etas"] == [0.5] and run["period"] == 10 and run["steps"] == 200
