"""The on-policy-distillation estimators of emapg_cli/kl/tail.py (docs/distill.md, "Estimators"):
hand-computed values, exact expectations by enumeration (no Monte Carlo), and kl-check's --topk-from.

Running example (V = 4, k = 2): pi = [0.4, 0.3, 0.2, 0.1] (policy), rho = [0.2, 0.4, 0.3, 0.1] (anchor).
  KL_rev = 0.4 ln 2 + 0.3 ln 0.75 + 0.2 ln(2/3) + 0.1 ln 1 = 0.277259 - 0.086305 - 0.081093 + 0 = 0.109861
  KL_fwd = 0.2 ln 0.5 + 0.4 ln(4/3) + 0.3 ln 1.5 + 0.1 ln 1 = -0.138629 + 0.115073 + 0.121640 = 0.098083
  q from the policy (top-2 of pi) = {0, 1}: P = 0.7, A = 0.6, tails P_t = 0.3, A_t = 0.4
  q from the anchor (top-2 of rho) = {1, 2}: P = 0.5, A = 0.7, tails P_t = 0.5, A_t = 0.3
"""

from __future__ import annotations

import math

import pytest
import torch

from emapg_cli.kl import importance_weight, kl_per_token, topk_membership, topk_source

PI = [0.4, 0.3, 0.2, 0.1]
RHO = [0.2, 0.4, 0.3, 0.1]
KL_REV = 0.10986122886681092
KL_FWD = 0.09808292530117263
Q_POLICY = [0, 1]
Q_ANCHOR = [1, 2]
TAIL_ESTIMATORS = ["topk_tail", "topk_tail_sc", "topk_resid", "teacher_support", "teacher_support_raw"]
UNBIASED = ["topk_tail_sc", "topk_resid"]


def logits_of(probs) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float64)


def value_at(name, direction, z, z_ref, q, p, z_s=None):
    """(value, gradient w.r.t. z) of one estimate with token p as the sample and the set q."""
    z = z.clone().requires_grad_()
    logp, ref_logp = torch.log_softmax(z, -1), torch.log_softmax(z_ref, -1)
    q = torch.tensor(q)
    iw = None if z_s is None else importance_weight(logp[p], torch.log_softmax(z_s, -1)[p])
    v = kl_per_token(name, direction, logp=logp[p], ref_logp=ref_logp[p], iw=iw, logp_q=logp[q], ref_logp_q=ref_logp[q],
                     in_q=topk_membership(q, torch.tensor(p)))
    (g,) = torch.autograd.grad(v, z)
    return float(v.detach()), g


def enumerate_expectation(name, direction, z, z_ref, q, z_s=None):
    """Exact E[v] and E[grad v] under p ~ pi_s: sum_p pi_s(p) v(p) (pi_s = softmax z_s, or pi)."""
    pi_s = torch.softmax(z if z_s is None else z_s, -1)
    ev, eg = 0.0, torch.zeros_like(z)
    for p in range(z.shape[-1]):
        v, g = value_at(name, direction, z, z_ref, q, p, z_s)
        ev, eg = ev + float(pi_s[p]) * v, eg + pi_s[p] * g
    return ev, eg


def exact(direction, z, z_ref):
    z = z.clone().requires_grad_()
    v = kl_per_token("exact", direction, logits=z, ref_logits=z_ref)
    (g,) = torch.autograd.grad(v, z)
    return float(v.detach()), g


# ---- hand-computed values ----

@pytest.mark.parametrize("direction,q,expected", [
    # reverse, q = {0, 1}: H_q = 0.4 ln(0.4/0.2) + 0.3 ln(0.3/0.4) = 0.277259 - 0.086305 = 0.190954;
    # tail token 0.3 ln(0.3/0.4) = -0.086305; total 0.104650 <= KL_rev = 0.109861
    ("reverse", Q_POLICY, 0.10464962875290956),
    # reverse, q = {1, 2}: H_q = 0.3 ln 0.75 + 0.2 ln(2/3) = -0.086305 - 0.081093 = -0.167398;
    # tail token 0.5 ln(0.5/0.3) = 0.255413; total 0.088015 <= 0.109861
    ("reverse", Q_ANCHOR, 0.08801516852582819),
    # forward, q = {1, 2}: H^f_q = 0.4 ln(0.4/0.3) + 0.3 ln(0.3/0.2) = 0.115073 + 0.121640 = 0.236712;
    # tail token A_t ln(A_t/P_t) = 0.3 ln(0.3/0.5) = -0.153248; total 0.083465 <= KL_fwd = 0.098083
    ("forward", Q_ANCHOR, 0.08346467428336443),
])
def test_tail_token_value_by_hand(direction, q, expected):
    for p in range(4):  # deterministic: the same value whichever token is the sample
        v, _ = value_at("topk_tail", direction, logits_of(PI), logits_of(RHO), q, p)
        assert v == pytest.approx(expected, abs=1e-12)
    assert expected <= (KL_REV if direction == "reverse" else KL_FWD)


