"""The namespaced metrics of one RL step, assembled from the rollout and update statistics (writing is in loggers.py)."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from emapg_cli.train.update import UpdateStats


def mean(values: list[float]) -> float:
    """Arithmetic mean; NaN for an empty list."""
    return sum(values) / len(values) if values else math.nan


def step_metrics(*, rewards: Tensor, reward_errors: int, response_lens: list[int], truncated: int,
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
    if ema_distance is not None:
        out["ema/distance"] = ema_distance
    return out
