#!/usr/bin/env python
"""One prepared GPU check of float32 master weights (model.master_weights) at the olympiad preset's model size.

    python tests/gpu/gpu_master_weights_check.py [--steps 3] [--rows 16] [--len 1024] [--lr 1e-6] [--out master_weights_gpu.json]
    python tests/gpu/gpu_master_weights_check.py --device cpu --tiny      # the same logic on a tiny model (no GPU)

A `--device cpu --tiny` run's output is kept in docs/evidence/master_weights_gpu.json (the logic checked, no GPU numbers).

Builds DeepSeek-R1-Distill-Qwen-1.5B's architecture (its shapes from train/plan.py KNOWN_MODELS; random
weights, nothing is downloaded) on the device and runs `--steps` policy updates of the trainer
(train/update.py `update_policy`, the olympiad preset's loss: PPO-clip, seq-mean-token-mean, AdamW at
`--lr`, grad clip 1.0) on one fixed random batch, in two modes from the same initial weights:

    master   float32 parameters, gradients and AdamW state; forward/backward under bf16 autocast
    lossy    bf16 parameters updated in place (model.master_weights=false)

and reports per mode: ||theta - theta_0|| (theta_0 as the mode holds it: rounded to bf16 for lossy), the
fraction of weights that changed at all, the cosine between the two modes' deltas, seconds per step and
peak GPU memory; plus the log-prob difference of each mode's bf16 pass from a float32 pass of the same
weights (the size of bf16 compute's own error, against which rollout/trainer mismatches compare), and the
first step's layout checks (packed / shared-prompt passes vs the padded one, which the trainer refuses
above 1e-4 nats: master weights are checked in float32, bf16 weights in bf16).
The batch's `sampling_logp` is the initial float32 pass perturbed by N(0, 0.05) nats, standing in for a
rollout engine's records, so `train.rollout_correction` (when the trainer has it) has something to weight;
`rollout/is_*` are the olympiad preset's vLLM default correction (token_truncate, cap 2) on those records.
One JSON summary on stdout (and in --out). Exits 1 without CUDA (unless --device cpu), or when the master
mode moved the weights less than `--min-ratio` x the expected lr x steps scale (see `passed`).
About 1-2 minutes on one H200 at the defaults (the model is ~1.78B parameters: 28 GiB for master weights).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time


def _rollout_is_metrics(stats) -> dict[str, float]:
    """The rollout-correction metrics of one update (`rollout/is_ratio_mean`, `rollout/is_ratio_max`,
    `rollout/is_clipped_frac`: train/metrics.py rollout_correction_metrics over UpdateStats.correction); {} when
    the update corrected nothing (train.rollout_correction=none)."""
    from emapg_cli.train.metrics import rollout_correction_metrics

    return {k: float(v) for k, v in rollout_correction_metrics(stats.correction).items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen2 instead of the 1.5B shapes (CPU smoke test)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=16, help="sequences in the batch (4 groups of 4 at the default)")
    ap.add_argument("--len", type=int, default=1024, help="response tokens per row (the prompt is 128)")
    ap.add_argument("--lr", type=float, default=1e-6, help="olympiad's optim.lr")
    ap.add_argument("--min-ratio", type=float, default=0.5)
    ap.add_argument("--out", default="master_weights_gpu.json")
    args = ap.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (or --device cpu --tiny)", file=sys.stderr)
        return 1
    from accelerate import Accelerator
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from emapg_cli.config import load_config
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.parallel import Replicated
    from emapg_cli.train.passes import check_layouts
    from emapg_cli.train.plan import KNOWN_MODELS
    from emapg_cli.train.rollout import RolloutBatch
    from emapg_cli.train.settings import step_settings
    from emapg_cli.train.update import update_policy

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    m = KNOWN_MODELS["deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"]
    shapes = dict(hidden_size=m.hidden, num_hidden_layers=m.layers, num_attention_heads=m.heads,
                  num_key_value_heads=m.kv_heads, head_dim=m.head_dim, intermediate_size=m.intermediate,
                  vocab_size=m.vocab, tie_word_embeddings=m.tie_embeddings)
    if args.tiny:
        shapes.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=512)
    p_len = 128 if not args.tiny else 8
    r_len = args.len if not args.tiny else min(args.len, 16)
    config = Qwen2Config(**shapes, max_position_embeddings=p_len + r_len + 8, use_cache=False)
    n = 4
    rows = max(n, args.rows // n * n)
    # the olympiad preset's loss and optimizer, at this batch: one optimizer step per update, 4 rows per micro-batch
    cfg = load_config("olympiad", overrides=[
        f"rollout.n={n}", f"rollout.prompts_per_step={rows // n}", f"train.mini_batch_prompts={rows // n}",
        "train.micro_batch_size=4", "kl.coef=0", f"optim.lr={args.lr}", "rollout.max_new_tokens=1024",
        "data.max_prompt_tokens=1024", "train.share_prompts=never", "train.pack_sequences=never"])

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(dev):
        init_model = Qwen2ForCausalLM(config).float()  # random init, float32: theta_0
    init_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    init = {k: v.detach().clone() for k, v in init_model.state_dict().items()}
    build_s = time.perf_counter() - t0

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (rows, p_len + r_len), generator=g)  # [B, P + R]
    ids[:, :p_len] = ids[::n, :p_len].repeat_interleave(n, 0)  # GRPO groups: n rows share each prompt
    ids = ids.to(dev)
    adv = torch.randn(rows, generator=g).to(dev)  # [B] stand-in GRPO advantages
    batch = RolloutBatch(ids, torch.ones_like(ids), torch.ones(rows, r_len, dtype=torch.bool, device=dev), p_len, adv)
    with torch.no_grad():  # the float32 pass of theta_0, and an "engine" that differs from it by noise
        fp32_logp = TokenScorer(init_model.eval())(ids, batch.attention_mask, p_len, batch.response_mask, entropy=False).logp
    noise = torch.randn(rows, r_len, generator=g).to(dev) * 0.05
    batch = batch.with_(sampling_logp=fp32_logp + noise)

    acc = Accelerator(cpu=not cuda)
    results, deltas = {}, {}
    for mode in ("master", "lossy"):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        init_model.load_state_dict(init)  # theta_0 again (the master mode trained init_model in place)
        model = init_model if mode == "master" else init_model.to(torch.bfloat16)  # lossy: theta_0 rounded to bf16
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        compute = torch.bfloat16 if mode == "master" else None
        strategy = Replicated(acc)
        scorer, _, opt = strategy.wrap(model, None, lambda params: torch.optim.AdamW(
            params, lr=args.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay),
            compute_dtype=compute)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
        with torch.no_grad():  # this mode's bf16 pass of theta_0 against the float32 one
            scorer.eval()
            logp = scorer(ids, batch.attention_mask, p_len, batch.response_mask, entropy=False).logp
        # the first step's layout checks (train/passes.py check_layouts, tolerance 1e-4 nats): packed and
        # shared-prompt passes against the padded one, as this mode computes them (and, for master weights, in
        # float32, which is how the trainer checks them)
        layouts = {"compute": check_layouts(scorer, batch, 1.0, "always", "always", tol=math.inf)}
        if compute is not None:
            with scorer.float32_passes():
                layouts["float32"] = check_layouts(scorer, batch, 1.0, "always", "always", tol=math.inf)
        times, is_metrics, grad_norms = [], {}, []
        scorer.train()
        for step in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            stats = update_policy(strategy, scorer, batch, step_settings(cfg, 2**31), opt, sched, torch.Generator().manual_seed(step))
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            grad_norms += stats.grad_norm
            is_metrics = _rollout_is_metrics(stats) or is_metrics
        final = model.state_dict()
        # per-tensor float32 deltas (a concatenated float64 copy of 1.78B weights would take 14 GiB)
        deltas[mode] = [(final[k].float() - start[k].float()).flatten() for k in sorted(start) if start[k].is_floating_point()]
        norm = math.sqrt(sum(float(d.double().square().sum()) for d in deltas[mode]))
        changed = sum(int((d != 0).sum()) for d in deltas[mode]) / sum(d.numel() for d in deltas[mode])
        results[mode] = {
            "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "delta_norm": norm,
            "changed_fraction": changed,
            "logprob_abs_diff_vs_fp32_max": float((logp - fp32_logp).abs().max()),
            "logprob_abs_diff_vs_fp32_mean": float((logp - fp32_logp).abs().mean()),
            "layout_diff_nats": layouts,
            "grad_norm": grad_norms,
            "s_per_step": times,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "rollout_is": is_metrics,
        }
        del scorer, opt, sched, start, final
    params = sum(t.numel() for t in init.values() if t.is_floating_point())
    # AdamW's first steps move every weight by about lr each (m / sqrt(v) ~ +-1): ||delta|| ~ lr x steps x sqrt(P)
    # for consistent signs, lr x sqrt(steps x P) for random ones; the master run must reach a fair share of the latter
    scale = args.lr * math.sqrt(args.steps * params)
    ratio = results["lossy"]["delta_norm"] / results["master"]["delta_norm"]
    summary = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": "tiny qwen2" if args.tiny else "DeepSeek-R1-Distill-Qwen-1.5B shapes (random init)",
        "params": params, "rows": rows, "prompt_len": p_len, "response_len": r_len, "steps": args.steps, "lr": args.lr,
        "build_s": build_s, "modes": results,
        "lossy_over_master_delta": ratio,
        "cosine_master_lossy": sum(float((a.double() * b.double()).sum()) for a, b in zip(deltas["master"], deltas["lossy"]))
        / max(results["master"]["delta_norm"] * results["lossy"]["delta_norm"], 1e-30),
        "random_sign_scale": scale,
        "passed": results["master"]["delta_norm"] >= args.min_ratio * scale,
    }
    text = json.dumps(summary)
    with open(args.out, "w") as f:
        f.write(json.dumps(summary, indent=2) + "\n")
    print(text)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