def test_tail_sc_values_by_hand():
    # q = {0, 1}: topk_tail = 0.104650, L = ln(P_t/A_t) = ln(0.3/0.4) = -0.287682
    # p = 2 (not in q): + (l - l_ref - L) = ln(0.2/0.3) + 0.287682 = -0.405465 + 0.287682 = -0.117783 -> -0.013133
    # p = 3: + (ln 1 + 0.287682) -> 0.392332; p in q: 0.104650
    # E = 0.7 x 0.104650 + 0.2 x (-0.013133) + 0.1 x 0.392332 = 0.073255 - 0.002627 + 0.039233 = 0.109861 = KL_rev
    z, z_ref = logits_of(PI), logits_of(RHO)
    expected = [0.10464962875290956, 0.10464962875290956, -0.013133406903473976, 0.39233170120469046]
    for p, e in enumerate(expected):
        assert value_at("topk_tail_sc", "reverse", z, z_ref, Q_POLICY, p)[0] == pytest.approx(e, abs=1e-12)
    assert sum(pi * e for pi, e in zip(PI, expected)) == pytest.approx(KL_REV, abs=1e-12)


def test_teacher_support_values_by_hand():
    # q = the anchor's top-2 = {1, 2}: pi_q = [0.3, 0.2] (P = 0.5), rho_q = [0.4, 0.3] (A = 0.7)
    # raw: 0.3 ln(0.3/0.4) + 0.2 ln(0.2/0.3) = -0.086305 - 0.081093 = -0.167398 (= truncated)
    # renormalised: pi_q/P = [0.6, 0.4], rho_q/A = [4/7, 3/7]:
    #   0.6 ln(0.6 x 7/4) + 0.4 ln(0.4 x 7/3) = 0.6 ln 1.05 + 0.4 ln(14/15) = 0.029274 - 0.027597 = 0.001677
    #   = H_q / P - ln(P / A) = -0.334795 + 0.336472
    z, z_ref = logits_of(PI), logits_of(RHO)
    for p in range(4):
        assert value_at("teacher_support_raw", "reverse", z, z_ref, Q_ANCHOR, p)[0] == pytest.approx(-0.16739764335716717, abs=1e-12)
        assert value_at("teacher_support", "reverse", z, z_ref, Q_ANCHOR, p)[0] == pytest.approx(0.0016769499068785554, abs=1e-12)
    raw, g_raw = value_at("teacher_support_raw", "reverse", z, z_ref, Q_ANCHOR, 0)
    trunc, g_trunc = value_at("truncated", "reverse", z, z_ref, Q_ANCHOR, 0)
    assert raw == trunc and torch.equal(g_raw, g_trunc)
    # renormalised, only the shape on q matters: pi = [0.1, 0.48, 0.32, 0.1] has P = 0.8 and the same 3:2 on q
    assert value_at("teacher_support", "reverse", logits_of([0.1, 0.48, 0.32, 0.1]), z_ref, Q_ANCHOR, 0)[0] == \
        pytest.approx(0.0016769499068785554, abs=1e-12)


# ---- value <= exact KL (TA-OPD's sign), exact expectations by enumeration ----

@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_tail_token_never_exceeds_the_exact_kl(direction):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        z, z_ref = 2 * torch.randn(7, generator=g, dtype=torch.float64), 2 * torch.randn(7, generator=g, dtype=torch.float64)
        kl, _ = exact(direction, z, z_ref)
        for k in range(1, 8):
            for src in (z, z_ref):
                q = torch.topk(src, k).indices.tolist()
                v, _ = value_at("topk_tail", direction, z, z_ref, q, 0)
                assert v <= kl + 1e-12, (k, v, kl)
                if k == 7:
                    assert v == pytest.approx(kl, abs=1e-12)  # no tail: the exact KL


