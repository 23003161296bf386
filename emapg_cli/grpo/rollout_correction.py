"""Rollout correction: importance weights between the trainer's old policy and what the rollout engine sampled.

The engine (vLLM) samples with its own kernels, so its log-probs of the sampled tokens, l_s = log pi_engine(y_t),
differ from the trainer's old-policy log-probs l_old = log pi_old(y_t) under the same weights: "on-policy" GRPO
is off-policy by the ratio rho = pi_old / pi_engine. The correction weights the policy-gradient term of each
token by sg(w), w a truncated or masked rho (Ionides 2008's truncated importance sampling; Yao et al. 2025,
"Your efficient RL framework secretly brings you off-policy RL training", for the rollout/trainer mismatch):

  token level     log rho_t = l_old,t - l_s,t                                    per token
  sequence level  log rho_i = mean_{t in mask_i} (l_old,t - l_s,t)               geometric mean over the
                                                                                 sequence's tokens, given to
                                                                                 each of them
  *_truncate      w = min(rho, cap)
  *_mask          w = rho if 1/cap <= rho <= cap else 0

Sources: TRL's GRPOTrainer (`vllm_importance_sampling_mode`, cap 2.0) and verl's `algorithm.rollout_correction`;
docs/rollout_correction.md maps their names onto these modes. Two deviations, on purpose: the sequence level uses the
geometric mean, not their product exp(sum_t log rho_t), which over thousands of tokens drifts to 0 or to the cap by
length alone; *_mask keeps the band [1/cap, cap] (verl's rejection sampling), where TRL's zeroes only rho > cap.

Overflow: the log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] (+-80 nats, `kl.common`) before exp,
so rho is finite in float32 (at most ~5.5e34); a clamped rho is far outside any cap, so the weight it gets
(cap, or 0) is the same as without the clamp. The statistics are accumulated in float64.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from emapg_cli.kl.common import safe_exp_log_ratio

#: train.rollout_correction's values.
CORRECTION_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class CorrectionStats(NamedTuple):
    """Statistics of rho before truncation or masking, over the masked tokens (token modes) or over the
    sequences with at least one masked token (sequence modes). 0-d float64 tensors; NaN when count is 0."""

    ratio_mean: Tensor  # mean rho
    ratio_max: Tensor  # max rho
    clipped_frac: Tensor  # fraction of tokens (sequences) whose weight differs from rho: truncated or masked
    count: Tensor  # tokens (token modes) or sequences (sequence modes) the statistics are over


def sequence_level(mode: str) -> bool:
    """Whether `mode` weights whole sequences (one rho per sequence) rather than tokens."""
    return mode.startswith("sequence_")


def rollout_correction(old_logp: Tensor, sampling_logp: Tensor, mask: Tensor, mode: str,
                       cap: float = 2.0) -> tuple[Tensor, CorrectionStats]:
    """The detached importance weights w [b, R] of train.rollout_correction `mode`, and the statistics of rho.

    old_logp [b, R]: the trainer's old-policy log-probs of the sampled tokens; sampling_logp [b, R]: the engine's,
    recorded while sampling; mask [b, R]: the tokens the loss uses (observation tokens and padding 0). Token modes
    accept any shape [...] (the mask's shape); sequence modes reduce over the last dimension. Weights at positions
    outside the mask are 1 (they enter no loss). `mode` "none" gives weights 1 and no clipping; the caller should
    not multiply by them (the loss must stay bit-identical). cap >= 1.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown rollout correction mode {mode!r} (known: {', '.join(CORRECTION_MODES)})")
    if cap < 1:
        raise ValueError(f"rollout correction cap must be >= 1, got {cap}")
    m = mask.bool()
    log_ratio = torch.where(m, old_logp.detach().float() - sampling_logp.detach().float(), 0.0)  # [b, R]
    if sequence_level(mode):
        count = m.sum(-1)  # [b]
        seq_log = log_ratio.sum(-1) / count.clamp(min=1)  # [b] mean log-ratio: the geometric mean's log
        rho_seq = safe_exp_log_ratio(seq_log)  # [b]
        rho, where = rho_seq[..., None].expand_as(log_ratio), count > 0  # [b, R], [b]
        stat_rho = rho_seq  # [b]
    else:
        rho = safe_exp_log_ratio(log_ratio)  # [b, R]
        where, stat_rho = m, rho
    if mode == "none":
        weights, changed = torch.ones_like(rho), torch.zeros_like(stat_rho, dtype=torch.bool)
    elif mode.endswith("_truncate"):
        weights = rho.clamp(max=cap)
        changed = stat_rho > cap
    else:  # *_mask
        keep = (rho >= 1.0 / cap) & (rho <= cap)
        weights = torch.where(keep, rho, torch.zeros_like(rho))
        changed = (stat_rho < 1.0 / cap) | (stat_rho > cap)
    weights = torch.where(m, weights, torch.ones_like(weights))  # [b, R]
    vals = stat_rho[where].double()  # [n]
    n = vals.numel()
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=vals.device)
    stats = CorrectionStats(
        ratio_mean=vals.mean() if n else nan,
        ratio_max=vals.max() if n else nan,
        clipped_frac=changed[where].double().mean() if n else nan,
        count=torch.tensor(float(n), dtype=torch.float64, device=vals.device),
    )
    return weights.detach(), stats
