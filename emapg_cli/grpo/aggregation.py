"""Aggregating per-token losses into one scalar: token-mean, seq-mean-token-mean, seq-mean-token-sum."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def token_weights(
    mask: Tensor,
    mode: str,
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
) -> Tensor:
    """The weight of each token in the aggregated loss: aggregate(v) = sum_{i,t} w_it v_it. [B, T] float32.

      token-mean:           w_it = m_it / N_tokens                       (DAPO, Yu et al. 2025, Eq. 8)
      seq-mean-token-mean:  w_it = m_it / (max(1, sum_t m_it) N_seqs)    (GRPO, Eq. 3)
      seq-mean-token-sum:   w_it = m_it / N_seqs
    N_tokens / N_seqs default to this batch's counts; pass the mini-batch totals when the batch is
    one micro-batch of a gradient-accumulation step, so the summed micro-batch losses equal the
    loss of the whole mini-batch. N_tokens and N_seqs are clamped to at least 1.
    """
    m = mask.float()  # [B, T]
    if mode == "token-mean":
        denom = float(num_tokens) if num_tokens is not None else float(m.sum().item())
        return m / max(denom, 1.0)
    n_seqs = max(float(num_seqs) if num_seqs is not None else float(m.shape[0]), 1.0)
    if mode == "seq-mean-token-mean":
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * n_seqs)
    if mode == "seq-mean-token-sum":
        return m / n_seqs
    raise ValueError(f"unknown loss aggregation '{mode}' ({', '.join(LOSS_AGG_MODES)})")


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
) -> Tensor:
    """Scalar loss from per-token values [B, T] and the response mask [B, T] (1 = real token):
    sum_{i,t} w_it v_it with `token_weights`' w. A sequence with no tokens contributes 0; values at
    masked tokens are ignored (even non-finite ones)."""
    w = token_weights(mask, mode, num_tokens, num_seqs).to(values.dtype)  # [B, T]
    return torch.where(mask.bool(), values * w, torch.zeros_like(values)).sum()
