"""Monte-Carlo values and per-sample gradients of an estimator without [P, N, V] tensors.

Each sampled estimate v_i depends on the policy logits z only through l_i = log pi_theta(p_i)
and the head log-probs l_q = log pi_theta(q) [k]. Making those leaf tensors,
    c_i = dv_i / dl_i                  [P, N]   (one scalar per sample)
    d   = (1/N) sum_i dv_i / dl_q      [P, k]   (the head's coefficient, the same for every sample)
and with grad_z log pi_theta(j) = e_j - pi, the per-sample gradient w.r.t. the logits is
    g_i = c_i (e_{p_i} - pi) + sum_j d_j (e_{q_j} - pi).
Means, projections and the trace of the covariance follow in closed form from (c, d).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from emapg_cli.kl.common import nucleus
from emapg_cli.klcheck.evaluate import Spec, values_at


@dataclass(frozen=True)
class SampleGradients:
    """Sampled values and gradient coefficients of one estimator."""

    tokens: Tensor  # [P, N] sampled token ids
    values: Tensor  # [P, N] v_i
    c: Tensor  # [P, N] per-sample coefficient of (e_{p_i} - pi)
    q: Optional[Tensor]  # [P, k] head indices (Top-k family)
    d: Optional[Tensor]  # [P, k] head coefficients of (e_{q_j} - pi)


def sample_gradients(
    spec: Spec, tokens: Tensor, logp_all: Tensor, ref_logp_all: Tensor, s_logp_all: Optional[Tensor], q: Optional[Tensor]
) -> SampleGradients:
    """Values and coefficients at the sampled `tokens` [P, N] from full log-prob tables [P, V]."""
    lp = logp_all.gather(-1, tokens).requires_grad_()  # [P, N] leaf: l_i
    ref_lp = ref_logp_all.gather(-1, tokens)  # [P, N]
    s_lp = None if s_logp_all is None else s_logp_all.gather(-1, tokens)  # [P, N]
    lq = ref_lq = None
    if q is not None:
        lq = logp_all.gather(-1, q).requires_grad_()  # [P, k] leaf: l_q
        ref_lq = ref_logp_all.gather(-1, q)  # [P, k]
    v = values_at(spec, tokens, lp, ref_lp, s_lp, lq, ref_lq, q)  # [P, N]
    leaves = [lp] + ([lq] if lq is not None else [])
    grads = torch.autograd.grad(v.sum(), leaves, allow_unused=True)
    c = grads[0] if grads[0] is not None else torch.zeros_like(lp)  # [P, N]
    d = None
    if lq is not None:
        d = (grads[1] if grads[1] is not None else torch.zeros_like(lq)) / tokens.shape[1]  # [P, k]
    return SampleGradients(tokens, v.detach(), c.detach(), q, d if d is None else d.detach())


def mean_gradient(sg: SampleGradients, pi: Tensor, samples: slice = slice(None)) -> Tensor:
    """Mean of g_i over the selected samples [P, V]:
    (1/n) sum_i c_i e_{p_i} - mean(c) pi + sum_j d_j e_{q_j} - sum(d) pi."""
    c, tokens = sg.c[:, samples], sg.tokens[:, samples]  # [P, n]
    g = torch.zeros_like(pi).scatter_add_(-1, tokens, c) / c.shape[1]  # [P, V]
    g -= c.mean(-1, keepdim=True) * pi
    if sg.d is not None:
        g.scatter_add_(-1, sg.q, sg.d)
        g -= sg.d.sum(-1, keepdim=True) * pi
    return g


def projections(sg: SampleGradients, pi: Tensor, u: Tensor, samples: slice = slice(None)) -> Tensor:
    """g_i . u for the selected samples [P, n], u [P, V]:
    c_i (u_{p_i} - pi.u) + sum_j d_j (u_{q_j} - pi.u)."""
    pu = (pi * u).sum(-1, keepdim=True)  # [P, 1]
    c, tokens = sg.c[:, samples], sg.tokens[:, samples]  # [P, n]
    out = c * (u.gather(-1, tokens) - pu)  # [P, n]
    if sg.d is not None:
        out = out + (sg.d * (u.gather(-1, sg.q) - pu)).sum(-1, keepdim=True)
    return out


def gradient_variance(sg: SampleGradients, pi: Tensor) -> Tensor:
    """Trace of the per-sample gradient covariance, E||g_i - g_bar||^2, per position [P] (unbiased, N/(N-1)).

    The head term is the same for every sample and cancels; with u_i = c_i (e_{p_i} - pi):
    ||u_i||^2 = c_i^2 (1 - 2 pi_{p_i} + ||pi||^2) and mean_i ||u_i - u_bar||^2 = mean_i ||u_i||^2 - ||u_bar||^2.
    """
    c, tokens = sg.c, sg.tokens
    n = c.shape[1]
    pi_sq = (pi * pi).sum(-1, keepdim=True)  # [P, 1]
    sq = (c * c * (1 - 2 * pi.gather(-1, tokens) + pi_sq)).mean(-1)  # [P]
    u_bar = torch.zeros_like(pi).scatter_add_(-1, tokens, c) / n - c.mean(-1, keepdim=True) * pi  # [P, V]
    return (sq - (u_bar * u_bar).sum(-1)).clamp_min(0) * n / (n - 1)


def draw_tokens(sampling_logits: Tensor, samples: int, generator: torch.Generator, top_p: float = 1.0) -> Tensor:
    """N i.i.d. tokens per position from softmax(sampling_logits) [P, V] -> [P, N] (with replacement); with top_p < 1
    from its nucleus (`kl.common.nucleus`, the hf engine's rule)."""
    probs = nucleus(torch.softmax(sampling_logits, -1), top_p)  # [P, V]
    return torch.multinomial(probs, samples, replacement=True, generator=generator)  # [P, N]

