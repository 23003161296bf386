"""The EMA anchor update and its distance to the policy (paper Eq. 5), on lists of tensors with fused foreach ops."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def ema_update_(shadow: Sequence[Tensor], current: Sequence[Tensor], decay: float) -> None:
    """In place: theta_ema <- decay * theta_ema + (1 - decay) * theta  (paper Eq. 5).

    shadow: the anchor's tensors (float32, or any dtype for integer buffers); current: the policy's
    matching tensors in any dtype (bf16 policy tensors are upcast to the shadow's dtype first, so
    the average accumulates in float32). Written as lerp(theta_ema, theta, 1 - decay), which leaves
    entries where theta_ema == theta bit-exact; decay = 1 changes nothing. Non-floating tensors
    (integer buffers) are copied.

    A half-precision shadow (bfloat16/float16, ema.dtype) is updated as the official search run updates its
    bf16 reference: theta_ema.mul_(decay).add_(theta.to(theta_ema.dtype), alpha=1 - decay), in place, theta
    cast to the shadow's dtype first as its code does (`ref_param.data.mul_(tau).add_(actor_data, alpha=1 - tau)`
    with the actor's weights cast to the reference's dtype). Deviation from Eq. 5 by design: each of the two in-place ops rounds to the
    shadow's dtype, so a step (1 - decay)(theta - theta_ema) below half an ulp of theta_ema is lost.
    """
    if len(shadow) != len(current):
        raise ValueError(f"shadow has {len(shadow)} tensors, current has {len(current)}")
    if decay == 1.0:
        return
    floats = [(s, c) for s, c in zip(shadow, current) if s.is_floating_point()]
    for s, c in zip(shadow, current):
        if not s.is_floating_point():
            s.copy_(c)
    for s, c in [(s, c) for s, c in floats if s.dtype in (torch.bfloat16, torch.float16)]:
        s.mul_(decay).add_(c.detach().to(s.dtype), alpha=1.0 - decay)
    floats = [(s, c) for s, c in floats if s.dtype not in (torch.bfloat16, torch.float16)]
    if not floats:
        return
    dst = [s for s, _ in floats]
    src = [c.detach() if c.dtype == s.dtype else c.detach().to(s.dtype) for s, c in floats]
    torch._foreach_lerp_(dst, src, 1.0 - decay)


def ema_norms(current: Sequence[Tensor], shadow: Sequence[Tensor]) -> Tensor:
    """[||theta - theta_ema||^2, ||theta||^2] over all floating tensors (float32 sums of squares). [2]

    Sums of squares add up across shards, so a sharded model's ranks can all-reduce this vector
    and take `ema_distance`'s ratio of the totals.
    """
    pairs = [(c.detach().float(), s.detach().float()) for c, s in zip(current, shadow) if c.is_floating_point()]
    if not pairs:
        return torch.zeros(2)
    cur = [c for c, _ in pairs]
    diff = torch._foreach_sub(cur, [s for _, s in pairs])
    return torch.stack([torch.stack(torch._foreach_norm(ts)).square().sum() for ts in (diff, cur)])


def distance_from_norms(norms: Tensor) -> float:
    """sqrt(||theta - theta_ema||^2 / ||theta||^2) from `ema_norms`' two totals; 0 when ||theta|| = 0."""
    diff_sq, cur_sq = (float(v) for v in norms)
    return (diff_sq / cur_sq) ** 0.5 if cur_sq > 0 else 0.0


def ema_distance(current: Sequence[Tensor], shadow: Sequence[Tensor]) -> float:
    """||theta - theta_ema|| / ||theta|| over all floating tensors (global L2 norms, float32); 0 when ||theta|| = 0."""
    return distance_from_norms(ema_norms(current, shadow))
