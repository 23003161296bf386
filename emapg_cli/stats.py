"""Student-t statistics in plain Python (no SciPy): tail probabilities, quantiles, confidence intervals; the paired
comparison's resampling and sign flips in numpy.

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
    odd = df % 2 == 1
    series, term = 0.0, c if odd else 1.0  # odd: the first term cos(theta) (only when df >= 3)
    for n in range(3 if odd else 2, df + 1, 2):  # term for cos^(n-2)
        series += term
        term *= c * c * (n - 1) / n
    a = (2.0 / math.pi) * (theta + s * series) if odd else s * series
    return min(1.0, max(0.0, 1.0 - a))


def t_quantile(confidence: float, df: int) -> float:
    """The two-sided Student-t critical value t* with P(|T| <= t*) = confidence, T ~ t(df).

    Solved by bisection on `student_t_two_sided_p(t, df) = 1 - confidence` (monotone decreasing
    in t), to 1e-12 absolute. Examples: t*(0.95, 2) = 4.3027, t*(0.95, 30) = 2.0423.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1)")
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
    z_a, z_b = statistics.NormalDist().inv_cdf(1 - alpha / 2), statistics.NormalDist().inv_cdf(power)
    return max(2, math.ceil(((z_a + z_b) / abs(d_z)) ** 2 + z_a ** 2 / 2))


# --- paired comparisons of two systems on the same units (`emapg eval --compare`, ablate's reports) -------------

#: The bootstrap of a paired comparison: resamples and the seed of its generator (fixed: reports are reproducible).
PAIRED_RESAMPLES, PAIRED_SEED = 2000, 0
#: The paired permutation test enumerates all 2^m sign flips up to m = EXACT_FLIPS nonzero differences, else draws
#: MC_FLIPS random ones (generator seed PAIRED_SEED).
EXACT_FLIPS, MC_FLIPS = 16, 20000


def binomial_cdf_half(k: int, m: int) -> float:
    """P(X <= k) for X ~ Binomial(m, 1/2), exactly (integer counts over 2^m); 0 for k < 0 (an empty sum)."""
    return min(1.0, sum(math.comb(m, i) for i in range(min(k, m) + 1)) / 2 ** m)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar test (the binomial test on the discordant pairs): b pairs where A scored and B did not,
    c the reverse; under H0 each discordant pair goes either way with probability 1/2, so

        p = min(1, 2 P(X <= min(b, c))),  X ~ Binomial(b + c, 1/2)

    (1 without discordant pairs). It equals the exact sign-flip permutation test on 0/1 differences, whose
    statistic |b - c| has the same two-tailed distribution."""
    m = b + c
    return 1.0 if m == 0 else min(1.0, 2.0 * binomial_cdf_half(min(b, c), m))


def _rows(count: int, width: int, draw) -> Any:
    """`draw(rows)` (an array of `rows` rows of `width` cells) for `count` rows in all, in blocks of at most 2^22 cells."""
    import numpy as np

    step = max(1, 2 ** 22 // max(width, 1))
    return np.concatenate([draw(min(step, count - i)) for i in range(0, count, step)])


def sign_flip_test(diffs: Sequence[float], exact_max: int = EXACT_FLIPS, flips: int = MC_FLIPS,
                   seed: int = PAIRED_SEED) -> tuple[float, str, Optional[int]]:
    """Two-sided paired permutation test of mean(diffs) = 0: under H0 the sign of each difference is a fair coin, and
    the statistic is |sum of the differences|. (p, method, random flips drawn or None):

    - `exact`: with m <= `exact_max` nonzero differences, all 2^m sign patterns, p = #{|sum s_i d_i| >= |sum d_i|} / 2^m;
    - `monte-carlo`: `flips` random patterns, p = (1 + #{>=}) / (1 + flips) (Phipson & Smyth 2010: never 0, valid at
      any count). A pattern is drawn per distinct magnitude v (c_v differences): its sum is
      sum_v v (2 B_v - c_v), B_v ~ Binomial(c_v, 1/2) the differences of magnitude v that keep a + sign, the same
      distribution as a coin per difference (numpy.random.default_rng(`seed`)); vectorised: 10^6 pairs take seconds.

    Zero differences carry no sign and are left out; none left: p = 1. Sums are compared with a 1e-12 relative slack."""
    import numpy as np

    d = np.asarray(diffs, dtype=float)
    d = d[d != 0.0]
    if not d.size:
        return 1.0, "exact", None
    observed = abs(float(d.sum()))
    slack = 1e-12 * max(1.0, float(np.abs(d).sum()))
    if d.size <= exact_max:
        signs = 1 - 2 * (np.arange(2 ** d.size)[:, None] >> np.arange(d.size) & 1)  # row `mask`: bit i set negates d_i
        return int((np.abs(signs @ d) >= observed - slack).sum()) / 2 ** d.size, "exact", None
    mags, counts = np.unique(np.abs(d), return_counts=True)
    rng = np.random.default_rng(seed)
    totals = _rows(flips, mags.size, lambda rows: (2 * rng.binomial(counts, 0.5, size=(rows, mags.size)) - counts) @ mags)
    return (1 + int((np.abs(totals) >= observed - slack).sum())) / (1 + flips), "monte-carlo", flips


def bootstrap_mean_ci(values: Sequence[float], confidence: float = 0.95, resamples: int = PAIRED_RESAMPLES,
                      seed: int = PAIRED_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (the paired differences: pairs resampled with
    replacement, `resamples` times): the (1 - confidence)/2 and (1 + confidence)/2 quantiles (`percentile`) of the
    resampled means. A resample of n values holding the distinct values v with counts c_v draws how often each comes
    back, Multinomial(n; c_v / n) (numpy.random.default_rng(`seed`)), the same distribution as n draws with
    replacement; vectorised: 10^6 pairs take seconds. (nan, nan) without values."""
    import numpy as np

    xs = np.asarray(values, dtype=float)
    if not xs.size:
        return math.nan, math.nan
    vals, counts = np.unique(xs, return_counts=True)
    rng = np.random.default_rng(seed)
    means = (_rows(resamples, vals.size, lambda rows: rng.multinomial(xs.size, counts / xs.size, size=rows) @ vals) / xs.size).tolist()
    tail = (1.0 - confidence) / 2
    return percentile(means, tail), percentile(means, 1.0 - tail)


