"""Unit tests of the KL estimator library (emapg_cli.kl) against hand-computed numbers.

Running example (V = 3): pi_theta = [0.5, 0.3, 0.2], pi_ref = [0.25, 0.25, 0.5], so
  log w = log(pi_ref / pi_theta) = [ln 0.5, ln(0.25/0.3), ln 2.5] = [-0.693147, -0.182322, 0.916291]
  KL_rev = 0.5 ln 2 + 0.3 ln 1.2 + 0.2 ln 0.4 = 0.346574 + 0.054697 - 0.183258 = 0.218012
  KL_fwd = 0.25 ln 0.5 + 0.25 ln(0.25/0.3) + 0.5 ln 2.5 = -0.173287 - 0.045580 + 0.458145 = 0.239278
Closed-form gradients w.r.t. the logits z (pi = softmax z):
  d KL_rev / dz_j = pi_j (log(pi_j / ref_j) - KL_rev) = [0.237568, -0.010707, -0.226861]
  d KL_fwd / dz_j = pi_j - ref_j                       = [0.25, 0.05, -0.30]
Expectations are exact enumerations: E[f] = sum_j pi_s(j) f(j), E[grad f] = grad sum_j sg(pi_s(j)) f(j).
"""

from __future__ import annotations

import math

import pytest
import torch

from emapg_cli.kl import importance_weight, kl_per_token, topk_membership

PI = [0.5, 0.3, 0.2]
REF = [0.25, 0.25, 0.5]
KL_REV = 0.218011910943328
KL_FWD = 0.2392781815986026
GRAD_REV = [0.23756763480830864, -0.010707106244812022, -0.2268605285634966]
GRAD_FWD = [0.25, 0.05, -0.30]
ABS = 1e-9  # float64 throughout: only rounding separates the hand numbers from the code


def logits_of(probs) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float64)


def enumerate_estimator(name, direction, z, z_ref, k=None, z_s=None):
    """(E[v], E[grad_z v]) of one estimator by enumerating every token as the sample (pi_s = softmax z_s or z)."""
    z = z.clone().requires_grad_()
    vocab = z.shape[-1]
    logp, ref_logp = torch.log_softmax(z, -1), torch.log_softmax(z_ref, -1)  # [V]
    s_logp = None if z_s is None else torch.log_softmax(z_s, -1)
    pi_s = torch.exp(logp if s_logp is None else s_logp).detach()  # [V]
    tokens = torch.arange(vocab)  # [V]
    kw = {}
    if name in ("topk", "topk_paper", "topk_mass", "truncated"):
        src = z_ref if direction == "forward" else (z if z_s is None else z_s)
        q = torch.topk(src, k).indices  # [k]
        kw = dict(logp_q=logp[q], ref_logp_q=ref_logp[q], in_q=topk_membership(q.expand(vocab, k), tokens))
    iw = None if s_logp is None else importance_weight(logp, s_logp)
    if name == "exact":
        v = kl_per_token(name, direction, logits=z, ref_logits=z_ref)
        ev = v
    else:
        v = kl_per_token(name, direction, logp=logp, ref_logp=ref_logp, iw=iw, **kw)
        ev = (pi_s * v).sum()
    (g,) = torch.autograd.grad(ev, z)
    return float(ev.detach()), g


def assert_close(actual, expected, tol=ABS):
    if isinstance(actual, torch.Tensor):
        actual = actual.detach().reshape(-1).tolist()
    actual = [float(a) for a in (actual if isinstance(actual, list) else [actual])]
    expected = expected if isinstance(expected, list) else [expected]
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert abs(a - e) <= tol, (actual, expected)


# ---- single-sample values at p = token 0 (pi = 0.5, ref = 0.25, w = 0.5, log w = -0.693147) ----

@pytest.mark.parametrize("name,direction,expected", [
    ("k1", "reverse", 0.6931471805599453),     # -log w = ln 2
    ("k2", "reverse", 0.2402265069591007),     # (ln 0.5)^2 / 2 = 0.480453 / 2
    ("k3", "reverse", 0.1931471805599454),     # ln 2 + 0.5 - 1
    ("k3pp", "reverse", 0.1931471805599454),   # r * K3 with r = 1 in value
    ("k4", "reverse", 0.6931471805599453),     # r * sg(-log w)
    ("k5", "forward", -0.34657359027997264),   # sg(w) log w + log r = 0.5 * (-0.693147) + 0
])
def test_single_sample_values(name, direction, expected):
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref_logp = torch.tensor([math.log(0.25)], dtype=torch.float64)
    assert_close(kl_per_token(name, direction, logp=logp, ref_logp=ref_logp), expected)


