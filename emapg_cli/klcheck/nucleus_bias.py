"""What nucleus sampling does to the sampled KL estimators, measured: the table the training warning reads.

With rollout.top_p < 1 the tokens come from the nucleus of the sampling policy, so the tokens outside it are never
drawn, and every estimator with a sampled part (`estimator_names.INFO[...].sampled`) loses the support condition its
expectation rests on (docs/estimators.md, "Nucleus sampling"). The numbers below are kl-check's closed-form expected
biases (its "exp. %" and "grad bias % .../exp" columns, exact enumeration, no Monte-Carlo noise) on its default
synthetic distributions (64 positions, |V| = 32,000, Zipf 1, tail mass 0.3, KL 0.1, seed 0; Top-k family at k = 32,
q as in training), one run per top_p:

    emapg kl-check --top-p P --k 32 --estimators k1,k2,k3,k3pp,k4,k5,topk,topk_paper,topk_mass,topk_tail_sc,topk_resid

(P = 0.8, 0.9, 0.95, 0.99, 1). tests/test_nucleus_bias.py recomputes entries of it with kl-check's own functions.
Real models' distributions differ: `emapg kl-check --model PATH --top-p P` measures them.

Plain data (no torch): `train --dry-run` reads it.
"""

from __future__ import annotations

from typing import Optional

#: The top_p values measured (1: the unbiased reference of every estimator whose support is the whole vocabulary).
TOP_PS = (0.8, 0.9, 0.95, 0.99, 1.0)
#: The Top-k family's k in the table.
K = 32
#: (estimator, direction) -> {top_p: (value bias %, gradient bias %)}: (E[v] - KL) / KL and ||E grad v - grad KL|| /
#: ||grad KL||, in per cent, rounded to 0.1.
BIAS: dict[tuple[str, str], dict[float, tuple[float, float]]] = {
    ("k1", "reverse"): {0.8: (-1.6, 116.9), 0.9: (-0.8, 102.9), 0.95: (-0.4, 100.3), 0.99: (-0.1, 99.9), 1.0: (0.0, 100.0)},
    ("k2", "reverse"): {0.8: (0.7, 24.5), 0.9: (3.1, 10.9), 0.95: (4.1, 5.2), 0.99: (4.8, 1.0), 1.0: (5.0, 0.0)},
    ("k3", "reverse"): {0.8: (-4.1, 37.2), 0.9: (-1.8, 29.2), 0.95: (-0.9, 27.1), 0.99: (-0.2, 26.1), 1.0: (0.0, 25.9)},
    ("k3pp", "reverse"): {0.8: (-4.1, 24.5), 0.9: (-1.8, 10.9), 0.95: (-0.9, 5.2), 0.99: (-0.2, 1.0), 1.0: (0.0, 0.0)},
    ("k4", "reverse"): {0.8: (-1.6, 24.5), 0.9: (-0.8, 10.9), 0.95: (-0.4, 5.2), 0.99: (-0.1, 1.0), 1.0: (0.0, 0.0)},
    ("k5", "forward"): {0.8: (-6.7, 23.4), 0.9: (-2.9, 10.4), 0.95: (-1.4, 4.9), 0.99: (-0.3, 0.9), 1.0: (0.0, 0.0)},
    ("topk", "reverse"): {0.8: (-18.6, 50.8), 0.9: (-8.3, 22.6), 0.95: (-3.9, 10.7), 0.99: (-0.8, 2.1), 1.0: (0.0, 0.0)},
    ("topk", "forward"): {0.8: (-22.7, 46.8), 0.9: (-10.0, 20.8), 0.95: (-4.8, 9.8), 0.99: (-0.9, 1.9), 1.0: (0.0, 0.0)},
    ("topk_paper", "reverse"): {0.8: (-18.6, 83.2), 0.9: (-8.3, 80.4), 0.95: (-3.9, 79.3), 0.99: (-0.8, 78.5), 1.0: (0.0, 78.3)},
    ("topk_paper", "forward"): {0.8: (-22.7, 80.3), 0.9: (-10.0, 79.8), 0.95: (-4.8, 79.7), 0.99: (-0.9, 79.6), 1.0: (0.0, 79.5)},
    ("topk_mass", "reverse"): {0.8: (-18.6, 7.1), 0.9: (-8.3, 3.1), 0.95: (-3.9, 1.5), 0.99: (-0.8, 0.3), 1.0: (0.0, 0.0)},
    ("topk_mass", "forward"): {0.8: (-22.7, 5.2), 0.9: (-10.0, 2.2), 0.95: (-4.8, 1.1), 0.99: (-0.9, 0.2), 1.0: (0.0, 0.0)},
    ("topk_tail_sc", "reverse"): {0.8: (-19.5, 5.6), 0.9: (-8.7, 2.4), 0.95: (-4.1, 1.2), 0.99: (-0.8, 0.2), 1.0: (0.0, 0.0)},
    ("topk_resid", "reverse"): {0.8: (-18.6, 5.6), 0.9: (-8.3, 2.4), 0.95: (-3.9, 1.2), 0.99: (-0.8, 0.2), 1.0: (0.0, 0.0)},
}


def nearest_top_p(top_p: float) -> float:
    """The measured top_p nearest to `top_p` (the smaller one on a tie: the larger bias)."""
    return min(TOP_PS, key=lambda p: (abs(p - top_p), p))


def nucleus_warning(estimator: str, direction: str, top_p: float) -> Optional[str]:
    """One line for a run that samples at `top_p` < 1 with a sampled-tail estimator, naming the measured bias; None
    when nothing is measured for it (no sampled part, or top_p = 1)."""
    row = BIAS.get((estimator, direction))
    if top_p >= 1 or row is None:
        return None
    at = nearest_top_p(min(top_p, max(p for p in TOP_PS if p < 1)))
    (value, grad), (value1, grad1) = row[at], row[1.0]
    where = f"top_p {at:g}" + ("" if at == top_p else f", the nearest measured to {top_p:g}")
    k = f", k = {K}" if estimator.startswith("topk") else ""
    return (f"rollout.top_p={top_p:g} with kl.estimator={estimator} ({direction}): tokens outside the nucleus are never "
            f"sampled, so its sampled part is biased: value {value:+.1f}%, gradient {grad:.1f}% off at {where} "
            f"({value1:+.1f}% and {grad1:.1f}% at top_p 1) on kl-check's synthetic distributions{k}; "
            f"`emapg kl-check --top-p {top_p:g}` measures it (docs/estimators.md)")
