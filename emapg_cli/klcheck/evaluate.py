"""Evaluate one estimator at a set of candidate tokens through `emapg_cli.kl.kl_per_token`
(the trainer's function: kl-check never reimplements an estimator).

Shapes: P positions, T tokens per position (T = N samples for Monte Carlo, T = V for the
closed-form enumeration), k the size of the top-k set q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from emapg_cli.kl import INFO, importance_weight, kl_per_token, topk_source


@dataclass(frozen=True)
class Spec:
    """One measured row: an estimator, the KL direction it estimates and (Top-k family) k."""

    name: str
    direction: str
    k: Optional[int] = None  # None for estimators that do not use a top-k set

    @property
    def label(self) -> str:
        return self.name if self.k is None else f"{self.name}@k={self.k}"


def topk_set(direction: str, k: int, policy: Tensor, anchor: Tensor, sampling: Optional[Tensor],
             topk_from: Optional[str] = None) -> Tensor:
    """Indices of q [P, k]: the top-k of the sampling policy (reverse KL) or of the anchor
    (forward KL), paper Algorithms 1 and 2, unless `topk_from` ("sampling" | "anchor", kl-check's
    --topk-from) says whose (`emapg_cli.kl.topk_source`, the trainer's rule)."""
    source = anchor if topk_source(direction, topk_from) == "anchor" else (policy if sampling is None else sampling)
    return torch.topk(source, k, dim=-1).indices  # [P, k]


def membership(q: Tensor, tokens: Tensor) -> Tensor:
    """1[p in q] for every token [P, T] (q [P, k]): the same answer as `emapg_cli.kl.topk_membership`,
    via a [P, V] mask so that enumerating the whole vocabulary needs no [P, V, k] comparison."""
    vocab = int(max(q.max(), tokens.max())) + 1
    mask = torch.zeros(q.shape[0], vocab, dtype=torch.bool).scatter_(-1, q, True)  # [P, V']
    return mask.gather(-1, tokens)  # [P, T]


def values_at(
    spec: Spec,
    tokens: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    sampling_logp: Optional[Tensor],
    logp_q: Optional[Tensor],
    ref_logp_q: Optional[Tensor],
    q: Optional[Tensor],
) -> Tensor:
    """Per-token estimate [P, T] as if each of `tokens` [P, T] were the sampled token p.

    logp, ref_logp, sampling_logp [P, T]: log pi_theta, log pi_ref, log pi_s at the tokens
    (sampling_logp None: on-policy, s = 1, no importance weight); logp_q, ref_logp_q [P, k] and
    q [P, k]: the top-k set (Top-k family only). The head term does not depend on the token, so
    it is passed as [P, 1, k] and broadcast over T.
    """
    info = INFO[spec.name]
    iw = None if sampling_logp is None else importance_weight(logp, sampling_logp)  # [P, T], detached
    kwargs = {}
    if info.uses_topk:
        kwargs = dict(logp_q=logp_q.unsqueeze(1), ref_logp_q=ref_logp_q.unsqueeze(1),  # [P, 1, k]
                      in_q=membership(q, tokens))  # [P, T]
    v = kl_per_token(spec.name, spec.direction, logp=logp, ref_logp=ref_logp, iw=iw, **kwargs)
    return torch.broadcast_to(v, tokens.shape)  # [P, T] (truncated gives [P, 1])
