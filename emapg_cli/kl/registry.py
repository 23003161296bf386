"""One entry point over every estimator: `kl_per_token(name, direction, ...)`.

The names, directions and needs of the estimators live in `emapg_cli.estimator_names` (`INFO`,
`ESTIMATORS`; torch-free, re-exported here); this module maps each to its tensor functions
(`IMPLEMENTED` lists the (name, direction) pairs it dispatches, which a test checks against INFO).

The trainer and `kl-check` both call this, so the estimator used in training is exactly
the one whose bias `kl-check` measures.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor

from emapg_cli.kl.common import upcast
from emapg_cli.estimator_names import ESTIMATORS, INFO, EstimatorInfo  # the one list of names (torch-free)
from emapg_cli.kl import exact, sampled, tail, topk


_SAMPLED: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": sampled.k1, "k2": sampled.k2, "k3": sampled.k3, "k3pp": sampled.k3pp, "k4": sampled.k4, "k5": sampled.k5,
}
_TOPK = {
    ("topk", "reverse"): topk.topk_reverse,
    ("topk", "forward"): topk.topk_forward,
    ("topk_paper", "reverse"): topk.topk_paper_reverse,
    ("topk_paper", "forward"): topk.topk_paper_forward,
    ("topk_mass", "reverse"): topk.topk_mass_reverse,
    ("topk_mass", "forward"): topk.topk_mass_forward,
    ("topk_tail", "reverse"): tail.topk_tail_reverse,
    ("topk_tail", "forward"): tail.topk_tail_forward,
    ("topk_tail_sc", "reverse"): tail.topk_tail_sc_reverse,
    ("topk_resid", "reverse"): tail.topk_resid_reverse,
    ("teacher_support", "reverse"): tail.teacher_support_reverse,
}
# truncated: the exact head alone, ignoring the tail mass outside q; teacher_support_raw (reverse) is the same
# number, H_q on the support q not renormalised (biased by -T_q), named so the teacher-support objective reads as one
# family
_TRUNCATED = {"reverse": topk.head_reverse, "forward": topk.head_forward}
_EXACT = {"reverse": exact.exact_reverse, "forward": exact.exact_forward}

#: (name, direction) pairs with an implementation here: exactly INFO's (tests/test_kl_estimators.py).
IMPLEMENTED = frozenset(
    [(n, d) for n in _SAMPLED for d in INFO[n].directions] + list(_TOPK)
    + [("truncated", d) for d in _TRUNCATED] + [("exact", d) for d in _EXACT] + [("teacher_support_raw", "reverse")]
)


def check_estimator(name: str, direction: str) -> EstimatorInfo:
    """The estimator's info; ValueError for an unknown name or unsupported direction."""
    if name not in INFO:
        raise ValueError(f"unknown KL estimator '{name}' (known: {', '.join(ESTIMATORS)})")
    info = INFO[name]
    if direction not in info.directions:
        raise ValueError(f"estimator {name} does not estimate the {direction} KL (only {', '.join(info.directions)})")
    return info


#: Where the top-k set q may come from (`kl.topk_from`, `kl-check --topk-from`).
TOPK_FROM = ("sampling", "anchor")


def topk_source(direction: str, topk_from: str | None = None) -> str:
    """Whose top-k defines q: `topk_from` when given ("sampling" or "anchor"); otherwise today's rule,
    the sampling policy for the reverse KL and the anchor for the forward KL (paper Algorithms 1 and 2).

    Every Top-k estimator is unbiased (or has its stated bias) for any fixed q that does not move
    with the policy's gradient, so the choice changes variance and, for the deterministic ones
    (truncated, topk_tail, teacher_support), the value; teacher_support means the teacher's top-K
    only with "anchor".
    """
    if topk_from is not None:
        if topk_from not in TOPK_FROM:
            raise ValueError(f"top-k source must be one of {', '.join(TOPK_FROM)}, got '{topk_from}'")
        return topk_from
    return "sampling" if direction == "reverse" else "anchor"


def kl_per_token(
    name: str,
    direction: str,
    *,
    logp: Optional[Tensor] = None,
    ref_logp: Optional[Tensor] = None,
    iw: Optional[Tensor] = None,
    logp_q: Optional[Tensor] = None,
    ref_logp_q: Optional[Tensor] = None,
    in_q: Optional[Tensor] = None,
    logits: Optional[Tensor] = None,
    ref_logits: Optional[Tensor] = None,
    log_ratio_clamp: Optional[float] = None,
    estimate_clamp: Optional[float] = None,
) -> Tensor:
    """Per-token KL estimate [...] whose autograd gradient is the estimator's gradient.

    logp, ref_logp [...]: log-probs at the sampled token (policy with grad, anchor without);
    iw [...]: detached importance weight s (None = on-policy); logp_q, ref_logp_q [..., k] and
    in_q [...]: for the Top-k family; logits, ref_logits [..., V]: for `exact` only.
    log_ratio_clamp, estimate_clamp: single-sample estimators only (K1-K5, K3++): the log-ratio
    l_ref - l is clamped to [-c, c] first and the estimate to [-c', c'] last, as the paper's K3
    (verl's `low_var_kl`: c = 20, c' = 10). A clamped value carries no gradient.
    """
    info = check_estimator(name, direction)
    if info.full_vocab:
        return _EXACT[direction](logits, ref_logits)
    if name in ("truncated", "teacher_support_raw"):
        return _TRUNCATED[direction](logp_q, ref_logp_q)
    if info.uses_topk:
        return _TOPK[(name, direction)](logp_q, ref_logp_q, logp, ref_logp, in_q, iw)
    if log_ratio_clamp is not None:
        # every estimator reads l_ref only through l_ref - l: substitute l + clamp(l_ref - l), whose
        # difference is the clamped log-ratio with clamp's gradient (0 outside [-c, c], as in verl)
        lp = upcast(logp)
        ref_logp = lp + (upcast(ref_logp) - lp).clamp(-log_ratio_clamp, log_ratio_clamp)
    value = _SAMPLED[name](logp, ref_logp)
    if estimate_clamp is not None:
        value = value.clamp(-estimate_clamp, estimate_clamp)
    return value if iw is None else iw * value
