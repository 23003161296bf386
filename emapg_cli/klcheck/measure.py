"""kl-check's core: measure each estimator's value bias, gradient bias and variance by Monte
Carlo against the exact KL, next to its closed-form expectation (pure tensors, no I/O).

Procedure (docs/estimators.md, "Measuring estimators"):
  * draw N tokens per position from the sampling policy (torch.multinomial, with replacement);
  * value bias: t-test over M batch means of mean_pos(v - KL);
  * gradient bias: sample splitting. Half A gives the direction u = (g_A - grad KL)/||.|| per
    position; on half B the M batch projections sum_pos (g_B,m - grad KL) . u are t-tested
    against 0 (valid under H0 because A and B are independent);
  * the same two tests against the closed-form expectation (`expectation.expected`) say
    whether the measurement is consistent with the theory.
With `top_p` < 1 (`--top-p`) the tokens are drawn from the sampling policy's nucleus, as a run at rollout.top_p
samples them, and the estimators' importance weight still reads the full-vocabulary distribution (what the engines
record); the exact KL and its gradient stay the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from emapg_cli.errors import UserError
from emapg_cli.estimator_names import KL_CHECK_DEFAULT
from emapg_cli.kl import ESTIMATORS, INFO
from emapg_cli.klcheck.distributions import LogitSet
from emapg_cli.klcheck.evaluate import Spec, topk_set
from emapg_cli.klcheck.expectation import exact_reference, expected
from emapg_cli.klcheck.montecarlo import SampleGradients, draw_tokens, gradient_variance, mean_gradient, projections, sample_gradients
from emapg_cli.klcheck.stats import TTest, batch_means, t_test

#: A closed-form bias is called "biased" above this relative size (|E v - KL| / KL, or
#: ||E grad v - grad KL|| / ||grad KL||); below it the estimator is unbiased up to rounding.
EXPECTED_REL_TOL = 1e-6
#: Batch statistics that vary by less than this (relative to the quantity's scale) are
#: treated as deterministic by the t-tests (`stats.t_test`).
DETERMINISTIC_REL_TOL = 1e-9


@dataclass(frozen=True)
class CheckSettings:
    """What to measure and how hard."""

    ks: tuple[int, ...] = (1, 8, 32)
    samples: int = 4096  # N, tokens drawn per position
    batches: int = 16  # M, batches for the t-tests
    estimators: tuple[str, ...] = KL_CHECK_DEFAULT
    directions: tuple[str, ...] = ("reverse", "forward")
    confidence: float = 0.999
    seed: int = 0
    topk_from: Optional[str] = None  # whose top-k is q: "sampling" | "anchor" (None: sampling for reverse, anchor for forward)
    top_p: float = 1.0  # nucleus sampling: tokens drawn from the sampling policy's top-p nucleus (1: the whole vocabulary)


@dataclass(frozen=True)
class RowResult:
    """One estimator in one direction (and one k): measured and closed-form bias and variance.

    Values are means over positions; relative gradient quantities use Frobenius norms over
    all positions' logits, ||.|| / ||grad KL||.
    """

    spec: Spec
    exact_kl: float
    mean_estimate: float
    value_bias: TTest  # mean_pos(v - KL), over M batches
    value_bias_expected: float  # closed form E[v] - KL
    value_vs_expected: TTest  # mean_pos(v - E[v]): consistent when not rejected
    value_variance: float  # per-sample Var(v), mean over positions
    grad_norm: float  # ||grad KL||
    grad_bias_rel: float  # ||g_bar - grad KL|| / ||grad KL|| (includes Monte-Carlo noise, see grad_noise_rel)
    grad_bias_rel_expected: float  # ||E grad v - grad KL|| / ||grad KL||
    grad_noise_rel: float  # sqrt(sum_pos tr Cov(g) / N) / ||grad KL||: what an unbiased estimator would show
    grad_bias: TTest  # sample-split projection test against grad KL
    grad_vs_expected: TTest  # the same test against E grad v
    grad_variance: float  # E||g_i - g_bar||^2, mean over positions
    confidence: float

    @property
    def value_biased(self) -> bool:
        return self.value_bias.rejects(self.confidence)

    @property
    def value_expected_biased(self) -> bool:
        return abs(self.value_bias_expected) > EXPECTED_REL_TOL * max(abs(self.exact_kl), 1e-12)

    @property
    def value_consistent(self) -> bool:
        return not self.value_vs_expected.rejects(self.confidence)

    @property
    def grad_biased(self) -> bool:
        return self.grad_bias.rejects(self.confidence)

    @property
    def grad_expected_biased(self) -> bool:
        return self.grad_bias_rel_expected > EXPECTED_REL_TOL

    @property
    def grad_consistent(self) -> bool:
        return not self.grad_vs_expected.rejects(self.confidence)

    def to_dict(self) -> dict:
        def test(t: TTest) -> dict:
            return {"mean": t.mean, "se": t.se, "p": t.p, "deterministic": t.deterministic}

        return {
            "estimator": self.spec.name, "direction": self.spec.direction, "k": self.spec.k,
            "exact_kl": self.exact_kl, "mean_estimate": self.mean_estimate,
            "value_bias": self.value_bias.mean, "value_bias_se": self.value_bias.se, "value_bias_p": self.value_bias.p,
            "value_bias_expected": self.value_bias_expected, "value_variance": self.value_variance,
            "value_biased": self.value_biased, "value_expected_biased": self.value_expected_biased,
            "value_consistent": self.value_consistent, "value_vs_expected": test(self.value_vs_expected),
            "grad_norm": self.grad_norm, "grad_bias_rel": self.grad_bias_rel,
            "grad_bias_rel_expected": self.grad_bias_rel_expected, "grad_noise_rel": self.grad_noise_rel,
            "grad_bias_test": test(self.grad_bias), "grad_biased": self.grad_biased,
            "grad_expected_biased": self.grad_expected_biased, "grad_consistent": self.grad_consistent,
            "grad_vs_expected": test(self.grad_vs_expected), "grad_variance": self.grad_variance,
        }


@dataclass
class CheckResult:
    """Every row of one kl-check run, with the settings and notes (e.g. k capped at |V|)."""

    settings: CheckSettings
    source: str
    positions: int
    vocab: int
    off_policy: bool
    rows: list[RowResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        s = self.settings
        return {
            "source": self.source, "positions": self.positions, "vocab": self.vocab, "off_policy": self.off_policy,
            "settings": {"ks": list(s.ks), "samples": s.samples, "batches": s.batches, "estimators": list(s.estimators),
                         "directions": list(s.directions), "confidence": s.confidence, "seed": s.seed,
                         "topk_from": s.topk_from, "top_p": s.top_p},
            "notes": self.notes,
            "rows": [r.to_dict() for r in self.rows],
        }


def plan(settings: CheckSettings, vocab: int) -> tuple[list[Spec], list[str]]:
    """The rows to measure (each estimator only in the directions it supports, k capped at |V|)
    and notes for the user."""
    notes: list[str] = []
    ks: list[int] = []
    for k in settings.ks:
        if k > vocab:
            notes.append(f"k={k} exceeds |V|={vocab}; measured as k={vocab}")
        if min(k, vocab) not in ks:
            ks.append(min(k, vocab))
    specs: list[Spec] = []
    support = [n for n in settings.estimators if n.startswith("teacher_support")]
    if support and "reverse" in settings.directions and settings.topk_from != "anchor":
        notes.append(f"{', '.join(support)}: q is the sampling policy's top-k, not the teacher's; "
                     "add --topk-from anchor for the teacher's top-K support")
    for name in settings.estimators:
        dirs = [d for d in settings.directions if d in INFO[name].directions]
        if not dirs:
            notes.append(f"{name} estimates only the {'/'.join(INFO[name].directions)} KL; not in --directions, skipped")
        for d in dirs:
            specs.extend([Spec(name, d, k) for k in ks] if INFO[name].uses_topk else [Spec(name, d)])
    return specs, notes


def split_gradient_test(sg: SampleGradients, pi: Tensor, ref: Tensor, batches: int, atol: float) -> TTest:
    """Sample-split t-test of H0: E[g] = ref (ref [P, V]); see the module docstring.

    A position whose half-A difference is exactly 0 gets u = 0 (it cannot show a bias); the
    norm is clamped at 1e-300 only to keep the division finite where `where` discards it.
    """
    half = sg.tokens.shape[1] // 2
    diff = mean_gradient(sg, pi, slice(0, half)) - ref  # [P, V] from half A
    norm = diff.norm(dim=-1, keepdim=True)  # [P, 1]
    u = torch.where(norm > 0, diff / norm.clamp_min(1e-300), torch.zeros_like(diff))  # [P, V]
    proj = projections(sg, pi, u, slice(half, None))  # [P, N - half] from half B
    x = batch_means(proj, batches) * pi.shape[0] - (ref * u).sum()  # [M]: sum_pos (g_B,m - ref) . u
    return t_test(x, atol)


def measure_row(
    spec: Spec, logits: LogitSet, tokens: Tensor, tables: dict, reference: tuple[Tensor, Tensor],
    q: Optional[Tensor], settings: CheckSettings,
) -> RowResult:
    """Measure one estimator (Monte Carlo) and compute its closed-form expectation.

    Relative gradient quantities divide by max(||grad KL||, 1e-300) (finite when the two
    distributions coincide); the deterministic-test tolerances are DETERMINISTIC_REL_TOL times
    max(scale, 1e-12).
    """
    kl, grad_kl = reference  # [P], [P, V]
    kl_mean = float(kl.mean())
    grad_norm = float(grad_kl.norm())
    v_atol = DETERMINISTIC_REL_TOL * max(abs(kl_mean), 1e-12)
    g_atol = DETERMINISTIC_REL_TOL * max(grad_norm, 1e-12)
    if spec.name == "exact":  # the deterministic reference itself: no sampling, no bias
        zero = TTest(0.0, 0.0, 1.0, True)
        return RowResult(spec, kl_mean, kl_mean, zero, 0.0, zero, 0.0, grad_norm, 0.0, 0.0, 0.0,
                         zero, zero, 0.0, settings.confidence)
    ev, eg = expected(spec, logits.policy, logits.anchor, logits.sampling, q, settings.top_p)  # [P], [P, V]
    bias_expected = float((ev - kl).mean())
    rel_expected = float((eg - grad_kl).norm()) / max(grad_norm, 1e-300)
    pi = tables["pi"]
    sg = sample_gradients(spec, tokens, tables["logp"], tables["ref_logp"], tables["s_logp"], q)
    m = settings.batches
    n = tokens.shape[1]
    value_bias = t_test(batch_means(sg.values - kl[:, None], m), v_atol)
    value_vs = t_test(batch_means(sg.values - ev[:, None], m), v_atol)
    g_bar = mean_gradient(sg, pi)  # [P, V]
    g_var = gradient_variance(sg, pi)  # [P]
    return RowResult(
        spec=spec, exact_kl=kl_mean, mean_estimate=float(sg.values.mean()),
        value_bias=value_bias, value_bias_expected=bias_expected, value_vs_expected=value_vs,
        value_variance=float(sg.values.var(dim=1).mean()),
        grad_norm=grad_norm, grad_bias_rel=float((g_bar - grad_kl).norm()) / max(grad_norm, 1e-300),
        grad_bias_rel_expected=rel_expected,
        grad_noise_rel=math.sqrt(float(g_var.sum()) / n) / max(grad_norm, 1e-300),
        grad_bias=split_gradient_test(sg, pi, grad_kl, m, g_atol),
        grad_vs_expected=split_gradient_test(sg, pi, eg, m, g_atol),
        grad_variance=float(g_var.mean()), confidence=settings.confidence,
    )


def run_check(logits: LogitSet, settings: CheckSettings, progress: Optional[Callable[[str], None]] = None) -> CheckResult:
    """Measure every planned row on `logits`; `progress(label)` is called after each row."""
    specs, notes = plan(settings, logits.vocab)
    result = CheckResult(settings, logits.source, logits.positions, logits.vocab, logits.sampling is not None, notes=notes)
    gen = torch.Generator().manual_seed(settings.seed)
    tokens = draw_tokens(logits.policy if logits.sampling is None else logits.sampling, settings.samples, gen,
                         settings.top_p)  # [P, N]
    logp = torch.log_softmax(logits.policy, -1)  # [P, V]
    tables = {
        "logp": logp, "pi": logp.exp(), "ref_logp": torch.log_softmax(logits.anchor, -1),
        "s_logp": None if logits.sampling is None else torch.log_softmax(logits.sampling, -1),
    }
    references = {d: exact_reference(d, logits.policy, logits.anchor) for d in {s.direction for s in specs}}
    q_sets = {(s.direction, s.k): topk_set(s.direction, s.k, logits.policy, logits.anchor, logits.sampling, settings.topk_from)
              for s in specs if s.k}  # [P, k] each, shared by every estimator with that (direction, k)
    for spec in specs:
        q = q_sets[(spec.direction, spec.k)] if spec.k else None
        result.rows.append(measure_row(spec, logits, tokens, tables, references[spec.direction], q, settings))
        if progress is not None:
            progress(spec.label)
    return result


def check_settings(settings: CheckSettings) -> None:
    """Raise ValueError on settings no measurement can use (the CLI turns it into a UserError)."""
    if settings.samples < 4:
        raise ValueError(f"--samples must be at least 4 per position, got {settings.samples}")
    if settings.batches < 2:
        raise ValueError(f"--batches must be at least 2, got {settings.batches}")
    if settings.samples < 2 * settings.batches:
        raise ValueError(f"--samples ({settings.samples}) must be at least 2 x --batches ({settings.batches}) for the split gradient test")
    if not settings.ks or min(settings.ks) < 1:
        raise ValueError("--k values must be positive integers")
    if not 0.5 < settings.confidence < 1:
        raise ValueError(f"--confidence must be in (0.5, 1), got {settings.confidence}")
    unknown = [e for e in settings.estimators if e not in INFO]
    if unknown:
        raise ValueError(f"unknown estimator(s) {', '.join(unknown)} (known: {', '.join(ESTIMATORS)})")
    if not 0 < settings.top_p <= 1:  # also refuses nan
        raise ValueError(f"--top-p must be in (0, 1], got {settings.top_p}")
    if settings.topk_from not in (None, "sampling", "anchor"):
        raise ValueError(f"--topk-from must be sampling or anchor, got '{settings.topk_from}'")
    bad = [d for d in settings.directions if d not in ("reverse", "forward")]
    if bad or not settings.directions:
        raise ValueError(f"--directions must be reverse and/or forward, got {', '.join(settings.directions) or 'nothing'}")


#: Peak memory of a check, in float64 copies of the [P, V] logits: measured ~36 (the synthetic
#: source's permutation and noise, log-softmax tables, exact references, per-estimator gradients).
COPIES_OF_LOGITS = 40
#: ... plus float64 copies of the [P, N] samples (tokens, per-sample values and projections):
#: measured ~16.
COPIES_OF_SAMPLES = 16


def available_memory() -> Optional[int]:
    """Bytes this process can still allocate: MemAvailable, lowered by a cgroup (v2) limit; None
    when neither is readable (not Linux)."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            if limit != "max":
                found.append(int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_memory(positions: int, vocab: int, samples: int, where: str) -> None:
    """UserError (one line) when a check over [positions, vocab] logits with `samples` draws per
    position cannot fit in memory: said up front, instead of being killed by the kernel later."""
    need = 8 * positions * (COPIES_OF_LOGITS * vocab + COPIES_OF_SAMPLES * samples)
    free = available_memory()
    if free is not None and need > free:
        raise UserError(
            f"{where}: {positions} positions x {vocab} vocabulary x {samples} samples needs about {need / 2**30:.1f} GiB "
            f"of memory, but {free / 2**30:.1f} GiB are available; lower --positions, --vocab or --samples"
        )
