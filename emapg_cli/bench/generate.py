"""`emapg bench generate`: the rollout engine's generated tokens per second against the compute-bound limit.

A decoder's forward costs about 2 x P FLOPs per token, P = the weights of its linear layers (attention and MLP
projections of every layer, and the output layer, counted once more when it is tied to the embedding: it is a
GEMM all the same). The embedding lookup, norms, rotary embedding, attention's own products (4 x layers x
context x hidden per token: under 5% of 2 P for the 135M model at a 100-token context) and the sampler are
left out: they are the work a perfect engine would still do on top, so the limit is an upper bound.

The limit is measured, not quoted from a datasheet: the GEMMs of one decode step, x [M, in] @ W^T for every
linear layer W of the model (its own weights, in its dtype, as `torch.nn.functional.linear` runs them) with
M = the sequences the engine decodes together, timed in the same process, interleaved with the generation: before
and after every round, each time the best (fastest) of GEMM_PASSES passes (noise only ever slows a pass), and the
limit is the best of all of them, so a busy moment cannot lower it. Then

    limit tokens/s = GEMM FLOP/s / (2 P),      ratio = generated tokens/s / limit tokens/s.

Generated tokens/s counts the tokens of the responses (their end token included) over the wall time of the
whole `generate` call: prompt prefill, sampling and all. Rounds alternate GEMM measurements and a
generation (after one warm-up of each); every round is reported, and the medians; the ratio reported is the
median of the rounds' ratios (each round's generation over the limit). A round above 1.0 is impossible for a real
limit: it comes back as a warning (`warnings`) saying the GEMM measurement was undercut.
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


#: GEMM passes per measurement; the fastest counts.
GEMM_PASSES = 7


def gemm_seconds(weights: list, rows: int, passes: int = GEMM_PASSES) -> float:
    """Least wall seconds of one pass of x [rows, in] @ W^T over `weights` (one decode step's GEMMs), of `passes`."""
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
    return min(times)


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
    import torch

    from emapg_cli.config.loading import load_config
    from emapg_cli.engines import make_engine, resolve_backend
    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.models.loading import load_causal_lm, load_tokenizer
    from emapg_cli.paths import expand
    from emapg_cli.train.preflight import missing_inputs

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
    check_context(cfg.model.path, cfg.model.trust_remote_code, max(len(p) for p in prompts), new)
    eng = make_engine(backend, cfg.model.path, seed=cfg.train.seed, dtype=cfg.model.dtype,
                      max_model_len=max(len(p) for p in prompts) + new, trust_remote_code=cfg.model.trust_remote_code,
                      batch_size=r.hf_batch_size, share_prompts=cfg.train.share_prompts != "never",
                      fast_decode=r.hf_fast_decode, temperature=r.temperature, top_p=r.top_p,
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
        runs.append({"gemm_s": min(g, gemm_seconds(weights, rows)), "generate_s": wall, "tokens": tokens})  # before, after
    return _summary(runs, rows, params_n, dict(
        preset=preset, model=str(expand(cfg.model.path)), engine=backend, decode_path=getattr(eng, "decode_path", backend),
        sequences=sequences, until_end=until_end, prompts=len(prompts), n=n, max_new_tokens=new, temperature=r.temperature, top_p=r.top_p,
        prompt_tokens_mean=statistics.mean(len(p) for p in prompts), rounds=rounds, threads=torch.get_num_threads(),
        load_average_before=load_before[0], load_average_after=os.getloadavg()[0]))


def differences(a: list, b: list) -> dict:
    """How two variants' samples differ: responses whose tokens differ, the first position where they do (the
    earliest over responses), and the largest |log-prob difference| over the positions where both responses still
    agree token for token (0.0 when every log-prob is bit-identical)."""
    differing, first, max_dlogp = 0, None, 0.0
    for (ta, la), (tb, lb) in zip(a, b):
        agree = 0
        while agree < min(len(ta), len(tb)) and ta[agree] == tb[agree]:
            agree += 1
        if list(ta) != list(tb):
            differing += 1
            first = agree if first is None else min(first, agree)
        max_dlogp = max([max_dlogp, *(abs(x - y) for x, y in zip(la[:agree], lb[:agree]))])
    return {"responses": len(a), "differing_tokens": differing, "first_divergence": first, "max_abs_dlogp": max_dlogp}


def check_context(path: str, trust_remote_code: bool, prompt_tokens: int, new: int) -> None:
    """The longest prompt and `new` tokens fit the model's context (its config's max_position_embeddings), else one line."""
    from transformers import AutoConfig

    from emapg_cli.models.folder import loading
    from emapg_cli.models.loading import model_ref

    with loading(path):  # model_ref: a preset's `$EMAPG_HOME/smol/model` expanded, as the engines load it
        context = getattr(AutoConfig.from_pretrained(model_ref(path), trust_remote_code=trust_remote_code),
                          "max_position_embeddings", None)
    if isinstance(context, int) and prompt_tokens + new > context:
        raise UserError(f"--max-new-tokens {new}: the longest prompt ({prompt_tokens} tokens) and {new} new tokens need "
                        f"{prompt_tokens + new} positions, past the model's context of {context} (max_position_embeddings); "
                        f"give at most {max(context - prompt_tokens, 0)}")


def _summary(runs: list[dict], rows: int, params_n: int, info: dict[str, Any]) -> dict[str, Any]:
    """Per-round tokens/s and GEMM FLOP/s, the limit (the best GEMM measurement of all rounds: noise only slows one),
    each round's ratio against it, their median, and a warning per round above 1.0 (`bench_generate`'s result)."""
    flops_token = 2.0 * params_n
    limit = rows / min(run["gemm_s"] for run in runs)  # GEMM FLOP/s / (2 P) = (2 P rows / s) / (2 P)
    for run in runs:
        run["gemm_gflops"] = flops_token * rows / run["gemm_s"] / 1e9
        run["tokens_per_s"] = run["tokens"] / run["generate_s"]
        run["ratio"] = run["tokens_per_s"] / limit
    warnings = [f"round {i} generated {run['ratio']:.2f} of the limit, above 1.0: the GEMM measurement was undercut (a busy "
                "machine?), so the limit and ratios are not trustworthy" for i, run in enumerate(runs, 1) if run["ratio"] > 1.0]
    return {"tokens_per_s": statistics.median(run["tokens_per_s"] for run in runs), "limit_tokens_per_s": limit,
            "gemm_gflops": limit * flops_token / 1e9, "ratio": statistics.median(run["ratio"] for run in runs),
            "ratio_runs": [run["ratio"] for run in runs], "warnings": warnings, "params": params_n, "flops_per_token": flops_token,
            "gemm_rows": rows, "tokens_mean": statistics.mean(run["tokens"] for run in runs), "runs": runs, **info}