def pairs_for_power_mcnemar(p10: float, p01: float, power: float = 0.8, alpha: float = 0.05) -> Optional[int]:
    """Pairs a two-sided McNemar test at level `alpha` needs for `power` when a pair is discordant one way with
    probability p10 and the other way with p01 (Connor 1987, Biometrics 43:207):

        n = ceil((z_{1-alpha/2} sqrt(psi) + z_power sqrt(psi - delta^2))^2 / delta^2),  psi = p10 + p01, delta = p10 - p01

    None when delta = 0 (no effect: no number suffices)."""
    delta, psi = p10 - p01, p10 + p01
    if delta == 0 or not math.isfinite(delta):
        return None
    z_a, z_b = statistics.NormalDist().inv_cdf(1 - alpha / 2), statistics.NormalDist().inv_cdf(power)
    return math.ceil((z_a * math.sqrt(psi) + z_b * math.sqrt(max(psi - delta * delta, 0.0))) ** 2 / delta ** 2)


@dataclass(frozen=True)
class PairedComparison:
    """Two systems A and B scored on the same units (items, or seeds), matched by key (`paired_compare`)."""

    n: int  # pairs
    mean_a: float
    mean_b: float
    diff: float  # mean of a - b over the pairs
    lo: float  # percentile bootstrap interval of `diff`
    hi: float
    confidence: float
    test: str  # "mcnemar" (every score 0 or 1) or "permutation"
    method: str  # "exact" or "monte-carlo" (the permutation test's)
    p: float  # two-sided
    a_better: int  # pairs where a > b (the discordant counts, for 0/1 scores)
    b_better: int
    ties: int
    pairs_for_power: Optional[int]  # pairs for 80% power at 5% against the observed effect (None: no effect)
    resamples: int
    seed: int
    flips: Optional[int]  # random sign patterns drawn (monte-carlo); None: exact

    @property
    def binary(self) -> bool:
        return self.test == "mcnemar"

    def verdict(self, a: str = "A", b: str = "B", alpha: float = 0.05) -> str:
        """One line: the difference, its interval, the test, and what it means at level `alpha`."""
        how = (f"McNemar exact, {self.a_better} vs {self.b_better} discordant" if self.binary else
               f"paired permutation, {self.method}" + (f" {self.flips} flips, seed {self.seed}" if self.flips else ""))
        head = (f"{a} − {b} = {self.diff:+.4f} [{self.lo:+.4f}, {self.hi:+.4f}] over {self.n} pairs ({how}, p = {p_text(self.p)}): ")
        if self.n == 0:
            return f"{a} and {b} share no pairs: nothing to compare"
        if self.p < alpha:
            return head + f"{a if self.diff > 0 else b} is better at the {alpha:g} level"
        need = f"; {self.pairs_for_power} pairs would give 80% power at this effect" if self.pairs_for_power else ""
        return head + f"no difference at the {alpha:g} level{need}"


# The numbers of the reports (eval --compare, ablate's summary.md and the studies' markdown and console tables): the
# one formatting module for numbers, percents, intervals and p-values; "–" for none.

def finite(x: Optional[float]) -> Optional[float]:
    """x, or None for None and non-finite values (JSON has no NaN)."""
    return x if x is not None and math.isfinite(x) else None


def fixed(x: Optional[float], digits: int = 3, signed: bool = False) -> str:
    """x with `digits` decimals (a sign always, when `signed`); '–' for None and non-finite values."""
    if finite(x) is None:
        return "–"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def sig3(x: Optional[float]) -> str:
    """3 significant digits; '–' for None."""
    return "–" if x is None else f"{x:.3g}"


def p_text(p: Optional[float]) -> str:
    """A p-value: 3 decimals, 2 significant digits below 0.001; '–' for None."""
    return "–" if p is None else (f"{p:.2g}" if p < 0.001 else f"{p:.3f}")


