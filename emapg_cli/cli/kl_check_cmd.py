"""`emapg kl-check`: measure KL estimators' value bias, gradient bias and variance by Monte Carlo
against the exact KL (and, with --stability, simulate EMA-PG's stability on a bandit)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from emapg_cli.cli.common import console, write_json_file
from emapg_cli.errors import UserError
from emapg_cli.estimator_names import ESTIMATORS, KL_CHECK_DEFAULT
from emapg_cli.outputs import writable_file


def parse_list(text: str, kind: type, option: str) -> list:
    """'1,8,32' -> [1, 8, 32]; UserError naming the option on anything unparsable."""
    try:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option}: expected a comma-separated list of {kind.__name__}s, got '{text}'") from None
    if not items:
        raise UserError(f"{option}: empty list")
    return items


def _finite(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats become null."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def kl_check(
    from_logits: Annotated[Optional[Path], typer.Option("--from-logits", help="A .npz file with float arrays policy [P, V], anchor [P, V] and optional sampling [P, V] (logits; tokens are then drawn from sampling and importance-weighted).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Local transformers causal-LM directory: its logits on real text are the policy.")] = None,
    anchor_model: Annotated[Optional[str], typer.Option("--anchor-model", help="With --model: a second local model used as the anchor (default: the policy with Gaussian weight noise, see --perturb).")] = None,
    text: Annotated[Optional[Path], typer.Option("--text", help="With --model: a text file to run through the model (default: a built-in paragraph).")] = None,
    perturb: Annotated[float, typer.Option("--perturb", help="With --model and no --anchor-model: std of the Gaussian noise added to every weight to make the anchor.")] = 0.02,
    positions: Annotated[int, typer.Option("--positions", help="Positions P (synthetic; with --model, the last P positions of the text).")] = 64,
    vocab: Annotated[int, typer.Option("--vocab", help="Synthetic: vocabulary size |V|.")] = 32000,
    sharpness: Annotated[float, typer.Option("--sharpness", help="Synthetic: Zipf exponent of the policy (logit of rank i = -sharpness * log i).")] = 1.0,
    tail_mass: Annotated[float, typer.Option("--tail-mass", help="Synthetic: policy mass outside its top 32 tokens, in (0, 1).")] = 0.3,
    kl_size: Annotated[float, typer.Option("--kl-size", help="Synthetic: reverse KL(policy || anchor) per position, > 0.")] = 0.1,
    sampling_kl: Annotated[float, typer.Option("--sampling-kl", help="Synthetic: reverse KL(policy || sampling); > 0 draws tokens off-policy with importance weights (0: on-policy).")] = 0.0,
    k: Annotated[str, typer.Option("--k", help="Comma-separated top-k sizes for the Top-k family (topk, topk_paper, topk_mass, truncated, topk_tail, topk_tail_sc, topk_resid, teacher_support, teacher_support_raw); each is reported separately (k > |V| is measured as |V|).")] = "1,8,32",
    topk_from: Annotated[Optional[str], typer.Option("--topk-from", help="Whose top-k is the set q of the Top-k family: sampling (the sampling policy) or anchor (default: sampling for the reverse KL, anchor for the forward KL; kl.topk_from in training).")] = None,
    samples: Annotated[int, typer.Option("--samples", help="Monte-Carlo samples N per position.")] = 4096,
    batches: Annotated[int, typer.Option("--batches", help="Batches M the samples are split into for the t-tests.")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="Seed for the synthetic distributions, the anchor noise and the sampling.")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling, in (0, 1]: tokens are drawn from the smallest set of the sampling policy's most likely tokens whose mass reaches P (rollout.top_p; the hf engine's rule), while the estimators' importance weight reads the full-vocabulary distribution, as in training. 1: the whole vocabulary.")] = 1.0,
    estimators: Annotated[str, typer.Option("--estimators", help=f"Comma-separated estimators to measure (from {', '.join(ESTIMATORS)}); each in the directions it supports. The default leaves out the distillation estimators (docs/distill.md).",
                                                show_default=", ".join(KL_CHECK_DEFAULT))] = ",".join(KL_CHECK_DEFAULT),
    directions: Annotated[str, typer.Option("--directions", help="Comma-separated KL directions: reverse = KL(policy || anchor), forward = KL(anchor || policy).")] = "reverse,forward",
    confidence: Annotated[float, typer.Option("--confidence", help="Confidence level of every bias test, in (0.5, 1).")] = 0.999,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write every number (and the settings) to this JSON file.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Save a PNG: relative bias with error bars per estimator, and gradient variance vs k for the Top-k family.")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Also print the results as one Markdown table.")] = False,
    stability: Annotated[bool, typer.Option("--stability", help="Instead of measuring estimators, simulate EMA-PG's stability on a softmax bandit over an (alpha, eta) grid (docs/stability.md).")] = False,
    alphas: Annotated[Optional[str], typer.Option("--alphas", help="--stability: comma-separated step sizes alpha (default: the simulation's grid).")] = None,
    etas: Annotated[Optional[str], typer.Option("--etas", help="--stability: comma-separated EMA decays eta in [0, 1] (default: the simulation's grid).")] = None,
    period: Annotated[Optional[str], typer.Option("--period", help="--stability: anchor update period(s), comma-separated; one table per period (default: the simulation's).")] = None,
    beta: Annotated[Optional[float], typer.Option("--beta", help="--stability: KL coefficient beta (default: the simulation's).")] = None,
    tau: Annotated[Optional[float], typer.Option("--tau", help="--stability: entropy weight tau (default: the simulation's).")] = None,
    actions: Annotated[Optional[int], typer.Option("--actions", help="--stability: number of bandit arms (default: the simulation's).")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="--stability: simulated policy-gradient steps (default: the simulation's).")] = None,
    target_distance: Annotated[Optional[float], typer.Option("--target-distance", help="--stability: also run the adaptive-eta rule of ema.target_distance with this target policy-anchor distance ||centred(z - z_bar)|| / ||centred z||, one run per alpha from eta 0.95 (docs/stability.md, \"Adaptive eta\").")] = None,
    decay_min: Annotated[Optional[float], typer.Option("--decay-min", help="--stability with --target-distance: the smallest eta the rule may choose (default 0.5).")] = None,
    decay_max: Annotated[Optional[float], typer.Option("--decay-max", help="--stability with --target-distance: the largest eta the rule may choose, < 1 (default 0.999).")] = None,
) -> None:
    """Measure each KL estimator's value bias, gradient bias (w.r.t. the policy logits) and variance
    by Monte Carlo against the exact KL, next to its closed-form expectation (docs/estimators.md)."""
    o = SimpleNamespace(**locals())
    settings = _preflight(o)
    if stability:
        return _stability(o)
    _measure(o, settings)


def _measure(o: SimpleNamespace, settings) -> None:
    """Measure the estimators of `settings` on the source's logits and print (and write) the results."""
    from emapg_cli.klcheck.measure import check_memory, plan, run_check

    logits = _load_source(o)
    check_memory(logits.positions, logits.vocab, o.samples, logits.source)
    specs, _ = plan(settings, logits.vocab)

    from emapg_cli.klcheck.report import LEGEND, header, render_markdown, render_tables
    from emapg_cli.progress import Progress  # plain lines when the output is a log

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("measuring estimators", total=len(specs))
        result = run_check(logits, settings, progress=lambda label: bar.advance(task))
    console.print(header(result), markup=False, highlight=False)  # the source names a user path
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    for table in render_tables(result):
        console.print(table)
    console.print(f"[dim]{escape(LEGEND)}[/]", highlight=False)
    if o.markdown:
        console.print(render_markdown(result), highlight=False, markup=False, soft_wrap=True)
    if o.json_out is not None:
        write_json_file(o.json_out, _finite(result.to_dict()))
        console.print(f"wrote {o.json_out}", markup=False, highlight=False)
    if o.plot is not None:
        from emapg_cli.klcheck.plot import plot_check

        console.print(f"wrote {plot_check(result, o.plot)}", markup=False, highlight=False)


