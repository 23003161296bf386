"""Aggregating per-token losses into one scalar: token-mean, seq-mean-token-mean, seq-mean-token-sum."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
) -> Tensor:
    """Scalar loss from per-token values [B, T] and the response mask [B, T] (1 = real token).

      token-mean:           sum_{i,t} m_it v_it / N_tokens                (DAPO, Yu et al. 2025, Eq. 8)
      seq-mean-token-mean:  sum_i [sum_t m_it v_it / max(1, sum_t m_it)] / N_seqs  (GRPO, Eq. 3)
      seq-mean-token-sum:   sum_i [sum_t m_it v_it] / N_seqs
    N_tokens / N_seqs default to this batch's counts; pass the mini-batch totals when the batch is
    one micro-batch of a gradient-accumulation step, so the summed micro-batch losses equal the
    loss of the whole mini-batch. A sequence with no tokens contributes 0 (its length is
    clamped to 1); N_tokens is clamped to at least 1.
    """
    m = mask.to(values.dtype)
    masked = values * m  # [B, T]
    if mode == "token-mean":
        denom = float(num_tokens) if num_tokens is not None else float(m.sum().item())
        return masked.sum() / max(denom, 1.0)
    n_seqs = float(num_seqs) if num_seqs is not None else float(values.shape[0])
    per_seq = masked.sum(-1)  # [B]
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / m.sum(-1).clamp(min=1.0)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation '{mode}' ({', '.join(LOSS_AGG_MODES)})")
    return per_seq.sum() / max(n_seqs, 1.0)