def format_mean_std(iv: Interval, digits: int = 3, percent: bool = False) -> str:
    """'mean ± std' over seeds ('–' with none, the mean alone with one); `percent`: a fraction shown in %, one
    decimal (0.841 ± 0.026 -> 84.1 ± 2.6)."""
    scale, digits = (100.0, 1) if percent else (1.0, digits)
    if iv.n == 0:
        return "–"
    return f"{scale * iv.mean:.{digits}f}" + (f" ± {scale * iv.std:.{digits}f}" if iv.n > 1 else "")


def format_ci(iv: Interval, digits: int = 3, percent: bool = False) -> str:
    """'[lo, hi]' of the t interval ('–' with fewer than two seeds); `percent` as in `format_mean_std`."""
    scale, digits = (100.0, 1) if percent else (1.0, digits)
    return f"[{scale * iv.lo:.{digits}f}, {scale * iv.hi:.{digits}f}]" if iv.n >= 2 else "–"


def interval(values: Sequence[Optional[float]], confidence: float = 0.95, extremes: bool = True) -> dict[str, Any]:
    """The JSON form of `mean_ci` over the values that are not None: n, mean, std, lo, hi (None where undefined) and,
    with `extremes`, min and max."""
    xs = [v for v in values if v is not None]
    iv = mean_ci(xs, confidence)
    out = {"n": iv.n, "mean": finite(iv.mean), "std": finite(iv.std), "lo": finite(iv.lo), "hi": finite(iv.hi)}
    return {**out, "min": min(xs) if xs else None, "max": max(xs) if xs else None} if extremes else out


def with_ci(iv: Mapping[str, Any], digits: int = 3, signed: bool = False, scale: float = 1.0) -> str:
    """An `interval` as 'mean [lo, hi]' (the bracket with ≥ 2 values), each times `scale` (100: fractions in points)."""
    if iv["n"] == 0:
        return "–"
    f = lambda x: fixed(scale * x, digits, signed)  # noqa: E731
    return f(iv["mean"]) + (f" [{f(iv['lo'])}, {f(iv['hi'])}]" if iv["n"] >= 2 else "")


def mean_range(iv: Mapping[str, Any], digits: int = 3, fmt=None) -> str:
    """An `interval` as 'mean (min–max)' over seeds; the mean alone for one value; '–' for none."""
    f = fmt or (lambda x: fixed(x, digits))
    if iv["n"] == 0:
        return "–"
    return f(iv["mean"]) if iv["n"] == 1 else f"{f(iv['mean'])} ({f(iv['min'])}–{f(iv['max'])})"


def paired_compare(a: Mapping[Any, float], b: Mapping[Any, float], confidence: float = 0.95,
                   resamples: int = PAIRED_RESAMPLES, seed: int = PAIRED_SEED) -> PairedComparison:
    """A against B on the keys they share: the mean paired difference a - b with its percentile bootstrap
    interval (`bootstrap_mean_ci`), the discordant counts, and an exact paired test: McNemar's (`mcnemar_exact`) when
    every score is 0 or 1, else the paired permutation test (`sign_flip_test`: exact up to 16 nonzero differences,
    Monte Carlo beyond); the pairs for 80% power (McNemar: Connor's formula at the observed discordance;
    otherwise the paired t approximation of `seeds_for_power` at d_z = mean / sd)."""
    import numpy as np

    keys = [k for k in a if k in b]  # the order does not matter: the draws depend on the multiset of differences
    xs = np.fromiter((a[k] for k in keys), dtype=float, count=len(keys))
    ys = np.fromiter((b[k] for k in keys), dtype=float, count=len(keys))
    diffs = xs - ys
    n = len(diffs)
    up, down = int((diffs > 0).sum()), int((diffs < 0).sum())
    binary = n > 0 and bool(np.isin(xs, (0.0, 1.0)).all() and np.isin(ys, (0.0, 1.0)).all())
    lo, hi = bootstrap_mean_ci(diffs, confidence, resamples, seed)
    flips = None
    if binary:
        test, method, p = "mcnemar", "exact", mcnemar_exact(up, down)
        power = pairs_for_power_mcnemar(up / n, down / n)
    else:
        test = "permutation"
        p, method, flips = sign_flip_test(diffs, seed=seed)
        sd = float(diffs.std(ddof=1)) if n >= 2 else 0.0
        power = seeds_for_power(float(diffs.mean()) / sd) if sd > 0 else None
    mean = lambda v: float(v.mean()) if v.size else math.nan  # noqa: E731
    return PairedComparison(n, mean(xs), mean(ys), mean(diffs), lo, hi, confidence, test, method, p, up, down,
                            n - up - down, power, resamples, seed, flips)


def holm(pvalues: Sequence[Optional[float]]) -> list[Optional[float]]:
    """Holm's step-down adjustment of a family of p-values (Holm 1979), in the order given (None stays None): sorted
    ascending, p_(i) becomes max over j <= i of min(1, (m - j + 1) p_(j)), m the number of p-values. Rejecting the
    adjusted p < alpha keeps the family-wise error rate at alpha."""
    idx = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    m, out, running = len(idx), list(pvalues), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        out[i] = running
    return out
