"""Exact KL over the full vocabulary (the ground truth every estimator is measured against)."""

from __future__ import annotations

import torch
from torch import Tensor

from emapg_cli.kl.common import upcast, xlogratio_sum as _xlogratio


def exact_reverse(logits: Tensor, ref_logits: Tensor) -> Tensor:
    """KL(pi_theta || pi_ref) = sum_j pi_theta(j) [log pi_theta(j) - log pi_ref(j)]  (paper Eq. 2).

    logits, ref_logits: [..., V] unnormalised. Returns [...] in at least float32.
    """
    logp = torch.log_softmax(upcast(logits), -1)  # [..., V]
    ref_logp = torch.log_softmax(upcast(ref_logits), -1)  # [..., V]
    return _xlogratio(logp, ref_logp)


def exact_forward(logits: Tensor, ref_logits: Tensor) -> Tensor:
    """KL(pi_ref || pi_theta) = sum_j pi_ref(j) [log pi_ref(j) - log pi_theta(j)]: `exact_reverse` with the two
    models swapped.

    logits, ref_logits: [..., V] unnormalised. Returns [...] in at least float32.
    """
    return exact_reverse(ref_logits, logits)
