"""Student-t statistics in plain Python (no SciPy): tail probabilities, quantiles, confidence intervals.

Shared by `kl-check` (t-tests over batch statistics) and `ablate` (confidence intervals over seeds; the
stability study's paired differences, percentile bootstrap and power analysis).
Student's t distribution is evaluated with the closed form for integer degrees of freedom
(Abramowitz & Stegun 26.7.3-26.7.4).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence


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


# --- paired comparisons, bootstrap, power (the stability study: ablate/stability.py) ---------------


def median(values: Sequence[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count); NaN for no values."""
    return statistics.median(values) if len(values) else math.nan


def paired_differences(a: Mapping[int, float], b: Mapping[int, float]) -> dict[int, float]:
    """a[s] - b[s] for every unit s (a seed) present in both, in unit order: the paired design of the same seeds."""
    return {s: a[s] - b[s] for s in sorted(set(a) & set(b))}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th quantile (0 <= q <= 1) with linear interpolation between order statistics: position q (n - 1) in the
    sorted values (numpy's default, "type 7" of Hyndman & Fan 1996)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def within_best_fraction(means: Mapping[str, Mapping[Any, float]], within: float, floor: float = -math.inf) -> dict[str, float]:
    """Tuning sensitivity: per row (method), the fraction of columns (grid values) where the row's mean is within
    `within` of the best row's mean in that column: mean >= max_rows(mean) - within (1e-12 slack for rounding).

    A column counts only where at least one row has a finite mean; a row without a finite mean there is not within.
    A column whose best mean is not above `floor` (e.g. the runs' initial accuracy: no method improved there) works
    for no row: it stays in the denominator and counts against every row, so a value where everything collapsed is
    not credited to all methods alike.
    """
    cols = list(dict.fromkeys(c for row in means.values() for c in row))
    best = {c: max((row[c] for row in means.values() if c in row and math.isfinite(row[c])), default=math.nan) for c in cols}
    used = [c for c in cols if math.isfinite(best[c])]
    out = {}
    for name, row in means.items():
        hits = sum(1 for c in used if best[c] > floor and c in row and math.isfinite(row[c]) and row[c] >= best[c] - within - 1e-12)
        out[name] = hits / len(used) if used else math.nan
    return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def bootstrap_within_best(cells: Mapping[str, Mapping[Any, Mapping[int, float]]], within: float, resamples: int = 2000,
                          seed: int = 0, confidence: float = 0.95, floor: float = -math.inf) -> dict[str, tuple[float, float, float]]:
    """Tuning sensitivity with a percentile bootstrap interval: {row: (fraction on the data, lo, hi)}.

    `cells[row][col]` maps each unit (seed) to its value. One replicate draws as many units as there are, with
    replacement, from all units; the SAME draw is used for every row and column (the design is paired: a seed is
    one run in every cell); each cell's mean is then over the drawn units it holds (with repeats), and
    `within_best_fraction` is taken (with `floor`). The interval is the (1 - confidence)/2 and (1 + confidence)/2 percentiles
    (`percentile`) of the `resamples` replicates. Deterministic: `random.Random(seed)`.
    """
    units = sorted({u for row in cells.values() for cell in row.values() for u in cell})
    point = within_best_fraction({r: {c: _mean(list(v.values())) for c, v in row.items()} for r, row in cells.items()}, within, floor)
    rng = random.Random(seed)
    reps: dict[str, list[float]] = {r: [] for r in cells}
    for _ in range(resamples if units else 0):
        draw = rng.choices(units, k=len(units))
        means = {r: {c: _mean([v[u] for u in draw if u in v]) for c, v in row.items()} for r, row in cells.items()}
        for r, f in within_best_fraction(means, within, floor).items():
            if math.isfinite(f):
                reps[r].append(f)
    tail = (1.0 - confidence) / 2
    return {r: (point[r], percentile(reps[r], tail), percentile(reps[r], 1.0 - tail)) for r in cells}


def normal_quantile(p: float) -> float:
    """z with P(Z <= z) = p for a standard normal Z (statistics.NormalDist)."""
    return statistics.NormalDist().inv_cdf(p)


def seeds_for_power(d_z: float, power: float = 0.8, alpha: float = 0.05) -> Optional[int]:
    """Pairs (seeds) a two-sided paired t-test at level `alpha` needs to reach `power` against the standardised
    effect d_z = mean / sd of the paired differences: the normal approximation with Guenther's (1981) one-step
    t-correction,

        n = ceil(((z_{1-alpha/2} + z_{power}) / d_z)^2 + z_{1-alpha/2}^2 / 2),  at least 2

    (the added z^2/2 accounts for estimating sd, i.e. the t instead of the normal distribution). At 80% power and
    5%: n = ceil(7.849 / d_z^2 + 1.921); d_z = 0.5 -> ceil(33.32) = 34, d_z = 1 -> ceil(9.77) = 10, as the exact
    noncentral-t computation (e.g. G*Power) gives. None when d_z is 0 or not finite (no effect: no number suffices).
    """
    if not math.isfinite(d_z) or d_z == 0:
        return None
    z_a, z_b = normal_quantile(1 - alpha / 2), normal_quantile(power)
    return max(2, math.ceil(((z_a + z_b) / abs(d_z)) ** 2 + z_a ** 2 / 2))
