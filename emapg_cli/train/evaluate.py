"""Accuracy of a model on the evaluation set during training: generate, score, count reward > 0.5."""

from __future__ import annotations

import torch

from emapg_cli.engines.base import SamplingParams
from emapg_cli.train.rollout import score


def evaluate(engine, prompts: list[list[int]], examples: list, reward_fn, params: SamplingParams, accelerator,
             truncated: str = "zero") -> float:
    """Fraction of (item, sample) pairs scoring > 0.5, over all ranks (each rank takes every world-th item).

    `truncated`: `zero` scores a response cut at the token cap 0 (reward.truncated)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(prompts), world))
    correct = total = 0
    # every rank calls generate, even with no items: a sharded engine gathers weights collectively
    groups = engine.generate([prompts[i] for i in mine], params)
    if mine:
        completions = [c for g in groups for c in g]
        exs = [examples[i] for i in mine for _ in range(params.n)]
        rewards, _ = score(reward_fn, completions, exs, shaping={"truncated": truncated})
        correct, total = sum(r > 0.5 for r in rewards), len(rewards)
    counts = torch.tensor([float(correct), float(total)], device=accelerator.device)
    if world > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    return float(counts[0] / counts[1]) if counts[1] > 0 else float("nan")