def test_importance_weight_scales_value():
    # s = pi_theta / pi_s = 0.5 / 0.25 = 2, so s * K1 = 2 ln 2
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    s = importance_weight(logp, torch.tensor([math.log(0.25)], dtype=torch.float64))
    assert_close(s, 2.0)
    v = kl_per_token("k1", "reverse", logp=logp, ref_logp=torch.tensor([math.log(0.25)], dtype=torch.float64), iw=s)
    assert_close(v, 2 * math.log(2))


# ---- exact KL and its gradient ----

def test_exact_values_and_gradients():
    z, z_ref = logits_of(PI), logits_of(REF)
    v, g = enumerate_estimator("exact", "reverse", z, z_ref)
    assert_close(v, KL_REV)
    assert_close(g, GRAD_REV)
    v, g = enumerate_estimator("exact", "forward", z, z_ref)
    assert_close(v, KL_FWD)
    assert_close(g, GRAD_FWD)


# ---- expectations (paper Table 1) ----

@pytest.mark.parametrize("name,direction,value,grad", [
    ("k1", "reverse", KL_REV, [0.0, 0.0, 0.0]),   # E grad(-log w) = sum_j pi_j (e_j - pi) = 0
    ("k2", "reverse", 0.2090582965221635, GRAD_REV),  # value: 0.5*0.240227 + 0.3*0.016621 + 0.2*0.419794
    ("k3", "reverse", KL_REV, GRAD_FWD),           # E[w] = sum ref = 1, so E[K3] = KL_rev; gradient of the FORWARD KL
    ("k3pp", "reverse", KL_REV, GRAD_REV),
    ("k4", "reverse", KL_REV, GRAD_REV),
    ("k5", "forward", KL_FWD, GRAD_FWD),
])
def test_expectations_table1(name, direction, value, grad):
    v, g = enumerate_estimator(name, direction, logits_of(PI), logits_of(REF))
    assert_close(v, value)
    assert_close(g, grad)


def test_k3_is_zero_when_distributions_match():
    # w = 1 at every token: K3 = -0 + 1 - 1 = 0, and so are its expectation and gradient
    z = logits_of(PI)
    logp = torch.log_softmax(z, -1)
    assert_close(kl_per_token("k3", "reverse", logp=logp, ref_logp=logp.clone()), [0.0, 0.0, 0.0])
    v, g = enumerate_estimator("k3", "reverse", z, z.clone())
    assert_close(v, 0.0)
    assert_close(g, [0.0, 0.0, 0.0])


def test_off_policy_importance_weighting_is_unbiased():
    # tokens drawn from pi_s = [0.2, 0.2, 0.6]: E_{pi_s}[s f] = E_{pi_theta}[f] for every sampled estimator
    z, z_ref, z_s = logits_of(PI), logits_of(REF), logits_of([0.2, 0.2, 0.6])
    for name, direction, value, grad in [("k1", "reverse", KL_REV, [0.0] * 3), ("k4", "reverse", KL_REV, GRAD_REV),
                                         ("k5", "forward", KL_FWD, GRAD_FWD)]:
        v, g = enumerate_estimator(name, direction, z, z_ref, z_s=z_s)
        assert_close(v, value)
        assert_close(g, grad)


# ---- Top-k family ----

def test_topk_paper_gradient_bias_is_grad_of_head_mass():
    # q = top-1 of pi = {0}, P(q) = 0.5; d P(q) / dz_j = pi_j (1[j in q] - P(q)) = [0.25, -0.15, -0.10]
    v, g = enumerate_estimator("topk_paper", "reverse", logits_of(PI), logits_of(REF), k=1)
    assert_close(v, KL_REV)  # value unbiased
    assert_close(g - torch.tensor(GRAD_REV, dtype=torch.float64), [0.25, -0.15, -0.10])


def test_topk_paper_forward_gradient_bias():
    # q = top-1 of the anchor = {2}; the tail's log r contributes sum_{j not in q} pi_j (e_j - pi) = grad P(tail)
    # = -grad P(q), with P(q) = pi_2 = 0.2: -pi_j (1[j=2] - 0.2) = [0.1, 0.06, -0.16]
    v, g = enumerate_estimator("topk_paper", "forward", logits_of(PI), logits_of(REF), k=1)
    assert_close(v, KL_FWD)
    assert_close(g - torch.tensor(GRAD_FWD, dtype=torch.float64), [0.1, 0.06, -0.16])


