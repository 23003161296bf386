"""The KL estimators: the one list of names, with what each needs and which KL directions it estimates.

Plain data, importable without torch or pydantic: the config models, the estimator registry
(`kl/registry.py`, which maps each name here to its tensor functions), the trainer's plan and
`emapg kl-check --help` all read it. A new estimator is one `EstimatorInfo` line here plus its
function in `kl/registry.py`'s dispatch; tests/test_kl_estimators.py checks the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorInfo:
    """What an estimator needs and which KL directions it estimates."""

    name: str
    directions: tuple[str, ...]
    uses_topk: bool  # needs log-probs gathered at the top-k set q
    full_vocab: bool  # needs the full [..., V] logits of both distributions
    sampled: bool  # has a sampled (per-token) part


_BOTH = ("reverse", "forward")

#: name -> info, in the order `kl-check` reports them. The single-sample estimators K1-K4 and K3++
#: estimate only the reverse KL and K5 only the forward KL (the paper's Table 1); topk_tail_sc,
#: topk_resid, teacher_support and teacher_support_raw only the reverse KL (docs/distill.md).
INFO: dict[str, EstimatorInfo] = {info.name: info for info in (
    EstimatorInfo("exact", _BOTH, uses_topk=False, full_vocab=True, sampled=False),
    EstimatorInfo("k1", ("reverse",), uses_topk=False, full_vocab=False, sampled=True),
    EstimatorInfo("k2", ("reverse",), uses_topk=False, full_vocab=False, sampled=True),
    EstimatorInfo("k3", ("reverse",), uses_topk=False, full_vocab=False, sampled=True),
    EstimatorInfo("k3pp", ("reverse",), uses_topk=False, full_vocab=False, sampled=True),
    EstimatorInfo("k4", ("reverse",), uses_topk=False, full_vocab=False, sampled=True),
    EstimatorInfo("k5", ("forward",), uses_topk=False, full_vocab=False, sampled=True),
    EstimatorInfo("topk", _BOTH, uses_topk=True, full_vocab=False, sampled=True),
    EstimatorInfo("topk_paper", _BOTH, uses_topk=True, full_vocab=False, sampled=True),
    EstimatorInfo("topk_mass", _BOTH, uses_topk=True, full_vocab=False, sampled=True),
    EstimatorInfo("truncated", _BOTH, uses_topk=True, full_vocab=False, sampled=False),
    # on-policy distillation (docs/distill.md): the tail token of TA-OPD in both directions (the
    # coarsened KL is natural either way); its sample-corrected form, ResOPD's tail control variate and
    # the teacher-support KL (renormalised over q, or raw) for the reverse KL only
    EstimatorInfo("topk_tail", _BOTH, uses_topk=True, full_vocab=False, sampled=False),
    EstimatorInfo("topk_tail_sc", ("reverse",), uses_topk=True, full_vocab=False, sampled=True),
    EstimatorInfo("topk_resid", ("reverse",), uses_topk=True, full_vocab=False, sampled=True),
    EstimatorInfo("teacher_support", ("reverse",), uses_topk=True, full_vocab=False, sampled=False),
    EstimatorInfo("teacher_support_raw", ("reverse",), uses_topk=True, full_vocab=False, sampled=False),
)}

ESTIMATORS = tuple(INFO)

#: The on-policy-distillation estimators of kl/tail.py (docs/distill.md): measured by `kl-check` when named
#: in --estimators; its default list (KL_CHECK_DEFAULT) stays the one before them, so its default run and
#: its time are unchanged.
DISTILL = ("topk_tail", "topk_tail_sc", "topk_resid", "teacher_support", "teacher_support_raw")
KL_CHECK_DEFAULT = tuple(name for name in ESTIMATORS if name not in DISTILL)

#: Estimators that only estimate one direction of the KL (derived from INFO).
REVERSE_ONLY = tuple(name for name, info in INFO.items() if info.directions == ("reverse",))
FORWARD_ONLY = tuple(name for name, info in INFO.items() if info.directions == ("forward",))