@pytest.mark.parametrize("name", UNBIASED)
@pytest.mark.parametrize("q", [[0], Q_POLICY, Q_ANCHOR, [0, 1, 2]])
@pytest.mark.parametrize("off_policy", [False, True])
def test_sample_corrected_and_resid_are_unbiased_in_value_and_gradient(name, q, off_policy):
    z, z_ref = logits_of(PI), logits_of(RHO)
    z_s = logits_of([0.1, 0.2, 0.3, 0.4]) if off_policy else None
    ev, eg = enumerate_expectation(name, "reverse", z, z_ref, q, z_s)
    kl, grad = exact("reverse", z, z_ref)
    assert ev == pytest.approx(kl, abs=1e-12)
    torch.testing.assert_close(eg, grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["topk_tail", "teacher_support", "teacher_support_raw"])
def test_deterministic_ones_are_biased_in_gradient(name):
    # q = {0, 1}: the coarsened / truncated KL's gradient differs from grad KL_rev (they target another KL)
    ev, eg = enumerate_expectation(name, "reverse", logits_of(PI), logits_of(RHO), Q_POLICY)
    _, grad = exact("reverse", logits_of(PI), logits_of(RHO))
    assert (eg - grad).norm() > 1e-3


def test_resid_keeps_topk_mass_values_and_shares_tail_sc_gradients():
    # resid = topk_mass - sg(L) [s 1[p not in q](r - 1) - (P_t - sg P_t)]: value topk_mass's for every sample;
    # per-sample gradient grad H_q + (1 + L) grad P_t + s 1[p not in q](l - l_ref - L) grad l = topk_tail_sc's
    z, z_ref = logits_of(PI), logits_of(RHO)
    for p in range(4):
        v_r, g_r = value_at("topk_resid", "reverse", z, z_ref, Q_POLICY, p)
        v_m, _ = value_at("topk_mass", "reverse", z, z_ref, Q_POLICY, p)
        _, g_sc = value_at("topk_tail_sc", "reverse", z, z_ref, Q_POLICY, p)
        assert v_r == pytest.approx(v_m, abs=1e-14)
        torch.testing.assert_close(g_r, g_sc, rtol=0, atol=1e-14)


def per_sample_variance(name, q):
    """Exact trace of the per-sample gradient covariance, sum_p pi(p) ||g_p - E g||^2 (kl-check's grad var)."""
    z, z_ref = logits_of(PI), logits_of(RHO)
    gs = torch.stack([value_at(name, "reverse", z, z_ref, q, p)[1] for p in range(4)])  # [V, V]
    pi = torch.tensor(PI, dtype=torch.float64)
    mean = (pi[:, None] * gs).sum(0)
    return float((pi * ((gs - mean) ** 2).sum(-1)).sum())


def test_resid_gradient_variance_on_the_example():
    # measured, not a theorem: on this example the tail baseline L lowers the variance below topk_mass's,
    # topk's and the sampled-token OPD gradient's (k4: (l - l_ref) grad l)
    var = {n: per_sample_variance(n, Q_POLICY) for n in ("topk_resid", "topk_mass", "topk")}
    var["k4"] = per_sample_variance("k4", Q_POLICY)
    assert var["topk_resid"] < var["topk_mass"] < var["topk"] and var["topk_resid"] < var["k4"], var


@pytest.mark.parametrize("name", TAIL_ESTIMATORS)
def test_k_equal_vocab_is_exact_for_every_sample(name):
    # q = V: no tail (the tail masses fall below the floor and the tail token is exactly 0), P = A = 1
    torch.manual_seed(0)
    z, z_ref = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    kl, grad = exact("reverse", z, z_ref)
    for p in range(5):
        v, g = value_at(name, "reverse", z, z_ref, list(range(5)), p)
        assert v == pytest.approx(kl, abs=1e-12)
        torch.testing.assert_close(g, grad, rtol=0, atol=1e-12)


