"""Log-prob passes over (prompt, response) batches without materialising [T, V] tensors.

The decoder runs once per batch; its hidden states at the response positions are projected to
the vocabulary `chunk` tokens at a time. From each [chunk, V] slice we keep only what the loss and
the KL estimators need, all [B, R] or [B, R, k]:
  logp       log pi(token) at the sampled token                    (grad in the policy pass)
  topk_index the top-k token ids q of this model                    (when `topk` > 0)
  logp_q     log pi at given indices q (`q_index`), else at its own top-k (when `topk` > 0)
  entropy    the distribution's entropy (detached, a metric; skipped with entropy=False)
  exact_kl   exact per-token KL against reference hidden states      (the `exact` estimator only)
With grad, each chunk runs under activation checkpointing, so backward recomputes its logits
instead of storing them; the anchor pass (no grad) never holds more than one chunk of logits.
Logits are divided by the rollout temperature so log-probs refer to the distribution sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from emapg_cli.kl.common import gather_logprobs


@dataclass
class TokenStats:
    """Per-response-token outputs of one pass; all [B, R] (or [B, R, k]), zero at padding."""

    logp: Tensor
    entropy: Tensor  # zeros when the pass did not ask for it
    topk_index: Optional[Tensor] = None
    logp_q: Optional[Tensor] = None
    exact_kl: Optional[Tensor] = None


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counting only real tokens (left padding gets 0), as `generate` assigns them. [B, L]"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_hidden(lm: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
    """Final hidden states at the positions that predict the response tokens: [B, R, H].

    Position t - 1 predicts token t, so the response tokens input_ids[:, P:] are predicted by
    hidden[:, P-1:-1].
    """
    out = lm.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask), use_cache=False
    )
    return out.last_hidden_state[:, prompt_len - 1:-1]  # [B, R, H]


def _chunk_stats(head: nn.Module, h: Tensor, targets: Tensor, temperature: float, topk: int,
                 q_index: Optional[Tensor], ref: Optional[tuple[Tensor, nn.Module, str]], entropy: bool):
    """Stats for one chunk of tokens: h [c, H], targets [c], q_index [c, k] or None."""
    logits = head(h).float() / temperature  # [c, V]
    lse = torch.logsumexp(logits, -1)  # [c]
    logp = gather_logprobs(logits, targets, lse)  # [c]
    with torch.no_grad():
        if entropy:
            probs = torch.softmax(logits.detach(), -1)  # [c, V]
            ent = lse.detach() - (probs * logits.detach()).sum(-1)  # [c]
        else:
            ent = torch.zeros_like(lse)  # [c]
    idx = logits.detach().topk(topk, -1).indices if topk > 0 else torch.empty(0)  # [c, k]
    gather_at = q_index if q_index is not None else (idx if topk > 0 else None)
    logp_q = gather_logprobs(logits, gather_at, lse) if gather_at is not None else torch.empty(0)  # [c, k]
    if ref is not None:
        from emapg_cli.kl import kl_per_token

        ref_h, ref_head, direction = ref
        with torch.no_grad():
            ref_logits = ref_head(ref_h).float() / temperature  # [c, V]
        exact = kl_per_token("exact", direction, logits=logits, ref_logits=ref_logits)  # [c]
    else:
        exact = torch.empty(0)
    return logp, ent, idx, logp_q, exact


def token_stats(
    lm: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    topk: int = 0,
    q_index: Optional[Tensor] = None,
    chunk: int = 1024,
    ref_hidden: Optional[Tensor] = None,
    ref_head: Optional[nn.Module] = None,
    kl_direction: str = "reverse",
    entropy: bool = True,
) -> TokenStats:
    """One pass of `lm` over input_ids [B, P + R] (prompt left-padded to P, response right-padded).

    response_mask [B, R] marks real response tokens; only those are projected to the vocabulary.
    q_index [B, R, k]: indices to gather log-probs at; ref_hidden [B, R, H] with ref_head: the
    reference model's hidden states and output layer, for the exact KL (computed chunk by chunk).
    """
    hidden = response_hidden(lm, input_ids, attention_mask, prompt_len)  # [B, R, H]
    head = lm.get_output_embeddings()
    mask = response_mask.bool()
    targets = input_ids[:, prompt_len:][mask]  # [N]
    h = hidden[mask]  # [N, H]
    q = q_index[mask] if q_index is not None else None  # [N, k]
    rh = ref_hidden[mask] if ref_hidden is not None else None  # [N, H]
    parts = []
    for s in range(0, h.shape[0], chunk):
        e = s + chunk
        ref = (rh[s:e], ref_head, kl_direction) if rh is not None else None
        args = (head, h[s:e], targets[s:e], temperature, topk, q[s:e] if q is not None else None, ref, entropy)
        parts.append(checkpoint(_chunk_stats, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk_stats(*args))

    def scatter(i: int, tail: tuple[int, ...] = (), dtype=torch.float32) -> Tensor:
        out = torch.zeros(*mask.shape, *tail, dtype=dtype, device=hidden.device)
        if parts:
            out = out.index_put((mask,), torch.cat([p[i] for p in parts]).to(dtype)) if mask.any() else out
        return out

    return TokenStats(
        logp=scatter(0),
        entropy=scatter(1),
        topk_index=scatter(2, (topk,), torch.long) if topk > 0 else None,
        logp_q=scatter(3, (q.shape[-1] if q is not None else topk,)) if q is not None or topk > 0 else None,
        exact_kl=scatter(4) if rh is not None else None,
    )


class TokenScorer(nn.Module):
    """Wraps a causal LM so its log-prob pass is the module's `forward` (what DDP/FSDP wrap and sync)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, response_mask: Tensor, **kwargs) -> TokenStats:
        return token_stats(self.lm, input_ids, attention_mask, prompt_len, response_mask, **kwargs)

