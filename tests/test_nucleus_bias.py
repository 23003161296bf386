"""Nucleus sampling and the KL estimators (issue 32): `emapg kl-check --top-p`, the table of measured biases
(`klcheck.nucleus_bias`) and the one-line warning `train` and `--dry-run` print from it."""

from __future__ import annotations

import json

import pytest
import torch

from emapg_cli.kl.common import nucleus


def test_nucleus_by_hand():
    # p = [0.5, 0.3, 0.15, 0.05], top_p 0.8: the mass before each token is 0, 0.5, 0.8, 0.95; kept while < 0.8, so
    # {0.5, 0.3}, renormalised by 0.8: [0.625, 0.375, 0, 0]. The most likely token is kept even at a tiny top_p.
    p = torch.tensor([[0.15, 0.5, 0.05, 0.3]], dtype=torch.float64)
    assert torch.allclose(nucleus(p, 0.8), torch.tensor([[0.0, 0.625, 0.0, 0.375]], dtype=torch.float64))
    assert torch.equal(nucleus(p, 1e-9), torch.tensor([[0.0, 1.0, 0.0, 0.0]], dtype=torch.float64))
    assert nucleus(p, 1.0) is p


def test_kl_check_top_p_biases_the_sampled_tails_and_not_exact(cli, tmp_path):
    """Small synthetic logits, closed-form columns (exact enumeration): at top_p 1 topk, topk_mass and k3pp are
    unbiased; at top_p 0.8 their tokens miss the tail outside the nucleus and their expected value and gradient move
    away from the exact KL's, which stays the reference; `truncated` has no sampled part and does not move."""
    base = ("kl-check", "--positions", "4", "--vocab", "300", "--samples", "64", "--batches", "4", "--k", "8",
            "--estimators", "exact,k3pp,topk,topk_mass,truncated", "--directions", "reverse")
    rows = {}
    for top_p in ("1", "0.8"):
        out = tmp_path / f"{top_p}.json"
        r = cli(*base, "--top-p", top_p, "--json", str(out))
        assert r.returncode == 0, r.stderr
        res = json.loads(out.read_text())
        assert res["settings"]["top_p"] == float(top_p)
        rows[top_p] = {x["estimator"]: x for x in res["rows"]}
    assert "tokens from the top-p 0.8 nucleus" in r.stdout.replace("\n", " ")
    for name in ("exact", "k3pp", "topk", "topk_mass"):
        one = rows["1"][name]
        assert abs(one["value_bias_expected"]) <= 1e-6 * one["exact_kl"] and one["grad_bias_rel_expected"] <= 1e-6, name
    assert rows["0.8"]["exact"]["value_bias_expected"] == 0 and rows["0.8"]["exact"]["grad_bias_rel_expected"] == 0
    for name in ("k3pp", "topk", "topk_mass"):
        cut = rows["0.8"][name]
        assert cut["value_bias_expected"] < -0.01 * cut["exact_kl"] and cut["grad_bias_rel_expected"] > 0.01, name
    assert rows["0.8"]["truncated"]["value_bias_expected"] == pytest.approx(rows["1"]["truncated"]["value_bias_expected"])


@pytest.mark.parametrize("name, direction, top_p", [("topk", "reverse", 0.95), ("topk_mass", "forward", 0.9), ("k3pp", "reverse", 0.8)])
def test_the_table_is_kl_checks_closed_form(name, direction, top_p):
    """Entries of klcheck.nucleus_bias.BIAS recomputed with kl-check's own functions on its default synthetic source
    (seed 0, 64 positions, |V| = 32,000), to the table's rounding (0.05 percentage points)."""
    from emapg_cli.klcheck.distributions import synthetic
    from emapg_cli.klcheck.evaluate import Spec, topk_set
    from emapg_cli.klcheck.expectation import exact_reference, expected
    from emapg_cli.klcheck.nucleus_bias import BIAS, K

    lg = synthetic(64, 32000, sharpness=1.0, tail_mass=0.3, kl_size=0.1, sampling_kl=0.0, seed=0)
    topk = name.startswith("topk")
    q = topk_set(direction, K, lg.policy, lg.anchor, lg.sampling) if topk else None
    ev, eg = expected(Spec(name, direction, K if topk else None), lg.policy, lg.anchor, lg.sampling, q, top_p)
    kl, g = exact_reference(direction, lg.policy, lg.anchor)
    value, grad = 100 * float((ev - kl).mean() / kl.mean()), 100 * float((eg - g).norm() / g.norm())
    assert BIAS[(name, direction)][top_p] == pytest.approx((value, grad), abs=0.05)


def test_train_and_dry_run_warn_in_one_line(cli_many):
    from emapg_cli.klcheck.nucleus_bias import BIAS

    base = ("train", "--preset", "toy", "--dry-run", "--set", "kl.estimator=topk")
    warned, plain, exact = cli_many((*base, "--set", "rollout.top_p=0.95"), base,
                                    (*base, "--set", "rollout.top_p=0.95", "--set", "kl.estimator=exact"))
    lines = [line for line in warned.stdout.splitlines() if "rollout.top_p" in line]
    value, grad = BIAS[("topk", "reverse")][0.95]
    assert warned.returncode == 0 and len(lines) == 1, warned.stdout[-3000:]
    assert lines[0].startswith("warning: rollout.top_p=0.95 with kl.estimator=topk (reverse)")
    assert f"value {value:+.1f}%, gradient {grad:.1f}% off at top_p 0.95" in lines[0]
    for r in (plain, exact):  # top_p 1, or an estimator without a sampled part: nothing to say
        assert r.returncode == 0 and "rollout.top_p" not in r.stdout, r.stdout[-2000:]
