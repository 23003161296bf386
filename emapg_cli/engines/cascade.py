"""Cascade attention for the decode loop: each distinct prompt's keys and values are read once per step, not once
per sample (`rollout.hf_attention: cascade`; the idea of FlashInfer's cascade inference and Hydragen).

GRPO decodes n samples of every prompt together. With a cache that holds every row's copy of its prompt, a decode
step's attention reads n copies of each prompt's keys and values: on SmolLM2-135M at 64 rows, 115-token prompts
and 2 cores, 13 MB per layer per step, and the attention is bound by that memory traffic (~17% of the step;
docs/performance.md). Here the cache keeps each distinct prompt once ([U, kv, W, d], W = the prompt columns but
the last) and each row's own columns after it ([B, kv, 1 + N, d]: its last prompt token and its samples), and one
query token attends to both:

    s_p = q . K_p[g(r)]^T   (masked where the prompt is padding)      # [B, kv, group, W]   one read of K_p per step
    s_r = q . K_r^T                                                    # [B, kv, group, S]
    a   = softmax(cat(s_p, s_r) * scale)                               # over all W + S columns
    out = a_p . V_p[g(r)] + a_r . V_r                                  # [B, kv, group, d]

The prompt products run per prompt group ([U, kv, rows_per_prompt x group, W] batched matmuls: the rows of a prompt
share one read of its keys). The result is the same attention as `sdpa`'s over the concatenated cache, in another
summation order: in float32 outputs agree to float rounding (~1e-7), so log-probs differ by ~1e-5 and a token whose
draw sits that close to a boundary of the inverse CDF can flip (measured: docs/performance.md). In bfloat16 the gap
is bfloat16's, not float rounding's: cascade computes in float32 and rounds once, bf16 sdpa rounds on the way, so
the two differ by ~2e-3 (a bf16 ulp), and more draws can flip. The default (`sdpa`) samples
what transformers' `generate` samples, bit for bit.

Only the decode loop's one-token steps inside `active()` run here (in float32, whatever the model's dtype); every
other attention call of the model (a prefill, a training pass in another thread) runs transformers' `sdpa` with its
usual mask.
"""

from __future__ import annotations

import contextlib
import threading
from contextvars import ContextVar
from typing import Any, Iterator, Optional

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from emapg_cli.engines.kv_cache import PreallocatedLayer

#: The name of `cascade_attention` in transformers' attention (and mask) interfaces.
NAME = "emapg_cascade"

_ACTIVE: ContextVar[Optional["CascadeCache"]] = ContextVar("emapg_cascade_cache", default=None)
_lock = threading.Lock()
_users: dict[int, int] = {}  # id(config) -> decode loops inside `active()` on that config


class CascadeLayer(PreallocatedLayer):
    """One layer: the distinct prompts' keys and values [U, kv, W, d] once (in float32, what the attention computes
    in), and each row's own columns after them in a preallocated [B, kv, capacity, d] buffer (`update` writes and
    returns those; `get_seq_length` counts both)."""

    def __init__(self, keys: Tensor, values: Tensor, capacity: int):
        super().__init__(capacity)
        self.prompt_keys, self.prompt_values = keys.float(), values.float()  # [U, kv, W, d], converted once

    def get_seq_length(self) -> int:
        return self.prompt_keys.shape[-2] + self.length


class CascadeCache(DynamicCache):
    """The decode loop's cache under cascade attention. `set_rows(groups)` before each step: the prompt group of
    every live batch row ([b], indices into the prompts' U)."""

    def __init__(self, prefix: Any, prompt_mask: Tensor, capacity: int):
        """`prefix`: the distinct prompts' cache (`models.prefix.prompt_prefix`); prompt_mask [U, W]: its real
        (not padding) columns; `capacity`: the columns each row adds (its last prompt token and its samples)."""
        super().__init__()
        self.layers = [CascadeLayer(layer.keys, layer.values, capacity) for layer in prefix.layers]
        self.prompt_mask = prompt_mask.bool()  # [U, W]
        self.prompts = prompt_mask.shape[0]

    def set_rows(self, groups: Tensor) -> None:
        """Lay out the live rows by prompt: row r sits at slot `flat[r]` of a [U x per, ...] grid (per = the most
        rows any prompt has), so each prompt's rows share one product with its keys."""
        b = groups.shape[0]
        order = torch.argsort(groups, stable=True)  # [b] rows by prompt
        counts = torch.bincount(groups, minlength=self.prompts)  # [U]
        starts = torch.cumsum(counts, 0) - counts  # [U] first position of each prompt in `order`
        slot = torch.empty_like(groups)
        slot[order] = torch.arange(b, device=groups.device) - starts[groups[order]]  # [b] rank within its prompt
        self.per = int(counts.max())
        self.flat = groups * self.per + slot  # [b]
        self.row_mask = self.prompt_mask[groups]  # [b, W]


