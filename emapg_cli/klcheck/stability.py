"""Stability of EMA-PG on a softmax bandit: an exact-gradient simulation over an (alpha, eta) grid
and the linearised period-map theory it is compared with. Derivation and equation numbers
(S1-S13; the adaptive-eta rule S11-S13): docs/stability.md.

Pure float64 tensor math, plus `run_stability`, which checks its inputs and assembles a
`StabilityResult`. No I/O here: the rich table is in `stability_table.py`, the heat map in
`stability_plot.py`.

Notation: A actions, logits z [A], policy pi = softmax(z), rewards R [A], entropy weight tau > 0,
KL weight beta >= 0, step size alpha > 0, EMA decay eta in [0, 1], anchor update period P.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from emapg_cli.errors import UserError

#: Simulated outcomes, in the order of the integer codes `classify` returns.
OUTCOMES = ("converges", "oscillates", "diverges")

# Defaults for `kl-check --stability` (docs/stability.md, "The default picture"): with these the
# boundary sits at alpha_c ~ 0.98 for every eta at P = 10, and moves from 0.98 (eta = 1) to
# 10.8 (eta = 0) at P = 1, all inside the alpha grid.
DEFAULT_ALPHAS: tuple[float, ...] = tuple(10.0 ** (k / 4) for k in range(-8, 9))  # 1e-2 .. 1e2
DEFAULT_ETAS: tuple[float, ...] = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)
DEFAULT_PERIODS: tuple[int, ...] = (10, 1)
DEFAULT_BETA = 5.0
DEFAULT_TAU = 0.5
DEFAULT_ACTIONS = 4
DEFAULT_STEPS = 2000
DEFAULT_SEED = 0


@dataclass(frozen=True)
class Criteria:
    """How one simulated run is classified (docs/stability.md, "Classification").

    Errors are Euclidean norms of the centred logit error e_k = z_k - z_target (the softmax
    ignores z + c 1). "Quarter" = the last steps // 4 steps; "previous quarter" = the ones before.
      diverges   : a non-finite value anywhere, or max_a |log pi(a) - log pi_target(a)| above
                   `collapse_nats` somewhere in the last quarter (the policy ran away and the
                   softmax saturated, which is the only thing that bounds a linear instability here).
      converges  : not diverged, and e_T <= converged_ratio * e_0, or the last quarter's peak
                   error is <= decay_ratio * the previous quarter's peak and <= e_0.
      oscillates : neither (a bounded limit cycle or chaos about the fixed point, or a growing
                   oscillation that has not saturated the softmax yet).
    """

    init_scale: float = 1e-3  # ||e_0||: size of the seeded perturbation of the start
    converged_ratio: float = 1e-6
    decay_ratio: float = 0.999
    collapse_nats: float = 20.0
    boundary_margin: float = 1.1  # cells with alpha within this factor of alpha_c are "near the boundary"


# ---------------------------------------------------------------- the problem and its fixed point


def bandit_rewards(actions: int) -> Tensor:
    """R_a = a / (A - 1) for a = 0..A-1: evenly spaced rewards in [0, 1]. Returns [A] float64."""
    return torch.linspace(0.0, 1.0, actions, dtype=torch.float64)  # [A]


def entropy_fixed_point(rewards: Tensor, tau: float) -> Tensor:
    """z* = R / tau, centred: the maximiser of J(z) = E_pi[R] + tau H(pi) (Eq. S3).

    It is unique up to z* + c 1 (shifts do not change pi); the centred representative is
    returned. Requires tau > 0 (for tau = 0 no finite maximiser exists, see the docs).
    rewards [A] -> [A].
    """
    z = rewards / tau  # [A]
    return z - z.mean()


def fisher(pi: Tensor) -> Tensor:
    """F = diag(pi) - pi pi^T (Eq. S2): the softmax Jacobian d pi / d z (the policy's Fisher
    matrix in logit coordinates). pi [..., A] -> [..., A, A]."""
    return torch.diag_embed(pi) - pi.unsqueeze(-1) * pi.unsqueeze(-2)  # [..., A, A]


def fisher_eigenvalues(pi: Tensor) -> Tensor:
    """The A - 1 non-zero eigenvalues lambda of F(pi), ascending (Eq. S6).

    F is positive semi-definite with F 1 = 0 (the shift direction the softmax ignores); when
    every pi(a) > 0 that is its only null direction, the smallest eigenvalue, which is dropped.
    pi [A] -> [A - 1].
    """
    return torch.linalg.eigvalsh(fisher(pi))[1:]


# ---------------------------------------------------------------- linear theory


def period_map(lam: Tensor, alpha: Tensor, eta: Tensor, *, period: int, beta: float, tau: float) -> Tensor:
    """The 2x2 period map M of one Fisher eigen-direction (Eq. S7), broadcast over its inputs.

    a = 1 - alpha lam (tau + beta), A = a^P, rho = beta / (tau + beta):
        M = [[A,             rho (1 - A)                 ],
             [(1 - eta) A,   eta + (1 - eta) rho (1 - A) ]]
    acting on (e, e_bar), the policy's and the anchor's error along that direction, from just
    after one anchor update to just after the next. Returns [..., 2, 2].
    """
    a = 1.0 - alpha * lam * (tau + beta)
    big_a = a**period
    rho = beta / (tau + beta)
    row0 = torch.stack(torch.broadcast_tensors(big_a, rho * (1.0 - big_a)), -1)  # [..., 2]
    row1 = torch.stack(
        torch.broadcast_tensors((1.0 - eta) * big_a, eta + (1.0 - eta) * rho * (1.0 - big_a)), -1
    )  # [..., 2]
    return torch.stack(torch.broadcast_tensors(row0, row1), -2)  # [..., 2, 2]


def theory_radius(alpha: Tensor, eta: Tensor, lam: Tensor, *, period: int, beta: float, tau: float) -> Tensor:
    """Per-period spectral radius of the linearised EMA-PG dynamics, maximised over the Fisher
    eigen-directions (Eqs. S7, S10). alpha [N], eta [E], lam [L] -> [E, N].

    eta < 1: max_lam |eigenvalue of M(lam)|, computed numerically (torch.linalg.eigvals).
    eta = 1: the anchor never moves, so it is a constant, not a state; M's eigenvalue exactly 1
    belongs to it and is left out: the radius is max_lam |a(lam)|^P (Eq. S10).
    The fixed point is locally asymptotically stable iff the radius is < 1.
    """
    al = alpha.reshape(1, -1, 1)  # [1, N, 1]
    et = eta.reshape(-1, 1, 1)  # [E, 1, 1]
    lm = lam.reshape(1, 1, -1)  # [1, 1, L]
    m = period_map(lm, al, et, period=period, beta=beta, tau=tau)  # [E, N, L, 2, 2]
    moving = torch.linalg.eigvals(m).abs().amax(-1).amax(-1)  # [E, N]
    a_pow = ((1.0 - al * lm * (tau + beta)) ** period).abs().amax(-1)  # [1, N]
    return torch.where((eta >= 1.0).reshape(-1, 1), a_pow, moving)  # [E, N]


def critical_alpha(eta: Tensor, lam_max: float, *, period: int, beta: float, tau: float) -> Tensor:
    """The largest stable step size alpha_c(eta) (Eq. S9); stable iff alpha < alpha_c.

        alpha_c = (1 + g) / (lam_max (tau + beta)),
        g = 1                       for even P, or eta = 1,
        g = G(eta, rho)^(1 / P)     for odd P,  G = ((1 + eta) + (1 - eta) rho) / ((1 + eta) - (1 - eta) rho).
    For P = 1 this is alpha_c = 2 / (lam_max (tau + 2 eta beta / (1 + eta))). eta [E] -> [E].
    """
    rho = beta / (tau + beta)
    big_g = ((1.0 + eta) + (1.0 - eta) * rho) / ((1.0 + eta) - (1.0 - eta) * rho)  # [E], >= 1
    g = big_g ** (1.0 / period) if period % 2 == 1 else torch.ones_like(eta)
    return (1.0 + g) / (lam_max * (tau + beta))


# ---------------------------------------------------------------- simulation


def _log_softmax(z: Tensor) -> Tensor:
    """log softmax over the last dim as z - logsumexp(z) (same value as torch.log_softmax, but
    torch's softmax kernels are orders of magnitude slower on these tiny [B, A] tensors when
    several threads compete for the cores). z [..., A] -> [..., A]."""
    return z - z.logsumexp(-1, keepdim=True)


@dataclass(frozen=True)
class AdaptiveEta:
    """The adaptive-eta rule of ema.target_distance (emapg_cli/grpo/ema_control.py) in the simulation: before each
    anchor update, d = ||centred(z - z_bar)|| / ||centred z||, then eta_k = adapt_decay(eta_{k-1}, S_k, d) within
    [decay_min, decay_max], starting from `start` (docs/stability.md, "Adaptive eta")."""

    target: float
    decay_min: float = 0.5
    decay_max: float = 0.999
    start: float = 0.95


@dataclass(frozen=True)
class Trajectory:
    """Per-step error traces of B simulated runs (step 0 = the start)."""

    error: Tensor  # [T+1, B] ||centred(z_k - z_target)||_2
    logp_error: Tensor  # [T+1, B] max_a |log pi_k(a) - log pi_target(a)|
    eta: Tensor | None = None  # [T+1, B] the eta in force after each step (adaptive runs; None otherwise)


def simulate(
    z_star: Tensor, z0: Tensor, alpha: Tensor, eta: Tensor, *, period: int, beta: float, tau: float, steps: int,
    adaptive: AdaptiveEta | None = None,
) -> Trajectory:
    """Exact expected-gradient EMA-PG (no sampling noise) for B runs at once, float64 (Eqs. S4, S5).

    z_star [A] the entropy fixed point, z0 [A] the start (the anchor z_bar starts there too),
    alpha [B], eta [B]. Step k = 1..T:
        z <- z + alpha (grad J(z) - beta grad_z KL(pi_z || pi_zbar))
           = z - alpha F(z) ((tau + beta) z - tau z* - beta z_bar)          (Eq. S4, exact)
    and after every P-th step the anchor update  z_bar <- eta z_bar + (1 - eta) z  (Eq. S5).
    The error is measured against the fixed point the run should reach: z* for eta < 1, the
    anchored point (tau z* + beta z0) / (tau + beta) for eta = 1 (Eq. S6).
    `adaptive`: eta [B] is each run's starting eta, and before each anchor update eta is re-chosen per run by the
    rule of `AdaptiveEta` (its decay_max < 1, so the target is z*); the eta trace is returned.
    """
    batch = alpha.shape[0]
    z = z0.expand(batch, -1).clone()  # [B, A]
    z_bar = z.clone()  # [B, A]
    a_col, e_col = alpha[:, None], eta[:, None]  # [B, 1]
    anchored = (tau * z_star + beta * z0) / (tau + beta)  # [A]
    target = torch.where(e_col >= 1.0, anchored, z_star)  # [B, A]
    eta_now, unit_lag = eta.clone(), torch.ones_like(eta)  # [B] adaptive: eta_{k-1} and S_k
    eta_trace = torch.empty(steps + 1, batch, dtype=torch.float64) if adaptive is not None else None  # [T+1, B]
    target_logp = _log_softmax(target)  # [B, A]
    error = torch.empty(steps + 1, batch, dtype=torch.float64)  # [T+1, B]
    logp_error = torch.empty(steps + 1, batch, dtype=torch.float64)  # [T+1, B]
    for k in range(steps + 1):
        logp = _log_softmax(z)  # [B, A]
        e = z - target  # [B, A]
        error[k] = (e - e.mean(-1, keepdim=True)).norm(dim=-1)
        logp_error[k] = (logp - target_logp).abs().amax(-1)
        if eta_trace is not None:
            eta_trace[k] = eta_now
        if k == steps:
            break
        pi = logp.exp()  # [B, A]
        g = (tau + beta) * z - tau * z_star - beta * z_bar  # [B, A]
        f_g = pi * g - pi * (pi * g).sum(-1, keepdim=True)  # [B, A]  = F(z) g without forming F
        z = z - a_col * f_g
        if (k + 1) % period == 0:
            if adaptive is not None:  # measured before the update, as the trainer measures ema/distance's lag
                from emapg_cli.grpo.ema_control import adapt_decay_tensor

                centred = z - z.mean(-1, keepdim=True)  # [B, A]
                lag = z - z_bar  # [B, A]
                d = (lag - lag.mean(-1, keepdim=True)).norm(dim=-1) / centred.norm(dim=-1)  # [B]
                eta_now = adapt_decay_tensor(eta_now, unit_lag, d, target=adaptive.target,
                                             decay_min=adaptive.decay_min, decay_max=adaptive.decay_max)
                unit_lag = 1.0 + eta_now * unit_lag
                e_col = eta_now[:, None]
            z_bar = e_col * z_bar + (1.0 - e_col) * z
    return Trajectory(error=error, logp_error=logp_error, eta=eta_trace)


def classify(traj: Trajectory, criteria: Criteria) -> Tensor:
    """Outcome code per run (an index into OUTCOMES) by the rule in `Criteria`. Returns [B] int64.

    Needs T >= 8 so that both quarters are non-empty.
    """
    err, lp = traj.error, traj.logp_error  # [T+1, B]
    steps = err.shape[0] - 1
    q = steps // 4
    last, prev = err[steps - q + 1 :], err[steps - 2 * q + 1 : steps - q + 1]  # [q, B]
    nonfinite = ~(torch.isfinite(err).all(0) & torch.isfinite(lp).all(0))  # [B]
    collapsed = lp[steps - q + 1 :].amax(0) > criteria.collapse_nats  # [B]  (NaN compares False)
    diverges = nonfinite | collapsed
    tiny = err[-1] <= criteria.converged_ratio * err[0]
    decaying = (last.amax(0) <= criteria.decay_ratio * prev.amax(0)) & (last.amax(0) <= err[0])
    converges = ~diverges & (tiny | decaying)
    code = torch.full_like(converges, OUTCOMES.index("oscillates"), dtype=torch.int64)
    code[converges] = OUTCOMES.index("converges")
    code[diverges] = OUTCOMES.index("diverges")
    return code


# ---------------------------------------------------------------- the grid experiment


@dataclass(frozen=True)
class StabilityResult:
    """Simulated outcome and theoretical prediction on an (eta, alpha) grid.

    Grids are row-major [len(etas)][len(alphas)]: row i is eta = etas[i], column j alpha = alphas[j].
    `radius` is the per-period spectral radius of the linearised dynamics (Eq. S10);
    `predicted` is 'converges' where it is < 1, else 'unstable' (the linear theory cannot say
    whether the nonlinear run then oscillates or runs away). `agreement` is the fraction of cells
    where (outcome == 'converges') == (predicted == 'converges'); `agreement_clear` the same over
    the cells not `near_boundary` (alpha within a factor criteria.boundary_margin of alpha_c).
    """

    alphas: list[float]
    etas: list[float]
    period: int
    beta: float
    tau: float
    actions: int
    steps: int
    seed: int
    rewards: list[float]
    fisher_eigenvalues: list[float]
    critical_alpha: list[float]  # [E] alpha_c(eta), Eq. S9
    outcome: list[list[str]]  # [E][N] one of OUTCOMES
    radius: list[list[float]]  # [E][N]
    predicted: list[list[str]]  # [E][N] 'converges' | 'unstable'
    near_boundary: list[list[bool]]  # [E][N]
    final_error: list[list[float]]  # [E][N] ||e_T||, may be nan/inf
    agreement: float
    agreement_clear: float
    criteria: Criteria = field(default_factory=Criteria)
    adaptive: dict | None = None  # the adaptive-eta row (`adaptive_row`), when run_stability was given an AdaptiveEta

    def agrees(self, i: int, j: int) -> bool:
        """Whether simulation and theory agree on cell (eta_i, alpha_j) (stable vs not)."""
        return (self.outcome[i][j] == "converges") == (self.predicted[i][j] == "converges")

    def to_dict(self) -> dict:
        """JSON-ready dict (non-finite floats become None)."""
        d = asdict(self)
        d["final_error"] = [[v if math.isfinite(v) else None for v in row] for row in self.final_error]
        d["radius"] = [[v if math.isfinite(v) else None for v in row] for row in self.radius]
        return d


def _check_inputs(alphas: Sequence[float], etas: Sequence[float], period: int, beta: float, tau: float,
                  actions: int, steps: int) -> None:
    """Raise UserError (one line) on any input the experiment cannot run with."""
    if not alphas or not all(math.isfinite(a) and a > 0 for a in alphas):
        raise UserError("stability: every learning rate alpha must be a finite number > 0")
    if not etas or not all(0.0 <= e <= 1.0 for e in etas):
        raise UserError("stability: every EMA decay eta must lie in [0, 1]")
    if period < 1:
        raise UserError(f"stability: the anchor period must be >= 1, got {period}")
    if not (math.isfinite(beta) and beta >= 0):
        raise UserError(f"stability: beta must be a finite number >= 0, got {beta}")
    if not (math.isfinite(tau) and tau > 0):
        raise UserError(
            f"stability: tau must be > 0, got {tau}: without the entropy bonus the softmax objective "
            "has no finite maximiser (the logits drift to infinity), so there is no fixed point to be stable about"
        )
    if actions < 2:
        raise UserError(f"stability: need at least 2 actions, got {actions}")
    if steps < 8 * period:
        raise UserError(f"stability: steps must be >= 8 x period (= {8 * period}) to classify the runs, got {steps}")


def _check_adaptive(a: AdaptiveEta) -> None:
    """Raise UserError (one line) on settings the adaptive rule cannot run with (the config's checks of ema.*)."""
    if not (math.isfinite(a.target) and a.target > 0):
        raise UserError(f"stability: --target-distance must be a finite number > 0, got {a.target}")
    if not (0.0 <= a.decay_min <= a.decay_max < 1.0):
        raise UserError(f"stability: need 0 <= --decay-min <= --decay-max < 1, got [{a.decay_min}, {a.decay_max}]")
    if not a.decay_min <= a.start <= a.decay_max:
        raise UserError(f"stability: the adaptive runs' starting eta {a.start} must lie in [--decay-min, --decay-max]")


def adaptive_row(traj: Trajectory, alphas: Tensor, criteria: Criteria, lam: Tensor, adaptive: AdaptiveEta, *,
                 period: int, beta: float, tau: float) -> dict:
    """The adaptive runs (one per alpha) summarised, JSON-ready: their outcome, the eta they ended with and its mean
    over the last quarter, and the linear theory evaluated at that final eta (alpha_c(eta_T), Eq. S9, and the
    prediction r < 1, Eq. S10), since the rule's eta settles (or saturates) and the theory is for a fixed eta."""
    assert traj.eta is not None
    codes = classify(traj, criteria)  # [N]
    final = traj.eta[-1]  # [N]
    q = (traj.eta.shape[0] - 1) // 4
    radius = theory_radius(alphas, final, lam, period=period, beta=beta, tau=tau).diagonal()  # [N] cell j at eta_T[j]
    alpha_c = critical_alpha(final, float(lam.max()), period=period, beta=beta, tau=tau)  # [N]
    outcome = [OUTCOMES[c] for c in codes.tolist()]
    predicted = ["converges" if r < 1.0 else "unstable" for r in radius.tolist()]
    return {
        "target": adaptive.target, "decay_min": adaptive.decay_min, "decay_max": adaptive.decay_max, "start": adaptive.start,
        "outcome": outcome, "final_eta": final.tolist(), "mean_eta_last_quarter": traj.eta[-q:].mean(0).tolist(),
        "min_eta": traj.eta.amin(0).tolist(), "critical_alpha_at_final_eta": alpha_c.tolist(), "predicted": predicted,
        "final_error": traj.error[-1].tolist(),
        "agreement": sum((o == "converges") == (p == "converges") for o, p in zip(outcome, predicted)) / len(outcome),
    }


def run_stability(
    alphas: Sequence[float],
    etas: Sequence[float],
    *,
    period: int,
    beta: float,
    tau: float,
    actions: int,
    steps: int,
    seed: int,
    criteria: Criteria = Criteria(),
    adaptive: AdaptiveEta | None = None,
) -> StabilityResult:
    """Simulate EMA-PG on every (eta, alpha) cell and compare with the linear theory.

    The A-armed bandit has rewards `bandit_rewards(A)`; every run starts at the same seeded point
    z0 = z* + d, d a random centred direction with ||d|| = criteria.init_scale, with the anchor
    at z0. Raises UserError on bad input before any compute. `adaptive`: also one adaptive-eta run per alpha, from
    the same start (`adaptive_row`).
    """
    _check_inputs(alphas, etas, period, beta, tau, actions, steps)
    if adaptive is not None:
        _check_adaptive(adaptive)
    rewards = bandit_rewards(actions)  # [A]
    z_star = entropy_fixed_point(rewards, tau)  # [A]
    lam = fisher_eigenvalues(torch.softmax(z_star, -1))

    gen = torch.Generator().manual_seed(seed)
    d = torch.randn(actions, generator=gen, dtype=torch.float64)  # [A]
    d = d - d.mean()
    d = d * (criteria.init_scale / d.norm())

    alpha_t = torch.tensor(list(alphas), dtype=torch.float64)  # [N]
    eta_t = torch.tensor(list(etas), dtype=torch.float64)  # [E]
    n_eta, n_alpha = len(etas), len(alphas)
    traj = simulate(
        z_star, z_star + d,
        alpha_t.repeat(n_eta), eta_t.repeat_interleave(n_alpha),  # [E*N], row-major (eta, alpha)
        period=period, beta=beta, tau=tau, steps=steps,
    )
    codes = classify(traj, criteria).reshape(n_eta, n_alpha)  # [E, N]
    adaptive_out = None
    if adaptive is not None:
        start = torch.full((n_alpha,), adaptive.start, dtype=torch.float64)  # [N]
        adapt_traj = simulate(z_star, z_star + d, alpha_t, start, period=period, beta=beta, tau=tau, steps=steps,
                              adaptive=adaptive)
        adaptive_out = adaptive_row(adapt_traj, alpha_t, criteria, lam, adaptive, period=period, beta=beta, tau=tau)
    radius = theory_radius(alpha_t, eta_t, lam, period=period, beta=beta, tau=tau)  # [E, N]
    alpha_c = critical_alpha(eta_t, float(lam.max()), period=period, beta=beta, tau=tau)  # [E]

    sim_stable = codes == OUTCOMES.index("converges")  # [E, N]
    theory_stable = radius < 1.0  # [E, N]
    near = (alpha_t[None, :] / alpha_c[:, None]).log().abs() < math.log(criteria.boundary_margin)  # [E, N]
    agree = sim_stable == theory_stable  # [E, N]
    clear = ~near
    return StabilityResult(
        alphas=[float(a) for a in alphas],
        etas=[float(e) for e in etas],
        period=period, beta=float(beta), tau=float(tau), actions=actions, steps=steps, seed=seed,
        rewards=rewards.tolist(),
        fisher_eigenvalues=lam.tolist(),
        critical_alpha=alpha_c.tolist(),
        outcome=[[OUTCOMES[c] for c in row] for row in codes.tolist()],
        radius=radius.tolist(),
        predicted=[["converges" if s else "unstable" for s in row] for row in theory_stable.tolist()],
        near_boundary=near.tolist(),
        final_error=traj.error[-1].reshape(n_eta, n_alpha).tolist(),
        agreement=float(agree.double().mean()),
        agreement_clear=float(agree[clear].double().mean()) if bool(clear.any()) else float("nan"),
        criteria=criteria,
        adaptive=adaptive_out,
    )
