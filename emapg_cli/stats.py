"""Student-t statistics in plain Python (no SciPy): tail probabilities, quantiles, confidence intervals.

Shared by `kl-check` (t-tests over batch statistics) and `ablate` (confidence intervals over seeds).
Student's t distribution is evaluated with the closed form for integer degrees of freedom
(Abramowitz & Stegun 26.7.3-26.7.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def student_t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with integer `df` >= 1 (A&S 26.7.3 odd df, 26.7.4 even df).

    With theta = atan(|t| / sqrt(df)) and A = P(|T| <= |t|):
      df odd : A = (2/pi) [theta + sin(theta) (cos + 2/3 cos^3 + ... + (2*4..(df-3))/(1*3..(df-2)) cos^(df-2))]
      df even: A = sin(theta) [1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ... + (1*3..(df-3))/(2*4..(df-2)) cos^(df-2)]
    """
    if df < 1:
        raise ValueError("df must be >= 1")
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:
        series, term = 0.0, c  # first term cos(theta) (only when df >= 3)
        for n in range(3, df + 1, 2):  # term for cos^(n-2)
            series += term
            term *= c * c * (n - 1) / n
        a = (2.0 / math.pi) * (theta + s * series)
    else:
        series, term = 0.0, 1.0
        for n in range(2, df + 1, 2):  # term for cos^(n-2)
            series += term
            term *= c * c * (n - 1) / n
        a = s * series
    return min(1.0, max(0.0, 1.0 - a))


def t_quantile(confidence: float, df: int) -> float:
    """The two-sided Student-t critical value t* with P(|T| <= t*) = confidence, T ~ t(df).

    Solved by bisection on `student_t_two_sided_p(t, df) = 1 - confidence` (monotone decreasing
    in t), to 1e-12 absolute. Examples: t*(0.95, 2) = 4.3027, t*(0.95, 30) = 2.0423.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1)")
    if df < 1:
        raise ValueError("df must be >= 1")
    alpha = 1.0 - confidence
    lo, hi = 0.0, 1.0
    while student_t_two_sided_p(hi, df) > alpha:  # expand the bracket until it holds the root
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-12:
        mid = 0.5 * (lo + hi)
        if student_t_two_sided_p(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Interval:
    """Mean of n values, their sample std (ddof=1) and the t confidence interval of the mean.

    With n = 1 the std and the interval are undefined (NaN); with n = 0 everything is NaN.
    """

    n: int
    mean: float
    std: float
    lo: float
    hi: float
    confidence: float

    @property
    def half_width(self) -> float:
        return 0.5 * (self.hi - self.lo)


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """mean ± t*(confidence, n-1) · s / sqrt(n) over the finite entries of `values` (NaN/None dropped)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return Interval(0, math.nan, math.nan, math.nan, math.nan, confidence)
    mean = sum(xs) / n
    if n == 1:
        return Interval(1, mean, math.nan, math.nan, math.nan, confidence)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(confidence, n - 1) * std / math.sqrt(n)
    return Interval(n, mean, std, mean - half, mean + half, confidence)