def _to_grid(x: Tensor, flat: Tensor, prompts: int, per: int) -> Tensor:
    """Rows [b, kv, g, m] -> the prompt grid [U, kv, per x g, m] (empty slots: 0)."""
    b, kv, g, m = x.shape
    grid = x.new_zeros(prompts * per, kv, g, m)
    grid[flat] = x
    return grid.view(prompts, per, kv, g, m).transpose(1, 2).reshape(prompts, kv, per * g, m)


def _from_grid(x: Tensor, flat: Tensor, per: int, g: int) -> Tensor:
    """The prompt grid [U, kv, per x g, m] -> rows [b, kv, g, m]."""
    u, kv, _, m = x.shape
    return x.view(u, kv, per, g, m).transpose(1, 2).reshape(u * per, kv, g, m)[flat]


def cascade_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention signature (query [b, H, 1, d]; key, value [b, kv, S, d]: the rows' own columns, as
    the cascade cache's `update` returned them); returns ([b, 1, H, d], None). Inside `active()` a step attends to
    its prompt (once per prompt) and its own columns (module doc), in float32 whatever the model's dtype or autocast;
    any call from outside (a prefill, another thread's training pass) is `sdpa_attention_forward` unchanged."""
    cache = _ACTIVE.get()
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[2] != 1 or dropout:
        raise RuntimeError("cascade attention runs one-token decode steps without dropout only")
    with torch.autocast(query.device.type, enabled=False):
        out = _attend(cache, cache.layers[module.layer_idx], query.float(), key.float(), value.float(),
                      query.shape[-1] ** -0.5 if scaling is None else scaling)
    return out.to(query.dtype), None


def _attend(cache: "CascadeCache", layer: CascadeLayer, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """The module doc's four lines: query [b, H, 1, d], the rows' own key, value [b, kv, S, d] -> [b, 1, H, d]."""
    b, h, _, d = query.shape
    kv = key.shape[1]
    g = h // kv
    q = query.reshape(b, kv, g, d)  # [b, kv, g, d]: the query heads that share each key/value head
    grid = _to_grid(q, cache.flat, cache.prompts, cache.per)  # [U, kv, per x g, d]
    s_grid = torch.matmul(grid, layer.prompt_keys.transpose(-1, -2))  # [U, kv, per x g, W]
    s_prompt = _from_grid(s_grid, cache.flat, cache.per, g)  # [b, kv, g, W]
    s_prompt.masked_fill_(~cache.row_mask[:, None, None, :], float("-inf"))
    s_own = torch.matmul(q, key.transpose(-1, -2))  # [b, kv, g, S]
    probs = torch.softmax(torch.cat([s_prompt, s_own], -1).mul_(scale), -1)  # [b, kv, g, W + S]
    w = s_prompt.shape[-1]
    p_grid = _to_grid(probs[..., :w], cache.flat, cache.prompts, cache.per)  # [U, kv, per x g, W]
    from_prompt = torch.matmul(p_grid, layer.prompt_values)  # [U, kv, per x g, d]
    out = _from_grid(from_prompt, cache.flat, cache.per, g) + torch.matmul(probs[..., w:], value)  # [b, kv, g, d]
    return out.reshape(b, 1, h, d)  # [b, q=1, H, d], as sdpa_attention_forward returns it


def _register() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if NAME not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(NAME, cascade_attention)
        # sdpa's mask: every call that falls through to sdpa (another thread's pass) gets the mask it expects
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def supported(model) -> bool:
    """Whether `model` can decode with cascade attention: a model on transformers' `sdpa` attention."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) in ("sdpa", NAME)


@contextlib.contextmanager
def active(model, cache: CascadeCache) -> Iterator[None]:
    """Within the block, this thread's one-token steps of `model` attend through `cache` (module doc). The model's
    attention is switched to `cascade_attention` while any decode loop uses it, and back to `sdpa` after the last."""
    _register()
    config = model.config
    with _lock:
        _users[id(config)] = _users.get(id(config), 0) + 1
        config._attn_implementation = NAME
    token = _ACTIVE.set(cache)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        with _lock:
            _users[id(config)] -= 1
            if not _users[id(config)]:
                del _users[id(config)]
                config._attn_implementation = "sdpa"
