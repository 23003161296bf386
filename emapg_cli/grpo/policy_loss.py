"""The PPO clipped surrogate with asymmetric bounds (clip-higher) and dual-clip, per token."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from emapg_cli.kl.common import safe_exp_log_ratio


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: Optional[float] = None,
) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss (to minimise) and the mask of tokens where clipping was active.

    ratio rho = exp(logp - old_logp) (log-ratio clamped as in `kl.common.safe_exp_log_ratio`).
      L = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))    PPO (Schulman et al. 2017, Eq. 7)
                                                                    with DAPO's clip-higher bounds
      for A < 0 and dual_clip = c:  L = min(L, -c A)                 dual-clip PPO (Ye et al. 2020, Eq. 5)
    logp [..] carries the gradient; old_logp [..] and advantages [..] (broadcast to logp) are constants.
    Returns (loss [..] float32, clipped [..] bool) where `clipped` marks tokens whose gradient the
    clip removed (the clipped branch won, or the dual-clip bound).
    """
    logp32 = logp.float()
    adv = advantages.float().detach()
    ratio = safe_exp_log_ratio(logp32 - old_logp.float().detach())  # [..]
    unclipped = -adv * ratio
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped_term = -adv * clipped_ratio
    loss = torch.maximum(unclipped, clipped_term)
    is_clipped = clipped_term > unclipped
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        is_clipped = is_clipped | dual
    return loss, is_clipped
