"""`emapg bench`: opt-in benchmarks to run on your own hardware (see README, "Performance")."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from emapg_cli.cli.common import PresetOpt, SetOpt, console, write_json_file
from emapg_cli.errors import UserError
from emapg_cli.estimator_names import ESTIMATORS  # torch-free: `emapg --help` must not import torch

app = typer.Typer(help="Benchmarks: rollout generation against its compute-bound limit, the fused output layer against its GEMM "
                       "floor, the no-grad passes, one RL step.",
                  no_args_is_help=True)

TokensOpt = Annotated[int, typer.Option("--tokens", "-T", help="Response tokens T (rows of the hidden states), at most 2^20.", min=1, max=2**20)]
HiddenOpt = Annotated[int, typer.Option("--hidden", "-H", help="Hidden size H, at most 2^16.", min=1, max=2**16)]
VocabOpt = Annotated[int, typer.Option("--vocab", "-V", help="Vocabulary size V, at most 2^24.", min=2, max=2**24)]
KOpt = Annotated[int, typer.Option("--k", "-k", help="Top-k set size (capped at V), at most 2^24.", min=1, max=2**24)]
ChunkOpt = Annotated[Optional[int], typer.Option("--chunk", help="Tokens per chunk (default: from --budget-mib, as training does), at most 2^20.", min=1, max=2**20)]
BudgetOpt = Annotated[float, typer.Option("--budget-mib", help="Memory for the [chunk, V] float32 buffers when --chunk is not given (train.logit_memory_mib), at most 2^20.", min=1, max=2**20)]
RepeatsOpt = Annotated[int, typer.Option("--repeats", "-r", help="Timed runs, each after a floor run (interleaved); medians and every run are reported.", min=1, max=10_000)]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, or cuda:N.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="float32 or bfloat16.")]
PeakOpt = Annotated[Optional[float], typer.Option("--peak-tflops", help="The device's dense peak for --dtype (TFLOP/s); adds pct_of_peak (e.g. 989 for an H100/H200 in bf16).", min=0, max=1e9)]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="torch intra-op threads (default: torch's). On a shared machine 1 thread gives the steadiest CPU seconds: idle OpenMP threads spin and count as CPU time.", min=1, max=4096)]
TrustOpt = Annotated[bool, typer.Option("--trust-code", help="Run the reward plugin / user environment (rollout.reward, rollout.env = FILE.py:NAME or module:NAME) or the model's own code (model.trust_remote_code) that the preset file names; without it only those given by --set on this command line run (docs/reliability.md).")]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="Also write the result to this JSON file.")]


def _check(device: str, dtype: str, threads: Optional[int] = None) -> None:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    if dtype not in ("float32", "bfloat16"):
        raise UserError(f"--dtype must be float32 or bfloat16, not '{dtype}'")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"--device must be cpu or cuda[:N], not '{device}'")


def _check_memory(tokens: int, hidden: int, vocab: int, k: int, chunk: Optional[int], budget_mib: float, dtype: str,
                  device: str, *, update: bool, reference: bool = False) -> None:
    """UserError (one line) when the shape cannot fit in the device's free memory: said before allocating.
    `reference`: the float64 reference of --check / --confident too (on the CPU, beside a CPU run's own buffers)."""
    import torch

    from emapg_cli.bench.check import REFERENCE_BUFFERS
    from emapg_cli.bench.head import least_bytes
    from emapg_cli.kl.fused import auto_chunk
    from emapg_cli.klcheck.measure import available_memory

    check_chunk = auto_chunk(vocab, budget_mib, 2 * REFERENCE_BUFFERS) if reference else 0
    if reference and device.startswith("cuda"):  # the reference runs on the CPU: its bytes are checked there
        _check_memory(tokens, hidden, vocab, k, chunk, budget_mib, dtype, "cpu", update=False, reference=True)
        check_chunk = 0
    need = least_bytes(tokens, hidden, vocab, k, chunk or auto_chunk(vocab, budget_mib), dtype, update=update,
                       check_chunk=check_chunk)
    if device.startswith("cuda"):
        try:
            free = torch.cuda.mem_get_info(torch.device(device))[0]
        except (RuntimeError, ValueError, AssertionError) as e:
            raise UserError(f"--device {device}: {str(e).splitlines()[0] if str(e) else 'not usable'}") from None
    else:
        free = available_memory()
    if free is not None and need > free:
        raise UserError(f"T {tokens} x H {hidden} x V {vocab:,} in {dtype} needs at least {need / 2**30:.1f} GiB on {device}, "
                        f"but {free / 2**30:.1f} GiB are free; lower --tokens, --hidden or --vocab")


def _trust(preset: str, sets: list[str], trust_code: bool) -> None:
    """The preset's plugins and environments run here as in `emapg train`: train's trust rule (docs/reliability.md)."""
    from emapg_cli.config.loading import load_config
    from emapg_cli.config.trust import code_refs, load_code, named_refs, require_trust

    refs = code_refs(load_config(preset, None, sets))
    require_trust(refs, named_refs(sets), trust_code, f"--preset {preset}")
    load_code(refs)


def _emit(result: dict[str, Any], json_path: Optional[Path], rows: list[tuple[str, str]]) -> None:
    from rich.table import Table

    table = Table(show_header=False, box=None)
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    if json_path is not None:
        write_json_file(json_path, result)


def _ratio_rows(r: dict[str, Any], label: str) -> list[tuple[str, str]]:
    unit = "CPU s" if r["ratio_of"] == "cpu_s" else "wall s"
    runs = ", ".join(f"{x:.3f}" for x in r["ratio_runs"])
    return [(f"{label} {unit}", f"{r[r['ratio_of']]:.3f} (floor {r['floor_' + r['ratio_of']]:.3f})"),
            (f"{label} ratio", f"{r['ratio']:.3f}x the GEMM floor (runs: {runs})"),
            (f"{label} wall s", f"{r['wall_s']:.3f}"), (f"{label} peak growth", f"{r['peak_growth_mib']:.0f} MiB"),
            (f"{label} TFLOP/s", f"{r['tflops']:.3f}" + (f" ({r['pct_of_peak']:.1f}% of peak)" if "pct_of_peak" in r else ""))]


def update(
    tokens: TokensOpt = 1024, hidden: HiddenOpt = 1536, vocab: VocabOpt = 151_936, k: KOpt = 32, chunk: ChunkOpt = None,
    estimator: Annotated[str, typer.Option("--estimator", "-e", help=f"KL estimator ({', '.join(ESTIMATORS)}).")] = "topk",
    direction: Annotated[str, typer.Option("--direction", help="KL direction: reverse or forward.")] = "reverse",
    budget_mib: BudgetOpt = 256.0, repeats: RepeatsOpt = 1, device: DeviceOpt = "cpu", dtype: DtypeOpt = "float32",
    peak_tflops: PeakOpt = None, threads: ThreadsOpt = None, json_path: JsonOpt = None,
    check: Annotated[bool, typer.Option("--check", help="Also compare the fused layer's dH and dW with a float64 reference of the same loss on the same rounded inputs (on the CPU): JSON keys dh_rel_err, dw_rel_err (||fused - reference|| / ||reference||), target_prob_min.")] = False,
    confident: Annotated[Optional[float], typer.Option("--confident", help="Make every target token's probability at least P, in (0, 1) (the hidden states are moved towards the target's row of W): the confident tokens where a half-precision layer's gradient is the small difference of two large terms.")] = None,
) -> None:
    """The output layer's part of the update (log-probs, PPO-clip + KL, backward) against its three GEMMs (logits, dH, dW).

    Random hidden states [T, H] and head [V, H], random q and anchor log-probs; one warm-up, then the
    fused path (`emapg_cli.kl.fused`) and the floor alternate --repeats times. JSON keys: cpu_s, wall_s,
    peak_growth_mib (peak RSS, or CUDA memory, above the set-up; includes the new W.grad), floor_cpu_s,
    floor_wall_s, ratio, w_grad_mib, beyond_w_grad_mib, tflops, per-run lists, confident; with --check also
    dh_rel_err, dw_rel_err and target_prob_min.
    """
    from emapg_cli.bench.head import bench_update
    from emapg_cli.kl import check_estimator

    _check(device, dtype, threads)
    try:
        check_estimator(estimator, direction)
    except ValueError as e:
        raise UserError(str(e)) from None
    if confident is not None and not 0 < confident < 1:  # also refuses nan
        raise UserError(f"--confident must be a probability in (0, 1), not {confident}")
    _check_memory(tokens, hidden, vocab, k, chunk, budget_mib, dtype, device, update=True,
                  reference=check or confident is not None)
    r = bench_update(tokens, hidden, vocab, k, chunk=chunk, budget_mib=budget_mib, estimator=estimator, direction=direction,
                     repeats=repeats, device=device, dtype=dtype, peak_tflops=peak_tflops, check=check, confident=confident)
    rows = [("shape", f"T {tokens}, H {hidden}, V {vocab:,}, k {r['k']}, chunk {r['chunk']}, {estimator}/{direction}, "
                      f"{dtype} on {device}, {r['threads']} threads"
                      + (f", target tokens' p >= {confident:g}" if confident is not None else ""))]
    rows += _ratio_rows(r, "update")
    rows.append(("beyond W.grad", f"{r['beyond_w_grad_mib']:.0f} MiB (W.grad {r['w_grad_mib']:.0f} MiB)"))
    if check:
        rows += [("dH rel err", f"{r['dh_rel_err']:.3e} (against float64 on the same rounded inputs)"),
                 ("dW rel err", f"{r['dw_rel_err']:.3e}"), ("min target p", f"{r['target_prob_min']:.6f}")]
    _emit(r, json_path, rows)


def passes(
    tokens: TokensOpt = 1024, hidden: HiddenOpt = 1536, vocab: VocabOpt = 151_936, k: KOpt = 32, chunk: ChunkOpt = None,
    budget_mib: BudgetOpt = 256.0, repeats: RepeatsOpt = 1, device: DeviceOpt = "cpu", dtype: DtypeOpt = "float32",
    peak_tflops: PeakOpt = None, threads: ThreadsOpt = None, json_path: JsonOpt = None,
) -> None:
    """The no-grad passes against one GEMM: old policy (log-probs, log-sum-exp, top-k) and anchor (gathers at q).

    JSON: {"old": {...}, "anchor": {...}} with the keys of `emapg bench update`.
    """
    from emapg_cli.bench.head import bench_passes

    _check(device, dtype, threads)
    _check_memory(tokens, hidden, vocab, k, chunk, budget_mib, dtype, device, update=False)
    r = bench_passes(tokens, hidden, vocab, k, chunk=chunk, budget_mib=budget_mib, repeats=repeats, device=device,
                     dtype=dtype, peak_tflops=peak_tflops)
    rows = [("shape", f"T {tokens}, H {hidden}, V {vocab:,}, k {r['k']}, chunk {r['chunk']}, {dtype} on {device}, {r['threads']} threads")]
    rows += _ratio_rows(r["old"], "old-policy pass") + _ratio_rows(r["anchor"], "anchor pass")
    _emit(r, json_path, rows)


def step(
    preset: PresetOpt = None, set_: SetOpt = None,
    steps: Annotated[int, typer.Option("--steps", help="Timed RL steps (medians are reported).", min=1, max=100_000)] = 3,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed RL steps first.", min=0, max=100_000)] = 1,
    json_path: JsonOpt = None,
    trust_code: TrustOpt = False,
) -> None:
    """Whole RL steps of a preset (e.g. --preset toy), broken into generation, reward, batch, passes, update, EMA; tokens/s.

    Runs in a temporary folder and saves nothing. JSON keys: <phase>_s, other_s, step_s, tokens, tokens_per_s.
    """
    from emapg_cli.bench.step import PHASES, bench_step
    from emapg_cli.hf_quiet import quiet_transformers

    quiet_transformers()  # transformers' own "Loading weights" bar stays out of the table
    if preset is None:
        raise UserError("pass --preset (e.g. --preset toy)")
    _trust(preset, set_ or [], trust_code)
    r = bench_step(preset, set_ or [], steps=steps, warmup=warmup)
    rows = [(p, f"{r[p + '_s']:.3f} s ({100 * r[p + '_s'] / r['step_s']:.0f}%)") for p in (*PHASES, "other")]
    rows += [("step", f"{r['step_s']:.3f} s (median of {steps})"), ("tokens/s", f"{r['tokens_per_s']:.0f}")]
    _emit(r, json_path, rows)


def generate(
    preset: PresetOpt = None, set_: SetOpt = None,
    model: Annotated[Optional[str], typer.Option("--model", help="A saved model folder to sample from instead of the preset's model.path (the preset's prompts, rendered with this model's chat template).")] = None,
    sequences: Annotated[int, typer.Option("--sequences", help="Responses per generation: rollout.n per prompt, over the preset's first training prompts; at most 2^16.", min=1, max=2**16)] = 64,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Tokens per response at most (default: rollout.max_new_tokens), at most 2^16.", min=1, max=2**16)] = None,
    threads: ThreadsOpt = None,
    engine: Annotated[Optional[str], typer.Option("--engine", help="Rollout engine: hf or vllm (default: rollout.engine).")] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="Rounds, each a generation between two GEMM measurements (after one warm-up); the limit is the best measurement, medians are reported.", min=1, max=1000)] = 3,
    until_end: Annotated[bool, typer.Option("--until-end", help="Responses end as in training (end tokens, rollout.stop); default: every response runs to --max-new-tokens, a fixed amount of work (hf engine; vLLM always ends on EOS).")] = False,
    json_path: JsonOpt = None, trust_code: TrustOpt = False,
) -> None:
    """Generated tokens/s of the rollout engine on the preset's prompts against the compute-bound limit.

    The limit is the model's GEMMs measured in the same run: the best GEMM FLOP/s of x @ W^T for every linear layer's
    weight W, x holding one row per sequence (a decode step), over 2 x (the linear layers' parameters) FLOPs
    per token (docs/performance.md); a round above the limit is a warning. The prompts and --max-new-tokens must fit
    the model's context. JSON keys: tokens_per_s, limit_tokens_per_s, ratio, gemm_gflops, params, decode_path,
    every round's values (runs).
    """
    from emapg_cli.bench.generate import bench_generate
    from emapg_cli.hf_quiet import quiet_transformers

    quiet_transformers()
    if preset is None:
        raise UserError("pass --preset (its training prompts are sampled; --model swaps the model)")
    if engine is not None and engine not in ("hf", "vllm"):
        raise UserError(f"--engine must be hf or vllm, not '{engine}'")
    if model is not None and not model.strip():
        raise UserError("--model is empty: pass a saved model folder")
    _check("cpu", "float32", threads)
    _trust(preset, set_ or [], trust_code)
    r = bench_generate(preset, set_ or [], model=model, sequences=sequences, max_new_tokens=max_new_tokens, engine=engine,
                       rounds=rounds, until_end=until_end)
    ratios = ", ".join(f"{x:.2f}" for x in r["ratio_runs"])
    rows = [("model", f"{r['model']} ({r['params'] / 1e6:.1f}M linear parameters, {r['engine']} engine, {r['decode_path']})"),
            ("work", f"{r['prompts']} prompts x {r['n']} samples, {'<= ' if until_end else ''}{r['max_new_tokens']} new tokens, "
                     f"{r['threads']} threads"),
            ("generated", f"{r['tokens_per_s']:.1f} tokens/s ({r['tokens_mean']:.0f} tokens per round, median of {r['rounds']})"),
            ("GEMMs", f"{r['gemm_gflops']:.1f} GFLOP/s at [{r['gemm_rows']}, in] x the model's weights (the best measurement)"),
            ("limit", f"{r['limit_tokens_per_s']:.1f} tokens/s (GEMM FLOP/s / {r['flops_per_token'] / 1e6:.4g} MFLOP per token)"),
            ("ratio", f"{r['ratio']:.2f} of the limit, the median of the rounds ({ratios})"),
            ("load average", f"{r['load_average_before']:.1f} before, {r['load_average_after']:.1f} after")]
    _emit(r, json_path, rows)
    for warning in r["warnings"]:
        typer.echo(f"warning: {warning}", err=True)


app.command("generate")(generate)
app.command("update")(update)
app.command("passes")(passes)
app.command("step")(step)