@pytest.mark.parametrize("name", ["topk", "topk_mass"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("k", [1, 2])
def test_topk_is_unbiased_in_value_and_gradient(name, direction, k):
    exact_v, exact_g = (KL_REV, GRAD_REV) if direction == "reverse" else (KL_FWD, GRAD_FWD)
    v, g = enumerate_estimator(name, direction, logits_of(PI), logits_of(REF), k=k)
    assert_close(v, exact_v)
    assert_close(g, exact_g)
    # off-policy too (q = top-k of the sampling policy for the reverse KL)
    v, g = enumerate_estimator(name, direction, logits_of(PI), logits_of(REF), k=k, z_s=logits_of([0.2, 0.2, 0.6]))
    assert_close(v, exact_v)
    assert_close(g, exact_g)


def test_truncated_is_the_head():
    # reverse, q = {0}: 0.5 ln(0.5 / 0.25) = 0.346574
    v, _ = enumerate_estimator("truncated", "reverse", logits_of(PI), logits_of(REF), k=1)
    assert_close(v, 0.5 * math.log(2))
    # forward, q = top-1 of the anchor = {2}: 0.5 ln(0.5 / 0.2) = 0.458145
    v, _ = enumerate_estimator("truncated", "forward", logits_of(PI), logits_of(REF), k=1)
    assert_close(v, 0.5 * math.log(2.5))


def per_sample_gradients(name, direction, z, z_ref, k):
    """Gradient w.r.t. z of the estimate when token p is the sample, for every p: [V, V]."""
    vocab = z.shape[-1]
    rows = []
    for p in range(vocab):
        zz = z.clone().requires_grad_()
        logp, ref_logp = torch.log_softmax(zz, -1), torch.log_softmax(z_ref, -1)
        q = torch.topk(z_ref if direction == "forward" else z, k).indices
        v = kl_per_token(name, direction, logp=logp[p], ref_logp=ref_logp[p], logp_q=logp[q], ref_logp_q=ref_logp[q],
                         in_q=topk_membership(q, torch.tensor(p)))
        rows.append(torch.autograd.grad(v, zz)[0])
    return torch.stack(rows)  # [V, V]


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_mass_is_topk_paper_shifted_by_a_constant_gradient(direction):
    # topk_mass = topk_paper -/+ (P(q) - sg P(q)): every sample's gradient moves by the same vector
    # -/+ grad P(q), so the per-sample gradient covariance (the variance kl-check reports) is identical.
    # Reverse, q = top-1 of pi = {0}: grad P(q) = pi_j (1[j in q] - P(q)) = [0.25, -0.15, -0.10].
    z, z_ref = logits_of(PI), logits_of(REF)
    diff = per_sample_gradients("topk_mass", direction, z, z_ref, 1) - per_sample_gradients("topk_paper", direction, z, z_ref, 1)
    # forward: q = top-1 of the anchor = {2}, P(q) = 0.2: +grad P(q) = [-0.1, -0.06, 0.16]
    shift = [-0.25, 0.15, 0.10] if direction == "reverse" else [-0.1, -0.06, 0.16]
    for row in diff:
        assert_close(row, shift)


@pytest.mark.parametrize("name", ["topk", "topk_paper", "topk_mass", "truncated"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_k_equal_vocab_is_exact_for_every_sample(name, direction):
    # with q = V there is no tail: every single sample's value and gradient equal the exact KL's
    torch.manual_seed(0)
    z, z_ref = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    exact_v, exact_g = enumerate_estimator("exact", direction, z, z_ref)
    for p in range(4):
        zz = z.clone().requires_grad_()
        logp, ref_logp = torch.log_softmax(zz, -1), torch.log_softmax(z_ref, -1)
        q = torch.arange(4)
        v = kl_per_token(name, direction, logp=logp[p], ref_logp=ref_logp[p], logp_q=logp[q], ref_logp_q=ref_logp[q],
                         in_q=topk_membership(q, torch.tensor(p)))
        (g,) = torch.autograd.grad(v, zz)
        assert_close(v, exact_v, 1e-12)
        assert_close(g, exact_g.tolist(), 1e-12)


def test_one_list_of_estimators():
    """The names live in estimator_names (torch-free); the registry dispatches exactly those (name, direction) pairs."""
    import subprocess
    import sys

    from emapg_cli import estimator_names
    from emapg_cli.kl import ESTIMATORS, INFO
    from emapg_cli.kl.registry import IMPLEMENTED

    assert ESTIMATORS is estimator_names.ESTIMATORS and INFO is estimator_names.INFO
    assert IMPLEMENTED == {(n, d) for n, info in INFO.items() for d in info.directions}
    # the paper's Table 1: K1-K4, K3++ reverse only, K5 forward only; the distillation estimators of
    # kl/tail.py other than topk_tail reverse only (docs/distill.md)
    assert estimator_names.REVERSE_ONLY == ("k1", "k2", "k3", "k3pp", "k4", "topk_tail_sc", "topk_resid",
                                            "teacher_support", "teacher_support_raw")
    assert estimator_names.FORWARD_ONLY == ("k5",)
    code = "import sys, emapg_cli.estimator_names; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