# ---- numerics of the tail ----

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_tiny_and_empty_tails_stay_finite(dtype):
    # tail masses of 1e-30 (policy) and 0 (anchor, exp(-1000)) next to a 2-token head: finite values and gradients
    z = torch.tensor([[0.0, 0.0, -70.0, -70.0], [0.0, 1.0, -1000.0, -1000.0], [0.0, 0.5, 1.0, 2.0]], dtype=dtype)
    z_ref = torch.tensor([[0.0, 0.3, -1000.0, -1000.0], [0.0, 0.2, 0.0, -3.0], [1.0, 0.0, 0.5, 0.0]], dtype=dtype)
    q = torch.tensor([[0, 1]] * 3)
    tokens = torch.tensor([2, 3, 0])
    for name in TAIL_ESTIMATORS:
        zz = z.clone().requires_grad_()
        logp, ref_logp = torch.log_softmax(zz.float(), -1), torch.log_softmax(z_ref.float(), -1)
        v = kl_per_token(name, "reverse", logp=logp.gather(-1, tokens[:, None])[:, 0], ref_logp=ref_logp.gather(-1, tokens[:, None])[:, 0],
                         logp_q=logp.gather(-1, q), ref_logp_q=ref_logp.gather(-1, q), in_q=topk_membership(q, tokens))
        (g,) = torch.autograd.grad(v.sum(), zz)
        assert torch.isfinite(v).all() and torch.isfinite(g).all(), (name, v, g)


def test_stable_tail_mass_matches_direct_formula():
    from emapg_cli.kl.tail import log_tail_mass

    # small tail (lse > -ln 2) and large tail (lse < -ln 2): log(1 - P) for P = 0.999999 and P = 0.01
    lp = torch.log(torch.tensor([[0.5, 0.499999], [0.006, 0.004]], dtype=torch.float64))
    log_t, empty = log_tail_mass(lp)
    torch.testing.assert_close(log_t, torch.log(torch.tensor([1e-6, 0.99], dtype=torch.float64)), rtol=1e-9, atol=0)
    assert not empty.any()
    # P = 1 exactly (and 1 + rounding): empty, log = log(floor) finite
    log_t, empty = log_tail_mass(torch.log(torch.tensor([[0.5, 0.5], [0.7, 0.3 + 1e-16]], dtype=torch.float64)))
    assert empty.all() and torch.isfinite(log_t).all()


# ---- where q comes from ----

def test_topk_source_override():
    assert topk_source("reverse") == "sampling" and topk_source("forward") == "anchor"  # today's rule
    assert topk_source("reverse", None) == "sampling"
    assert topk_source("reverse", "anchor") == "anchor" and topk_source("forward", "sampling") == "sampling"
    with pytest.raises(ValueError, match="sampling, anchor"):
        topk_source("reverse", "teacher")


def test_topk_set_follows_topk_from():
    from emapg_cli.klcheck.evaluate import topk_set

    z, z_ref = logits_of(PI)[None], logits_of(RHO)[None]
    assert sorted(topk_set("reverse", 2, z, z_ref, None)[0].tolist()) == Q_POLICY
    assert sorted(topk_set("reverse", 2, z, z_ref, None, "anchor")[0].tolist()) == Q_ANCHOR
    assert sorted(topk_set("forward", 2, z, z_ref, None)[0].tolist()) == Q_ANCHOR
    assert sorted(topk_set("forward", 2, z, z_ref, None, "sampling")[0].tolist()) == Q_POLICY


# ---- kl-check: the new rows with q from the anchor ----

def assert_verdicts_agree(result):
    for r in result.rows:  # every test (99.9% confidence, fixed seed) agrees with the closed form
        assert r.value_biased == r.value_expected_biased and r.grad_biased == r.grad_expected_biased, r
        assert r.value_consistent and r.grad_consistent, r


