#!/usr/bin/env python
"""One prepared GPU check of the anchor pass under bf16 autocast (`ema.anchor_autocast`).

    python tests/gpu/gpu_anchor_check.py [--hidden 1024] [--layers 8] [--rows 16] [--len 2048] [--out anchor_check.json]

Builds a random Llama locally (emapg_cli.models.tiny; nothing is downloaded) at the given width,
holds it as the fp32 anchor on the GPU, and runs the trainer's anchor pass (train/passes.py
`reference_passes`, Top-k KL with k 32, and K3) on one random batch, with and without bf16
autocast, interleaved `--repeats` times. Reports, per mode, the median time and the peak GPU
memory, and between the modes the largest |difference| of the anchor log-probs and of the
per-token K3 estimate (against the policy's bf16 log-probs). Exits 1 without CUDA, or when the
autocast log-probs differ by more than `--tol` (bf16 has ~3 significant digits).
Not run in CI: it needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--len", type=int, default=2048, help="response tokens per row")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tol", type=float, default=0.25, help="largest allowed |log-prob difference| (nats)")
    ap.add_argument("--out", default="anchor_check.json")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 1
    from emapg_cli.config import load_config
    from emapg_cli.kl import kl_per_token
    from emapg_cli.models.tiny import build_byte_tokenizer, build_tiny_model
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.passes import reference_passes
    from emapg_cli.train.settings import step_settings
    from emapg_cli.train.rollout import RolloutBatch

    dev = torch.device("cuda")
    tok = build_byte_tokenizer()
    heads = max(1, args.hidden // 64)
    model = build_tiny_model(tok, arch="llama", hidden=args.hidden, layers=args.layers, heads=heads, kv_heads=heads,
                             max_positions=args.len + 64, init_std=0.3)
    anchor = TokenScorer(model.float().to(dev).eval())
    policy = TokenScorer(build_tiny_model(tok, arch="llama", hidden=args.hidden, layers=args.layers, heads=heads,
                                          kv_heads=heads, max_positions=args.len + 64, init_std=0.3).to(dev, torch.bfloat16).eval())
    g = torch.Generator().manual_seed(0)
    p_len, b, r = 32, args.rows, args.len
    ids = torch.randint(3, len(tok), (b, p_len + r), generator=g).to(dev)  # [B, P + R]
    batch = RolloutBatch(ids, torch.ones_like(ids), torch.ones(b, r, dtype=torch.bool, device=dev), p_len,
                         torch.zeros(b, device=dev))

    results = {}
    for estimator in ("topk", "k3"):
        base = ["kl.coef=0.001", f"kl.estimator={estimator}", "kl.k=32", f"train.micro_batch_size={min(8, b)}",
                "rollout.prompts_per_step=1", "rollout.n=1", "train.mini_batch_prompts=1"]
        cfgs = {mode: load_config(overrides=[*base, f"ema.anchor_autocast={mode == 'autocast'}"]) for mode in ("fp32", "autocast")}
        times = {m: [] for m in cfgs}
        peaks, outs = {}, {}
        for _ in range(args.repeats):  # interleaved: both modes see the same machine state
            for mode, cfg in cfgs.items():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                out = reference_passes(policy, anchor, batch, step_settings(cfg, 2**31))  # k = kl.k = 32
                torch.cuda.synchronize()
                times[mode].append(time.perf_counter() - t0)
                peaks[mode] = torch.cuda.max_memory_allocated() / 2**30
                outs[mode] = out
        a, f = outs["autocast"], outs["fp32"]
        logp_diff = float((a.ref_logp - f.ref_logp).abs().max())
        pol = f.old_logp if f.old_logp is not None else f.ref_logp
        k3_a = kl_per_token("k3", "reverse", logp=pol, ref_logp=a.ref_logp)
        k3_f = kl_per_token("k3", "reverse", logp=pol, ref_logp=f.ref_logp)
        results[estimator] = {
            "median_s": {m: statistics.median(v) for m, v in times.items()},
            "speedup": statistics.median(times["fp32"]) / statistics.median(times["autocast"]),
            "peak_gib": peaks,
            "max_abs_ref_logp_diff": logp_diff,
            "max_abs_k3_diff": float((k3_a - k3_f).abs().max()),
        }
        print(f"{estimator}: fp32 {results[estimator]['median_s']['fp32']:.3f} s, autocast "
              f"{results[estimator]['median_s']['autocast']:.3f} s (x{results[estimator]['speedup']:.2f}); "
              f"peak {peaks['fp32']:.2f} / {peaks['autocast']:.2f} GiB; max |d ref_logp| {logp_diff:.3g}")
    ok = all(v["max_abs_ref_logp_diff"] <= args.tol for v in results.values())
    with open(args.out, "w") as fh:
        json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "results": results, "ok": ok}, fh, indent=2)
    print("OK" if ok else f"FAIL: log-prob difference above {args.tol}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
