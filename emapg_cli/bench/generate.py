"""`emapg bench generate`: the rollout engine's generated tokens per second against the compute-bound limit.

A decoder's forward costs about 2 x P FLOPs per token, P = the weights of its linear layers (attention and MLP
projections of every layer, and the output layer, counted once more when it is tied to the embedding: it is a
GEMM all the same). The embedding lookup, norms, rotary embedding, attention's own products (4 x layers x
context x hidden per token: under 5% of 2 P for the 135M model at a 100-token context) and the sampler are
left out: they are the work a perfect engine would still do on top, so the limit is an upper bound.

The limit is measured, not quoted from a datasheet: the GEMMs of one decode step, x [M, in] @ W^T for every
linear layer W of the model (its own weights, in its dtype, as `torch.nn.functional.linear` runs them) with
M = the sequences the engine decodes together, timed in the same process and the same rounds as the
generation. Then

    limit tokens/s = GEMM FLOP/s / (2 P),      ratio = generated tokens/s / limit tokens/s.

Generated tokens/s counts the tokens of the responses (their end token included) over the wall time of the
whole `generate` call: prompt prefill, sampling and all. Rounds alternate a GEMM measurement and a
generation (after one warm-up of each); every round is reported, and the medians; the ratio reported is the
median of the rounds' ratios (each round's generation over its own limit).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Iterable, Optional

from emapg_cli.errors import UserError


def linear_weights(model) -> list:
    """The weight of every `nn.Linear` of `model` ([out, in] each): what a token's forward multiplies by."""
    from torch import nn

    return [m.weight for m in model.modules() if isinstance(m, nn.Linear)]


