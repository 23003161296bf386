"""The namespaced metrics of one RL step, assembled from the rollout and update statistics (writing is in loggers.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from emapg_cli.train.update import UpdateStats


@dataclass
class StepResult:
    """What one RL step (`Trainer.step`) returns."""

    metrics: dict[str, Any]  # its metrics.jsonl row (`step_metrics`, the engine mismatch, filter and environment counters)
    skipped: int  # optimizer steps skipped for a non-finite loss or gradient
    phase_s: dict[str, float]  # wall seconds: generation, batch, passes, reward, update, ema; totals rollout, update_total
    response_tokens: int  # tokens of this rank's responses


def mean(values: list[float]) -> float:
    """Arithmetic mean; NaN for an empty list."""
    return sum(values) / len(values) if values else math.nan


def step_metrics(*, rewards: Tensor, reward_errors: int, response_lens: list[int], truncated: int, max_new_tokens: int,
                 upd: UpdateStats, beta: float, lr: float, t_rollout: float, t_update: float,
                 skipped_total: int, ema_distance: float | None) -> dict[str, Any]:
    """metrics.jsonl row of one step (without `step`). rewards: [G, n], all ranks."""
    tokens = sum(response_lens)
    kl = mean(upd.kl)
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/errors": float(reward_errors),
        "rollout/response_len": tokens / max(len(response_lens), 1),
        "rollout/truncated_frac": truncated / max(len(response_lens), 1),
        "rollout/max_new_tokens": float(max_new_tokens),
        "loss/pg": mean(upd.pg),
        "loss/kl": beta * kl if beta > 0 else 0.0,
        "clip/frac": upd.clipped_tokens / max(upd.tokens, 1.0),
        "entropy": upd.entropy_sum / max(upd.tokens, 1.0),
        "grad/norm": mean(upd.grad_norm),
        "lr": lr,
        "time/rollout": t_rollout,
        "time/update": t_update,
        "throughput/tokens_per_s": tokens / max(t_rollout + t_update, 1e-9),
        "steps/skipped": float(skipped_total),
    }
    if beta > 0:
        out["kl/value"] = kl
        out["kl/coef"] = beta  # the beta this step's loss used (kl.coef, or the adaptive beta of kl.target)
        # per token whatever train.loss_agg: the mean over the trained sequences of each one's mean KL estimate over its
        # tokens (verl's current_kl; all ranks; every epoch), what adaptive beta tracks
        out["kl/per_token"] = upd.kl_seq_sum / upd.kl_seqs if upd.kl_seqs else math.nan
    if ema_distance is not None:
        out["ema/distance"] = ema_distance
    out.update(rollout_correction_metrics(upd.correction))
    if "dkl" in upd.distill:  # train.objective distill / rl+distill: per-token means over this process's tokens
        out["distill/kl"] = upd.distill["dkl"] / max(upd.tokens, 1.0)
        out["distill/entropy"] = out["entropy"]
        if "tail" in upd.distill:
            out["distill/tail_mass"] = upd.distill["tail"] / max(upd.tokens, 1.0)
    return out


def rollout_mismatch(diff: Tensor | None) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the trainer's: diff [tokens] = trainer - engine.

    diff holds, for every real response token, the trainer's log-prob of the sampled token under
    the weights that sampled it (the old-policy pass, or the first update pass when that pass is
    skipped) minus the engine's own (`Completion.logprobs`). Returns {} without tokens. Keys:
    `rollout/logprob_abs_diff` (mean |diff|), `rollout/logprob_max_abs_diff`, and
    `rollout/ratio_mean` (mean pi_trainer / pi_engine, 1 for a perfect match). In float32 on CPU
    vLLM and transformers agree to ~1e-5 (tests/test_vllm_cpu.py); bf16 on a GPU is far looser.
    """
    if diff is None or diff.numel() == 0:
        return {}
    diff = diff.double()
    return {
        "rollout/logprob_abs_diff": float(diff.abs().mean()),
        "rollout/logprob_max_abs_diff": float(diff.abs().max()),
        "rollout/ratio_mean": float(diff.exp().mean()),
    }


def rollout_correction_metrics(stats) -> dict[str, float]:
    """`rollout/is_ratio_mean`, `rollout/is_ratio_max`: rho = pi_old / pi_engine before truncation or masking, over
    the policy's tokens (token modes) or sequences (sequence modes, the geometric mean per sequence);
    `rollout/is_clipped_frac`: the fraction of them truncated or masked (`grpo.rollout_correction`). This process's
    rollouts; {} with train.rollout_correction=none or without tokens."""
    if stats is None or float(stats.count) == 0:
        return {}
    return {
        "rollout/is_ratio_mean": float(stats.ratio_mean),
        "rollout/is_ratio_max": float(stats.ratio_max),
        "rollout/is_clipped_frac": float(stats.clipped_frac),
    }


def reward_by_source(rewards: list[float], examples: list) -> dict[str, float]:
    """`reward/source/{source}`: mean reward of the responses to each data source's examples (this process's)."""
    sums: dict[str, list[float]] = {}
    for r, ex in zip(rewards, examples):
        sums.setdefault(ex.source or "unknown", []).append(r)
    return {f"reward/source/{name}": mean(values) for name, values in sorted(sums.items())}
