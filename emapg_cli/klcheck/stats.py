"""Significance tests for kl-check (pure math on tensors / floats, no I/O).

The tests are one-sample t-tests over M independent batch statistics. Student's t
distribution comes from `emapg_cli.stats` (closed form, no SciPy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from emapg_cli.stats import student_t_two_sided_p


@dataclass(frozen=True)
class TTest:
    """A one-sample t-test of H0: E[x] = 0 over M batch statistics x."""

    mean: float
    se: float  # standard error of the mean, std(x, ddof=1) / sqrt(M)
    p: float  # two-sided p-value
    deterministic: bool  # the batch statistics did not vary (se <= atol): p is 0 or 1 by |mean| > atol

    def rejects(self, confidence: float) -> bool:
        """True when H0 is rejected at the given confidence level (p < 1 - confidence)."""
        return self.p < 1.0 - confidence


def t_test(x: Tensor, atol: float) -> TTest:
    """t-test of H0: E[x] = 0 from the batch statistics x [M] (M >= 2).

    When the spread is at or below `atol` (a deterministic estimator: every batch gives the
    same number up to rounding) the statistic is undefined; the test then rejects exactly when
    |mean| > atol.
    """
    x = x.double()
    m = x.numel()
    mean = float(x.mean())
    se = float(x.std(unbiased=True)) / math.sqrt(m)
    if se <= atol:
        return TTest(mean, se, 0.0 if abs(mean) > atol else 1.0, True)
    return TTest(mean, se, student_t_two_sided_p(mean / se, m - 1), False)


def batch_means(x: Tensor, batches: int) -> Tensor:
    """Means of x [P, N] over M contiguous sample batches, then over positions: [M].

    Batches split the N samples (unequal sizes when M does not divide N; samples are i.i.d.).
    """
    return torch.stack([chunk.mean(dim=1).mean(dim=0) for chunk in torch.tensor_split(x, batches, dim=1)])
