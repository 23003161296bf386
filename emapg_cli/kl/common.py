"""Shared tensor helpers for the KL estimators (pure: tensors in, tensors out).

Notation (per token, docs/estimators.md):
  p           the sampled token, drawn from the sampling policy pi_s
  l  = log pi_theta(p),  l_ref = log pi_ref(p),  l_s = log pi_s(p)
  r  = exp(l - sg l)     value 1, gradient d l  (the "straight-through ratio")
  w  = pi_ref(p) / pi_theta(p)
  s  = sg(pi_theta(p) / pi_s(p))   importance weight, 1 when sampling is on-policy
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

#: Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before `exp`.
#: exp(80) ~ 5.5e34 is finite in float32 (which overflows past ~88.7); any log-ratio
#: inside the range is left untouched, so in-range values never change.
LOG_RATIO_CLAMP = 80.0


def upcast(x: Tensor) -> Tensor:
    """float32 for half/bfloat16 inputs; float32/float64 inputs keep their precision."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def straight_through_ratio(logp: Tensor) -> Tensor:
    """r = exp(l - sg l): value exactly 1, gradient equal to the gradient of l."""
    return torch.exp(logp - logp.detach())


def safe_exp_log_ratio(log_ratio: Tensor) -> Tensor:
    """exp(log_ratio) with the documented clamp (see LOG_RATIO_CLAMP)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def importance_weight(logp: Tensor, sampling_logp: Tensor, clip: Optional[tuple[float, float]] = None) -> Tensor:
    """s = sg(pi_theta(p) / pi_s(p)), optionally clipped to [lo, hi]. Detached.

    The log-ratio is clamped as in `safe_exp_log_ratio`.
    """
    s = safe_exp_log_ratio(upcast(logp).detach() - upcast(sampling_logp).detach())
    if clip is not None:
        s = s.clamp(clip[0], clip[1])
    return s


def nucleus_keep(sorted_p: Tensor, top_p: float) -> Tensor:
    """Nucleus sampling's support (Holtzman et al. 2020), on probabilities sorted in descending order [..., V]: the
    smallest prefix whose mass reaches top_p, the most likely token always kept. bool [..., V] in the sorted order.
    The rule of the hf engine's sampler (`engines.hf.sample_from_logits`) and of `kl-check --top-p` (`nucleus`)."""
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    keep[..., 0] = True
    return keep


def nucleus(probs: Tensor, top_p: float) -> Tensor:
    """The distribution nucleus sampling draws from: `probs` [..., V] cut to `nucleus_keep`'s tokens and renormalised
    (0 elsewhere); `probs` itself at top_p >= 1."""
    if top_p >= 1:
        return probs
    sorted_p, order = probs.sort(-1, descending=True)  # [..., V]
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p * nucleus_keep(sorted_p, top_p))  # [..., V]
    return kept / kept.sum(-1, keepdim=True)


def gather_logprobs(logits: Tensor, index: Tensor, lse: Optional[Tensor] = None) -> Tensor:
    """log-softmax(logits) gathered at `index` along the last dim, in at least float32.

    logits: [..., V]; index: [..., k] (or [...] for one token); lse: [...] logsumexp of
    the logits, computed here when not given. Returns [..., k] (or [...]).
    """
    logits = upcast(logits)
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)  # [...]
    squeeze = index.dim() == logits.dim() - 1
    idx = index.unsqueeze(-1) if squeeze else index
    out = logits.gather(-1, idx) - lse.unsqueeze(-1)  # [..., k]
    return out.squeeze(-1) if squeeze else out


def topk_membership(index_q: Tensor, tokens: Tensor) -> Tensor:
    """1[p in q]: index_q [..., k] (the top-k set), tokens [...] -> bool [...]."""
    return (index_q == tokens.unsqueeze(-1)).any(dim=-1)


def xlogratio_sum(logp_a: Tensor, logp_b: Tensor) -> Tensor:
    """sum_j a(j) [log a(j) - log b(j)] over the last dim, with 0 * (anything) = 0.

    Tokens where a(j) = 0 contribute nothing even when b(j) = 0 too (log 0 - log 0 would be
    NaN); this is the convention 0 log 0 = 0 and changes no term with a(j) > 0.
    """
    a = torch.exp(logp_a)
    diff = torch.where(a > 0, logp_a - logp_b, torch.zeros_like(logp_a))
    return (a * diff).sum(-1)


def tail_only(value: Tensor, in_q: Tensor, iw: Optional[Tensor]) -> Tensor:
    """s * 1[p not in q] * value, written with `where` so a non-finite value inside q cannot leak NaN."""
    if iw is not None:
        value = iw * value
    return torch.where(in_q, torch.zeros_like(value), value)
