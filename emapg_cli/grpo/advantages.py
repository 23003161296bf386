"""GRPO advantages: each response's reward relative to its group (DeepSeekMath, Shao et al. 2024, Eq. 3)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AdvNorm = Literal["group", "batch", "none"]


def grpo_advantages(rewards: Tensor, norm: AdvNorm = "group", eps: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean_group(r)) / (std + eps), one value per response.

    rewards: [G, n] (G groups of n responses to the same prompt). Returns [G, n] float32.
      norm="group": std is the group's (unbiased, n-1 in the denominator).
      norm="batch": std is the whole batch's (unbiased), the mean is still the group's.
      norm="none":  no std scaling: A_i = r_i - mean_group(r)  (Dr. GRPO, Liu et al. 2025).
    eps keeps a group whose responses all scored the same at A = 0 instead of 0/0.
    A group of one response (n = 1) has no baseline: its advantage is the raw reward, A = r, under
    every `norm` (as verl's GRPO, which the paper's code runs, sets mean 0 and std 1 for a group of one).
    """
    r = rewards.float()
    if r.shape[1] == 1:
        return r.clone()  # [G, 1]
    centred = r - r.mean(dim=1, keepdim=True)  # [G, n]
    if norm == "none":
        return centred
    if norm == "group":
        std = r.std(dim=1, keepdim=True)  # [G, 1] (n > 1 here)
    elif norm == "batch":
        std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
    else:
        raise ValueError(f"unknown advantage normalisation '{norm}' (group, batch, none)")
    return centred / (std + eps)
