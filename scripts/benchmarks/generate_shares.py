"""Each speed-up's share of the hf engine's generation: the same prompts and seeds through five variants of the engine,
in interleaved rounds, each round after a measurement of the model's GEMMs at the decode batch (the compute-bound
limit of `emapg bench generate`). Prints every round and the medians; the samples of every variant are compared with
the first variant's, tokens and log-probs bit for bit, and where they differ, by how much (how many responses have
other tokens, from which position, the largest log-prob difference where the tokens still agree).

Variants (each adds one thing to the one before):
  generate      transformers' generate with the seeded sampler as a logits processor (prompts shared)
  loop          emapg's decode loop (engines/hf_decode.py) with transformers' growing cache, no row leaves the batch
  prealloc      + the preallocated key/value cache
  compact       + rows that end leave the batch (the default engine)
  no-share      the default engine without prompt sharing (every row prefills its own prompt)

    python scripts/benchmarks/generate_shares.py --preset toy --model MODEL --sequences 64 --max-new-tokens 32 --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager

from emapg_cli.bench.generate import differences


@contextmanager
def variant(name: str):
    """Patch the decode loop for `name` (the growing cache and no compaction for `loop`, no compaction for
    `prealloc`), restored after."""
    from transformers.cache_utils import DynamicCache

    from emapg_cli.engines import hf_decode

    saved = hf_decode.MIN_ROWS, hf_decode.preallocated_cache
    if name in ("loop", "prealloc"):
        hf_decode.MIN_ROWS = 10**9  # the batch never shrinks
    if name == "loop":
        hf_decode.preallocated_cache = lambda layers, capacity, prefilled=None: prefilled if prefilled is not None else DynamicCache()
    try:
        yield
    finally:
        hf_decode.MIN_ROWS, hf_decode.preallocated_cache = saved


def main() -> None:
    import torch

    from emapg_cli.bench.generate import bench_prompts, gemm_seconds, linear_weights
    from emapg_cli.config.loading import load_config
    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.engines.hf import HFEngine
    from emapg_cli.hf_quiet import quiet_transformers
    from emapg_cli.models.loading import load_causal_lm, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--model", help="model folder (default: the preset's model.path)")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="generate,loop,prealloc,compact,no-share")
    parser.add_argument("--fixed-length", action="store_true",
                        help="every response runs to --max-new-tokens (no end token), as `emapg bench generate` runs")
    parser.add_argument("--prompt-repeat", type=int, default=1,
                        help="each prompt's tokens but the last, K times over: longer prompts, the same groups")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    quiet_transformers()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.preset, overrides=[f"model.path={args.model}"] if args.model else [])
    tok = load_tokenizer(cfg.model.path)
    lm = load_causal_lm(cfg.model.path, "float32").eval()
    n = cfg.rollout.n
    prompts = [p[:-1] * args.prompt_repeat + p[-1:] for p in bench_prompts(cfg, tok, args.sequences // n)]
    params = SamplingParams(n=n, max_new_tokens=args.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, seed=0)
    weights = linear_weights(lm)
    flops_token = 2.0 * sum(w.numel() for w in weights)  # per token (docs/performance.md)
    names = args.variants.split(",")
    engines = {v: HFEngine(lm, tok, fast_decode=v != "generate", share_prompts=v != "no-share",
                           end_token_ids=() if args.fixed_length else None)
               for v in names}
    with variant(names[0]):
        engines[names[0]].generate(prompts, SamplingParams(n=n, max_new_tokens=2, seed=0))  # warm-up
    rows: dict[str, list[dict]] = {v: [] for v in names}
    samples: dict[str, list] = {}
    for r in range(args.rounds):
        for v in names:
            limit = args.sequences / gemm_seconds(weights, args.sequences)  # tokens/s at the GEMMs' FLOP/s
            with variant(v):
                start = time.perf_counter()
                out = engines[v].generate(prompts, params)
                wall = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for g in out for c in g)
            samples[v] = [(c.token_ids, c.logprobs) for g in out for c in g]  # tokens and log-probs, compared exactly
            rows[v].append({"tokens_per_s": tokens / wall, "limit_tokens_per_s": limit, "ratio": tokens / wall / limit,
                            "tokens": tokens, "wall_s": wall})
            print(f"round {r + 1} {v:>9}: {tokens / wall:7.1f} tokens/s, limit {limit:7.1f}, ratio {tokens / wall / limit:.3f}",
                  flush=True)
    same = {v: samples[v] == samples[names[0]] for v in names}
    diffs = {v: differences(samples[names[0]], samples[v]) for v in names}
    summary = {v: {k: statistics.median(x[k] for x in rows[v]) for k in ("tokens_per_s", "limit_tokens_per_s", "ratio")}
               for v in names}
    for v in names:
        s = summary[v]
        # the speed-up over the first variant, round by round (interleaved: each pair ran side by side)
        speedups = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(rows[v], rows[names[0]])]
        s["speedup_median"], s["speedup_min"] = statistics.median(speedups), min(speedups)
        print(f"median {v:>9}: {s['tokens_per_s']:7.1f} tokens/s ({s['speedup_median']:.2f}x {names[0]}, round by round: "
              f"{', '.join(f'{x:.2f}' for x in speedups)}), ratio {s['ratio']:.3f}, same samples as {names[0]}: {same[v]}")
        if not same[v]:
            d = diffs[v]
            print(f"    {v}: {d['differing_tokens']} of {d['responses']} responses have other tokens (first at token "
                  f"{d['first_divergence']}); largest |log-prob difference| where the tokens agree {d['max_abs_dlogp']:.2e}")
    print(f"GEMM FLOPs per token {flops_token / 1e6:.1f}M, {args.sequences} sequences of {len(prompts[0])}-token prompts, "
          f"{args.threads} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rows, "median": summary, "same_samples": same, "differences": diffs, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