def _preflight(o: SimpleNamespace):
    """Every check kl-check can fail before any work, in order, one line each (exit 2). --stability: puts the adaptive
    rule and the parsed grids on `o`; else returns the estimators' CheckSettings, the source and its memory checked."""
    for option, path in (("--json", o.json_out), ("--plot", o.plot)):  # before any work, not after it
        if path is not None:
            writable_file(path, option)
    if o.target_distance is not None and not o.stability:
        raise UserError("--target-distance runs the adaptive eta rule of the stability simulation: add --stability")
    if (o.decay_min is not None or o.decay_max is not None) and o.target_distance is None:
        raise UserError("--decay-min/--decay-max bound the adaptive eta rule: add --target-distance D (and --stability)")
    if o.stability:
        from emapg_cli.klcheck import stability as st

        lo, hi = 0.5 if o.decay_min is None else o.decay_min, 0.999 if o.decay_max is None else o.decay_max
        o.adaptive = (None if o.target_distance is None else
                      st.AdaptiveEta(target=o.target_distance, decay_min=lo, decay_max=hi, start=min(max(0.95, lo), hi)))
        o.periods = parse_list(o.period, int, "--period") if o.period else list(st.DEFAULT_PERIODS)
        o.alpha_grid = parse_list(o.alphas, float, "--alphas") if o.alphas else list(st.DEFAULT_ALPHAS)  # parsed once,
        o.eta_grid = parse_list(o.etas, float, "--etas") if o.etas else list(st.DEFAULT_ETAS)  # before any simulation
        return None
    from emapg_cli.klcheck.measure import CheckSettings, check_memory, check_settings

    settings = CheckSettings(
        ks=tuple(parse_list(o.k, int, "--k")), samples=o.samples, batches=o.batches,
        estimators=tuple(parse_list(o.estimators, str, "--estimators")),
        directions=tuple(parse_list(o.directions, str, "--directions")), confidence=o.confidence, seed=o.seed,
        topk_from=o.topk_from, top_p=o.top_p,
    )
    try:
        check_settings(settings)
    except ValueError as e:
        raise UserError(str(e)) from None
    if o.from_logits is None and o.model is None:  # synthetic: the sizes are known before anything is built
        check_memory(o.positions, o.vocab, o.samples, "synthetic logits")
    elif o.model is None:  # --from-logits: the sizes from the .npy headers in the zip, before decompressing anything
        from emapg_cli.klcheck.distributions import npz_shape

        check_memory(*npz_shape(o.from_logits), o.samples, o.from_logits.name)
    if o.from_logits is not None and o.model is not None:
        raise UserError("use either --from-logits or --model, not both")
    if o.anchor_model is not None and o.model is None:
        raise UserError("--anchor-model needs --model")
    if o.model is not None and (o.perturb < 0 or o.positions < 1):
        raise UserError("--perturb must be >= 0 and --positions >= 1")
    return settings


