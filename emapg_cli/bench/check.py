"""`emapg bench update --check` / `--confident P`: the fused output layer's gradients against a float64 reference.

`reference_grads` differentiates the same per-token loss (the `LossFn` the fused layer is given) on the same
inputs, rounded to the bench's dtype and then widened to float64: z = h W^T, log-softmax, the loss, autograd,
chunk by chunk, all in float64. What is left between the two is the fused layer's own arithmetic:

    dh_rel_err = ||dH_fused - dH_64|| / ||dH_64||,     dw_rel_err = ||dW_fused - dW_64|| / ||dW_64||

(Frobenius norms over every token and every row of W). In float32 both are ~1e-6; in bfloat16 a few 1e-3 are
the rounding of dH and dW themselves (8 significant bits).

`confident_hidden` makes every target token confident, p(target) >= P, as most tokens of a reasoning model are:
the gradient w.r.t. the logits at the target is then g (1 - p), the small difference of two large terms, which is
where a half-precision layer loses its digits (issue 32). Each row h_t moves along u_t = W[y_t] / ||W[y_t]||^2,
which raises the target's logit by a and the others' by a (W_j . u_t) only (|W_j . u_t| ~ H^-1/2 for random
rows), so p(target) grows with a; a is the smallest that gives p >= P on the rounded inputs (bisection, then a
check in float64 of the rounded row).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

#: Bisection steps for each row's boost a (the bracket [0, A_MAX] halves each step: 2^-40 of it at the end).
BISECT_STEPS = 40
#: The largest boost tried, in units of the target's logit (logits of random rows are ~N(0, 1)).
A_MAX = 200.0
#: float64 [chunk, V] buffers alive at once in the reference (logits, log-softmax, their gradients): sizes its chunk.
REFERENCE_BUFFERS = 6


def target_prob(z: Tensor, targets: Tensor) -> Tensor:
    """softmax(z)[target] per row, in z's dtype: z [c, V], targets [c] -> [c]."""
    return torch.exp(z.gather(1, targets[:, None])[:, 0] - torch.logsumexp(z, -1))


def confident_hidden(h: Tensor, w: Tensor, targets: Tensor, p: float, chunk: int) -> Tensor:
    """h [T, H] moved so that softmax(round(h) W^T)[target] >= p for every row, with `h`'s dtype as the rounding
    (w [V, H] is already rounded). Returns the rounded rows [T, H] (h's dtype)."""
    w64 = w.double()  # [V, H]
    out = torch.empty_like(h)
    for s in range(0, h.shape[0], chunk):
        e = min(s + chunk, h.shape[0])
        t = targets[s:e]
        u = w64[t] / (w64[t] * w64[t]).sum(-1, keepdim=True)  # [c, H] raises the target's logit by 1 per unit
        h0 = h[s:e].double()  # [c, H]
        z0, dz = h0 @ w64.t(), u @ w64.t()  # [c, V] each: z(a) = z0 + a dz, dz[target] = 1
        lo = torch.zeros(e - s, dtype=torch.float64)  # [c]
        hi = torch.full((e - s,), A_MAX, dtype=torch.float64)  # [c]
        for _ in range(BISECT_STEPS):
            mid = (lo + hi) / 2
            ok = target_prob(z0 + mid[:, None] * dz, t) >= p
            lo, hi = torch.where(ok, lo, mid), torch.where(ok, mid, hi)
        a = hi.clone()
        for _ in range(60):  # rounding h may take a row just below p: raise its boost a little and round again
            rows = (h0 + a[:, None] * u).to(h.dtype)  # [c, H]
            low = target_prob(rows.double() @ w64.t(), t) < p
            if not bool(low.any()):
                break
            a = torch.where(low, a * 1.01 + 1e-3, a)
        else:
            raise RuntimeError(f"could not make every target token's probability reach {p}")
        out[s:e] = rows
    return out


def reference_grads(h: Tensor, w: Tensor, targets: Tensor, loss_fn: Callable, q: Optional[Tensor], chunk: int,
                    ref_h: Optional[Tensor] = None, ref_w: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(dL/dh [T, H], dL/dW [V, H]) in float64 of sum_t loss_fn(log-softmax(h_t W^T) at [y_t, q_t]), with h, W (and
    the anchor's ref_h, ref_w for `exact`) widened from their rounded values to float64, chunk by chunk."""
    w64 = w.detach().double().requires_grad_()  # [V, H]
    dh = torch.empty(h.shape, dtype=torch.float64)  # [T, H]
    rw64 = ref_w.double() if ref_w is not None else None  # [V, H']
    for s in range(0, h.shape[0], chunk):
        e = min(s + chunk, h.shape[0])
        h64 = h[s:e].detach().double().requires_grad_()  # [c, H]
        idx = targets[s:e, None] if q is None else torch.cat([targets[s:e, None], q[s:e]], 1)  # [c, 1 + k]
        z = h64 @ w64.t()  # [c, V]
        logp = torch.log_softmax(z, -1).gather(1, idx)  # [c, 1 + k]
        extra = {}
        if rw64 is not None:  # exact: both models' full logits
            extra = dict(logits=z, ref_logits=ref_h[s:e].double() @ rw64.t())
        per_tok, _ = loss_fn(s, e, logp[:, 0], logp[:, 1:] if q is not None else None, **extra)  # [c]
        per_tok.sum().backward()
        dh[s:e] = h64.grad
    return dh, w64.grad


def rel_err(got: Tensor, ref: Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (Frobenius norms)."""
    return float((got.double() - ref).norm() / ref.norm().clamp(min=1e-300))