def test_kl_check_rows_with_q_from_the_anchor():
    """In-process run_check on random logits: every new row's verdicts agree with its closed form, the tail
    token's value is below the exact KL (TA-OPD's sign) and topk_tail_sc / topk_resid are unbiased."""
    from emapg_cli.klcheck.distributions import LogitSet
    from emapg_cli.klcheck.measure import CheckSettings, run_check

    g = torch.Generator().manual_seed(1)
    policy = 2 * torch.randn(6, 40, generator=g, dtype=torch.float64)
    logits = LogitSet(policy, policy + 0.7 * torch.randn(6, 40, generator=g, dtype=torch.float64))
    settings = CheckSettings(ks=(1, 4), samples=1024, estimators=("k1", "k4", "topk_mass", *TAIL_ESTIMATORS),
                             directions=("reverse",), topk_from="anchor")
    result = run_check(logits, settings)
    assert result.notes == [] and result.to_dict()["settings"]["topk_from"] == "anchor"
    assert_verdicts_agree(result)
    rows = {(r.spec.name, r.spec.k): r for r in result.rows}
    for k in (1, 4):
        assert rows[("topk_tail", k)].value_bias_expected < 0 and rows[("topk_tail", k)].value_bias.mean < 0
        for name in UNBIASED:
            assert not rows[(name, k)].value_biased and not rows[(name, k)].grad_biased
        assert rows[("topk_resid", k)].grad_variance < rows[("k4", None)].grad_variance
    # q from the anchor differs from the default (the policy's top-k for the reverse KL)
    default = run_check(logits, CheckSettings(ks=(4,), samples=64, batches=4, estimators=("teacher_support",),
                                              directions=("reverse",)))
    assert default.notes and default.notes[0].startswith("teacher_support: q is the sampling policy's top-k")
    assert default.rows[0].exact_kl == rows[("teacher_support", 4)].exact_kl
    assert default.rows[0].mean_estimate != rows[("teacher_support", 4)].mean_estimate


@pytest.mark.parametrize("case", ["off_policy", "k_equals_vocab", "support_in_topk"])
def test_kl_check_new_rows_off_policy_and_without_tail(case):
    from emapg_cli.klcheck.distributions import LogitSet
    from emapg_cli.klcheck.measure import CheckSettings, run_check

    g = torch.Generator().manual_seed(2)
    vocab = 40 if case == "off_policy" else 12
    policy = 2 * torch.randn(6, vocab, generator=g, dtype=torch.float64)
    anchor = policy + 0.7 * torch.randn(6, vocab, generator=g, dtype=torch.float64)
    sampling = policy + 0.5 * torch.randn(6, vocab, generator=g, dtype=torch.float64) if case == "off_policy" else None
    if case == "support_in_topk":  # the policy's mass on 5 tokens (exp(-1000) = 0 in float64), q = its top-8
        policy = torch.full_like(policy, -1000.0).scatter_(-1, torch.arange(5).expand(6, 5), policy[:, :5])
    ks = {"off_policy": (1, 8), "k_equals_vocab": (12,), "support_in_topk": (8,)}[case]
    result = run_check(LogitSet(policy, anchor, sampling),
                       CheckSettings(ks=ks, samples=1024, estimators=TAIL_ESTIMATORS, directions=("reverse", "forward")))
    assert_verdicts_agree(result)
    for r in result.rows:
        if case == "off_policy" and r.spec.name in UNBIASED:
            assert not r.value_biased and not r.grad_biased
        if case == "k_equals_vocab":  # q = V: every estimator is the exact KL, nothing sampled
            assert r.grad_bias.deterministic and abs(r.value_bias.mean) < 1e-12 and r.grad_bias_rel < 1e-9, r
        if case == "support_in_topk" and r.spec.direction == "reverse" and r.spec.name != "teacher_support":
            # no policy mass outside q: the tail token is 0 and nothing is sampled there, so all are exact;
            # not teacher_support, which renormalises the anchor over q: P = 1, value KL_rev + ln A < KL_rev
            assert not (r.value_biased or r.grad_biased) and r.grad_variance == 0.0, r


def test_kl_check_cli_topk_from_anchor_from_logits(tmp_path):
    """The issue's acceptance command on a --from-logits file: prints each new row, says where q comes from."""
    import json
    import os
    import subprocess
    import sys

    import numpy as np

    rng = np.random.default_rng(2)
    policy = 2 * rng.standard_normal((4, 30))
    np.savez(tmp_path / "d.npz", policy=policy, anchor=policy + 0.7 * rng.standard_normal((4, 30)))
    res = subprocess.run(
        [sys.executable, "-m", "emapg_cli", "kl-check", "--from-logits", str(tmp_path / "d.npz"), "--estimators",
         "topk_tail,topk_tail_sc,topk_resid,teacher_support", "--topk-from", "anchor", "--k", "4", "--samples", "256",
         "--batches", "8", "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    assert "q = the top-k of the anchor (--topk-from)" in res.stdout
    for name in ("topk_tail ", "topk_tail_sc", "topk_resid", "teacher_support"):
        assert name in res.stdout
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["settings"]["topk_from"] == "anchor" and len(out["rows"]) == 5  # topk_tail in both directions