def _load_source(o: SimpleNamespace):
    """The LogitSet from exactly one source (checked by `_preflight`): --from-logits, --model, or the synthetic default."""
    if o.from_logits is not None:
        from emapg_cli.klcheck.distributions import load_logits_npz

        return load_logits_npz(o.from_logits)
    if o.model is not None:
        from emapg_cli.fileio import read_text_file
        from emapg_cli.klcheck.model_source import logits_from_model

        text = read_text_file(o.text, "--text") if o.text is not None else None
        return logits_from_model(o.model, o.anchor_model, text, o.positions, o.perturb, o.seed)
    from emapg_cli.klcheck.distributions import synthetic

    return synthetic(o.positions, o.vocab, sharpness=o.sharpness, tail_mass=o.tail_mass, kl_size=o.kl_size,
                     sampling_kl=o.sampling_kl, seed=o.seed)


def _stability(o: SimpleNamespace) -> None:
    """`kl-check --stability`: the bandit simulation of emapg_cli.klcheck.stability (docs/stability.md)."""
    from emapg_cli.klcheck import stability as st
    from emapg_cli.klcheck.stability_plot import plot_stability
    from emapg_cli.klcheck.stability_table import render_table

    results = []
    for p in o.periods:
        result = st.run_stability(
            o.alpha_grid, o.eta_grid, period=p, beta=st.DEFAULT_BETA if o.beta is None else o.beta,
            tau=st.DEFAULT_TAU if o.tau is None else o.tau, actions=st.DEFAULT_ACTIONS if o.actions is None else o.actions,
            steps=st.DEFAULT_STEPS if o.steps is None else o.steps, seed=o.seed, adaptive=o.adaptive,
        )
        console.print(render_table(result))
        results.append(result)
    if o.plot is not None:
        console.print(f"wrote {plot_stability(results, o.plot)}", markup=False, highlight=False)
    if o.json_out is not None:
        write_json_file(o.json_out, _finite({"stability": [r.to_dict() for r in results]}))
        console.print(f"wrote {o.json_out}", markup=False, highlight=False)