def gemm_seconds(weights: list, rows: int, passes: int = 3) -> float:
    """Median wall seconds of one pass of x [rows, in] @ W^T over `weights` (one decode step's GEMMs), of `passes`."""
    import torch

    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}  # [M, in]
    times = []
    with torch.inference_mode():
        for _ in range(passes):
            start = time.perf_counter()
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)
            if w.device.type == "cuda":
                torch.cuda.synchronize(w.device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_prompts(cfg, tokenizer, count: int) -> list[list[int]]:
    """The first `count` training prompts of the config, rendered as the trainer renders them (its environment's
    user message, the chat template, data.max_prompt_tokens)."""
    from emapg_cli.datasets.loading import load_examples
    from emapg_cli.train.rollout import prepare_prompts
    from emapg_cli.train.trainer import make_env

    if not cfg.data.train:
        raise UserError("the preset has no data.train to take prompts from")
    env = make_env(cfg, tokenizer)
    try:
        _, prompts, _ = prepare_prompts(tokenizer, load_examples(cfg.data.train), cfg.data.max_prompt_tokens, env.user_message(),
                                        cfg.data.prefix_messages())
    finally:
        env.close()
    if len(prompts) < count:
        raise UserError(f"{cfg.data.train} has {len(prompts)} usable prompts; {count} are needed")
    return prompts[:count]


def bench_generate(preset: str, overrides: Iterable[str] = (), *, model: Optional[str] = None, sequences: int = 64,
                   max_new_tokens: Optional[int] = None, engine: Optional[str] = None, rounds: int = 3,
                   until_end: bool = False, seed: int = 0) -> dict[str, Any]:
    """Generate `sequences` responses (rollout.n per prompt) `rounds` times with the preset's rollout engine, each
    after a measurement of the model's GEMMs at the decode batch; returns the medians, the runs and the ratio.

    `until_end` False: every response runs to `max_new_tokens` (no end token, no stop string: a fixed amount of work,
    as throughput benchmarks ignore EOS); True: responses end as in training (hf only: vLLM always ends on EOS)."""
    from emapg_cli.config.loading import load_config
    from emapg_cli.engines import make_engine, resolve_backend
    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.models.loading import load_causal_lm, load_tokenizer
    from emapg_cli.paths import expand
    from emapg_cli.train.checks import missing_inputs

    cfg = load_config(preset, overrides=[*overrides, *([f"model.path={model}"] if model else [])])
    r = cfg.rollout
    n = min(r.n, sequences)
    if sequences % n:
        raise UserError(f"--sequences {sequences} is not a multiple of rollout.n ({n})")
    missing = [line for line in missing_inputs(cfg) if not line.startswith("data.eval")]  # evaluation is not run here
    if missing:
        raise UserError(missing[0])
    backend = resolve_backend(engine or r.engine)
    if backend == "vllm":  # installed, on a platform it runs on, before any weights load
        from emapg_cli.engines.vllm import vllm_device

        vllm_device()
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
    prompts = bench_prompts(cfg, tokenizer, sequences // n)
    new = max_new_tokens or r.max_new_tokens
    eng = make_engine(backend, cfg.model.path, seed=cfg.train.seed, dtype=cfg.model.dtype,
                      max_model_len=max(len(p) for p in prompts) + new, trust_remote_code=cfg.model.trust_remote_code,
                      batch_size=r.hf_batch_size, share_prompts=cfg.train.share_prompts != "never",
                      fast_decode=r.hf_fast_decode, attention=r.hf_attention, temperature=r.temperature, top_p=r.top_p,
                      end_token_ids=None if until_end else ())
    lm = getattr(eng, "model", None)
    if lm is None:  # an engine with weights of its own: the same model's GEMMs, loaded here
        lm = load_causal_lm(cfg.model.path, cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    weights = linear_weights(lm)
    params_n = sum(w.numel() for w in weights)
    rows = min(sequences, r.hf_batch_size) if backend == "hf" else sequences
    params = SamplingParams(n=n, max_new_tokens=new, temperature=r.temperature, top_p=r.top_p,
                            stop=tuple(r.stop) if until_end else (), seed=seed)
    load_before = os.getloadavg()
    eng.generate(prompts, SamplingParams(n=n, max_new_tokens=min(2, new), temperature=r.temperature, seed=seed))  # warm-up
    gemm_seconds(weights, rows, passes=1)
    runs = []
    for _ in range(rounds):
        g = gemm_seconds(weights, rows)
        start = time.perf_counter()
        groups = eng.generate(prompts, params)
        wall = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for group in groups for c in group)
        runs.append({"gemm_s": g, "generate_s": wall, "tokens": tokens})
    return _summary(runs, rows, params_n, dict(
        preset=preset, model=str(expand(cfg.model.path)), engine=backend, decode_path=getattr(eng, "decode_path", backend),
        attention=r.hf_attention if backend == "hf" else None,
        sequences=sequences, until_end=until_end, prompts=len(prompts), n=n, max_new_tokens=new, temperature=r.temperature, top_p=r.top_p,
        prompt_tokens_mean=statistics.mean(len(p) for p in prompts), rounds=rounds, threads=_threads(),
        load_average_before=load_before[0], load_average_after=os.getloadavg()[0]))


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _summary(runs: list[dict], rows: int, params_n: int, info: dict[str, Any]) -> dict[str, Any]:
    """Per-round and median tokens/s, GEMM FLOP/s, limit and ratio (`bench_generate`'s result)."""
    flops_token = 2.0 * params_n
    for run in runs:
        run["gemm_gflops"] = flops_token * rows / run["gemm_s"] / 1e9
        run["limit_tokens_per_s"] = run["gemm_gflops"] * 1e9 / flops_token
        run["tokens_per_s"] = run["tokens"] / run["generate_s"]
        run["ratio"] = run["tokens_per_s"] / run["limit_tokens_per_s"]
    med = {key: statistics.median(run[key] for run in runs) for key in ("tokens_per_s", "limit_tokens_per_s", "gemm_gflops")}
    # the ratio is the median of the rounds' own ratios: each round's generation is measured beside its own GEMM
    # measurement, and a noisy machine moves both (a ratio of the two medians mixes rounds)
    out = {**med, "ratio": statistics.median(run["ratio"] for run in runs), "ratio_runs": [run["ratio"] for run in runs],
           "params": params_n, "flops_per_token": flops_token, "gemm_rows": rows,
           "tokens_mean": statistics.mean(run["tokens"] for run in runs), "runs": runs, **info}
    return out
