"""The `kl-check --stability` result as a rich table: rows eta, columns alpha, one letter per cell."""

from __future__ import annotations

from rich.table import Table

from emapg_cli.klcheck.stability import StabilityResult

_CELL = {"converges": ("C", "green"), "oscillates": ("O", "yellow"), "diverges": ("D", "red")}


def _cell(outcome: str, agrees: bool, dim: bool = False) -> str:
    """The outcome's letter in its colour, '!' where it disagrees with the theory, dimmed near the boundary."""
    letter, color = _CELL[outcome]
    return f"[{'dim ' if dim else ''}{color}]{letter}{'' if agrees else '!'}[/]"


def render_table(result: StabilityResult) -> Table:
    """Outcome grid of one `run_stability` call.

    C/O/D = the simulation converges / oscillates / diverges; a trailing '!' marks a cell where it
    disagrees with the linear theory (stable iff spectral radius < 1); cells near the theoretical
    boundary are dimmed. The last column is the theoretical critical step size alpha_c(eta). With adaptive eta, three
    more rows: its outcome per alpha ('!' against the theory at its final eta), that final eta, and alpha_c there.
    """
    r = result
    table = Table(
        title=(
            f"EMA-PG stability: P={r.period}, beta={r.beta:g}, tau={r.tau:g}, A={r.actions}, "
            f"{r.steps} steps; agreement with theory {r.agreement:.1%} "
            f"({r.agreement_clear:.1%} away from the boundary)"
        ),
        caption="C converges, O oscillates, D diverges; ! disagrees with theory; dim = alpha within "
        f"x{r.criteria.boundary_margin:g} of alpha_c",
    )
    table.add_column("eta \\ alpha", justify="right", style="bold")
    for a in r.alphas:
        table.add_column(f"{a:.3g}", justify="center")
    table.add_column("alpha_c", justify="right")
    for i, eta in enumerate(r.etas):
        cells = [_cell(r.outcome[i][j], r.agrees(i, j), r.near_boundary[i][j]) for j in range(len(r.alphas))]
        table.add_row(f"{eta:g}", *cells, f"{r.critical_alpha[i]:.3g}")
    if r.adaptive is not None:  # the adaptive-eta runs: outcome, then the eta they ended with (alpha_c at that eta)
        a = r.adaptive
        table.add_section()
        cells = [_cell(o, (o == "converges") == (p == "converges")) for o, p in zip(a["outcome"], a["predicted"])]
        table.add_row(f"adaptive d*={a['target']:g}", *cells, "at η_T")
        table.add_row("η_T", *[f"{e:.3g}" for e in a["final_eta"]], "")
        table.add_row("α_c(η_T)", *[f"{c:.3g}" for c in a["critical_alpha_at_final_eta"]], "")
    return table
