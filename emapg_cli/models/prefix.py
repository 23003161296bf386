"""A group's prompt run once: the decoder passes (and the hf engine's prefill) share each distinct prompt
among its samples.

GRPO samples n responses per prompt, so a micro-batch holds each prompt up to n times, and a padded
decoder pass computes every copy. Here the distinct prompts run once, with the key/value cache
kept; each row's cache is then its prompt's (gathered by index, so the backward pass sums the rows'
gradients into the one prompt computation), and the responses run on top of it. The hidden state
at a prompt's last position, which predicts the first response token, is gathered the same way.
The result equals the padded pass (the same attention over the same keys; tested to 1e-5) and
costs U x P + B x (R - 1) tokens instead of B x (P + R), for U distinct prompts among B rows.

Generation shares the same way (`prompt_cache`): the distinct prompts but their last token are
prefilled once and `generate` continues every row from its prompt's cache.

Needs the key/value cache in the forward that builds the graph: not with gradient checkpointing
(transformers turns the cache off there), and not under FSDP (a layer would run twice per backward).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

#: `share="auto"` shares when the shared layout runs at most this fraction of the padded tokens. The
#: toy (35-token prompts, 8 samples, <= 14-token responses) runs about a third of them.
AUTO_MAX_FRACTION = 0.5


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counting only real tokens (left padding gets 0), as `generate` assigns them. [B, L]"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class Groups:
    """The distinct prompts of a batch: `first` [U] a row holding each, `inverse` [B] each row's prompt."""

    first: Tensor
    inverse: Tensor

    @property
    def distinct(self) -> int:
        return self.first.shape[0]


def prompt_groups(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Groups:
    """Rows whose prompt columns [:, :prompt_len] are equal in ids and mask (the mask too: a pad id may
    also be a real token id) belong to one group."""
    key = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len].to(input_ids.dtype)], dim=1)  # [B, 2P]
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # [B] group of each row
    u = int(inverse.max()) + 1 if inverse.numel() else 0
    rows = torch.arange(inverse.shape[0], device=inverse.device)
    first = torch.full((u,), inverse.shape[0], dtype=torch.long, device=inverse.device).scatter_reduce(
        0, inverse, rows, reduce="amin")  # [U] the first row of each group
    return Groups(first=first, inverse=inverse)


def plan(input_ids: Tensor, attention_mask: Tensor, prompt_len: int, mode: Union[bool, str]) -> Optional[Groups]:
    """The groups to share, or None for the padded pass: True / "always" shares whenever a prompt repeats,
    "auto" when the shared layout also runs at most `AUTO_MAX_FRACTION` of the padded tokens, False /
    "never" does not."""
    if mode in (False, "never"):
        return None
    if mode not in (True, "always", "auto"):
        raise ValueError(f"unknown prompt-sharing mode {mode!r}")
    b, width = input_ids.shape
    if b < 2 or prompt_len < 1 or width <= prompt_len:
        return None
    groups = prompt_groups(input_ids, attention_mask, prompt_len)
    if groups.distinct == b:
        return None
    shared = groups.distinct * prompt_len + b * (width - prompt_len - 1)  # tokens through the decoder, shared
    if mode == "auto" and shared > AUTO_MAX_FRACTION * b * width:
        return None
    return groups


def _cache_of(out) -> Any:
    """The key/value cache a decoder call returned."""
    cache = getattr(out, "cache", None)  # transformers >= 5.2x; `past_key_values` before
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError("the decoder returned no key/value cache (gradient checkpointing?): prompts cannot be shared")
    return cache


def cache_kwarg(decoder: nn.Module) -> str:
    """The decoder's name for a given key/value cache: `cache` since transformers 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def supported(decoder: nn.Module) -> bool:
    """Whether `decoder` can share prompts now: no active gradient checkpointing (transformers drops the cache
    there) and no FSDP-sharded layer (it would run twice per backward)."""
    if getattr(decoder, "gradient_checkpointing", False) and decoder.training:
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return True
    return not any(isinstance(m, FSDPModule) for m in decoder.modules())


def _distinct_prefill(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, groups: Groups,
                      width: int) -> tuple[Tensor, Any]:
    """Each distinct prompt's first `width` columns through the decoder once: their final hidden states
    [U, width, H] and their key/value cache ([U, ...]; `batch_select_indices(groups.inverse)` gives each row's)."""
    first = groups.first
    out = decoder(input_ids=input_ids[first, :width], attention_mask=attention_mask[first, :width],
                  position_ids=position_ids[first, :width], use_cache=True)
    return out.last_hidden_state, _cache_of(out)


def shared_hidden(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, groups: Groups,
                  position_ids: Tensor) -> Tensor:
    """Final hidden states at the positions that predict the response tokens, [B, R, H], as the padded
    pass's `hidden[:, P-1:-1]`, with each distinct prompt run once.

    position_ids [B, P + R]: the padded pass's positions (`position_ids(attention_mask)`)."""
    p = prompt_len
    hidden, cache = _distinct_prefill(decoder, input_ids, attention_mask, position_ids, groups, p)
    cache.batch_select_indices(groups.inverse)  # each row's prompt keys and values
    last = hidden[:, -1][groups.inverse]  # [B, H] predicts each row's first response token
    if input_ids.shape[1] - p <= 1:
        return last[:, None]  # [B, 1, H]
    rest = decoder(input_ids=input_ids[:, p:-1], attention_mask=attention_mask[:, :-1], position_ids=position_ids[:, p:-1],
                   use_cache=True, **{cache_kwarg(decoder): cache}).last_hidden_state  # [B, R - 1, H]
    return torch.cat([last[:, None], rest], dim=1)  # [B, R, H]


def prompt_cache(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Optional[Any]:
    """The key/value cache of every row's prompt but its last token (left-padded prompts [B, P]), each
    distinct prompt computed once; None when no prompt repeats or P < 2. `generate` given it (under
    `cache_kwarg(decoder)`) with the full prompts runs only their last column before sampling."""
    width = input_ids.shape[1] - 1  # the columns prefilled here; the decode loop runs the last one
    groups = plan(input_ids, attention_mask, width, "always")
    if groups is None:
        return None
    cache = _distinct_prefill(decoder, input_ids, attention_mask, position_ids(attention_mask), groups, width)[1]
    cache.batch_select_indices(groups.inverse)  # each row's prompt keys and values
    return cache
