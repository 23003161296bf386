"""Render a kl-check result as rich tables (one for the k-independent estimators, one per k)."""

from __future__ import annotations

from rich import box
from rich.table import Table

from emapg_cli.klcheck.measure import CheckResult, RowResult

LEGEND = (
    "value bias: (mean estimate - exact KL) / exact KL; grad bias: ||mean gradient - grad KL|| / ||grad KL|| (includes Monte-Carlo noise); "
    "verdict: significance test at the stated confidence; ✓ agrees with the closed-form expectation, "
    "~ disagrees but the measurement is consistent with the closed form (effect too small to detect at this N), "
    "✗ inconsistent with the closed form."
)


def verdict(biased: bool, expected_biased: bool, consistent: bool) -> str:
    """'biased ✓', 'unbiased ~', ... (see LEGEND)."""
    mark = "✓" if biased == expected_biased else ("~" if consistent else "✗")
    colour = "red" if biased else "green"
    return f"[{colour}]{'biased' if biased else 'unbiased'}[/] {mark}"


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}" if abs(x) < 10 else f"{100 * x:+.0f}"


def _row_cells(r: RowResult) -> list[str]:
    """Terminal cells; biases are relative (% of the exact KL / of ||grad KL||)."""
    d = {"reverse": "rev", "forward": "fwd"}[r.spec.direction]
    if r.spec.name == "exact":
        return [r.spec.name, d, f"{r.exact_kl:.4g}", f"{r.mean_estimate:.4g}", "0", "0", "[dim]reference[/]",
                "0 / 0", "[dim]reference[/]", "0"]
    scale = max(abs(r.exact_kl), 1e-300)
    return [
        r.spec.name, d, f"{r.exact_kl:.4g}", f"{r.mean_estimate:.4g}",
        f"{_pct(r.value_bias.mean / scale)}±{100 * r.value_bias.se / scale:.2f}", _pct(r.value_bias_expected / scale),
        verdict(r.value_biased, r.value_expected_biased, r.value_consistent),
        f"{100 * r.grad_bias_rel:.1f} / {100 * r.grad_bias_rel_expected:.1f}",
        verdict(r.grad_biased, r.grad_expected_biased, r.grad_consistent),
        f"{r.grad_variance:.3g}",
    ]


COLUMNS = [("estimator", "left"), ("dir", "left"), ("exact KL", "right"), ("mean est.", "right"),
           ("value bias %±SE", "right"), ("exp. %", "right"), ("value", "left"),
           ("grad bias % meas/exp", "right"), ("gradient", "left"), ("grad var", "right")]


def _table(title: str, rows: list[RowResult]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col, just in COLUMNS:
        table.add_column(col, justify=just, no_wrap=col in ("estimator", "value", "gradient"))
    for r in rows:
        table.add_row(*_row_cells(r))
    return table


def header(result: CheckResult) -> str:
    """One line: the data, the sample size and the confidence level of every test."""
    s = result.settings
    return (f"{result.source}: P={result.positions}, |V|={result.vocab}, N={s.samples} samples/position, "
            f"M={s.batches} batches{', off-policy (importance-weighted)' if result.off_policy else ', on-policy'}; "
            + (f"q = the top-k of the {'anchor' if s.topk_from == 'anchor' else 'sampling policy'} (--topk-from); " if s.topk_from else "")
            + (f"tokens from the top-p {s.top_p:g} nucleus (--top-p); " if s.top_p < 1 else "")
            + f"tests at {s.confidence * 100:.4g}% confidence")


def render_tables(result: CheckResult) -> list[Table]:
    """The k-independent table, then one table per k (Top-k family)."""
    tables = []
    plain = [r for r in result.rows if r.spec.k is None]
    if plain:
        tables.append(_table("k-independent estimators", plain))
    for k in sorted({r.spec.k for r in result.rows if r.spec.k is not None}):
        tables.append(_table(f"Top-k family, k = {k}", [r for r in result.rows if r.spec.k == k]))
    return tables


def render_markdown(result: CheckResult) -> str:
    """The same cells as a Markdown table with a k column (for the README / issue reports)."""
    strip = lambda cell: cell.replace("[red]", "").replace("[green]", "").replace("[dim]", "").replace("[/]", "")  # noqa: E731
    names = [c for c, _ in COLUMNS]
    lines = ["| " + " | ".join(names[:2] + ["k"] + names[2:]) + " |", "|" + "---|" * (len(names) + 1)]
    for r in result.rows:
        cells = [strip(c) for c in _row_cells(r)]
        lines.append("| " + " | ".join(cells[:2] + [str(r.spec.k or "")] + cells[2:]) + " |")
    return "\n".join(lines)
