"""Key/value caches written in place for the decode loop (engines/hf_decode.py): one [B, heads, capacity, d] buffer
per layer and per keys / values, so a step costs no copy of the cache (`torch.cat` copies it all at every token),
and rows move when the batch compacts."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers of `capacity` columns [B, heads, capacity, d], written in place.

    `update` returns the view of the live rows' columns written so far: the same values, in the same shape, as
    the `torch.cat` of a `DynamicLayer`. `move(src, dst)` copies rows (the batch's compaction)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0  # columns written
        self.rows = 0  # live rows: the first `rows` of the buffers
        self.k_buf: Optional[Tensor] = None  # [B, heads, capacity, d]
        self.v_buf: Optional[Tensor] = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.k_buf = key_states.new_empty(b, h, self.capacity, d)  # [B, heads, capacity, d]
        self.v_buf = value_states.new_empty(b, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.rows = b
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"preallocated cache of {self.capacity} columns is full")
        self.k_buf[: self.rows, :, self.length:end] = key_states
        self.v_buf[: self.rows, :, self.length:end] = value_states
        self.length = end
        self.keys = self.k_buf[: self.rows, :, :end]  # [rows, heads, end, d]
        self.values = self.v_buf[: self.rows, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def move(self, src: Tensor, dst: Tensor, rows: int) -> None:
        """Copy rows `src` to `dst` (both [m]) and keep the first `rows` rows live."""
        if len(src):
            self.k_buf[dst, :, : self.length] = self.k_buf[src, :, : self.length]
            self.v_buf[dst, :, : self.length] = self.v_buf[src, :, : self.length]
        self.rows = rows


def preallocated_cache(layers: int, capacity: int, prefilled: Any = None) -> DynamicCache:
    """A cache of `layers` `PreallocatedLayer`s; `prefilled` (a DynamicCache of the prompts) is copied in."""
    cache = DynamicCache()
    cache.layers = [PreallocatedLayer(capacity) for _ in range(layers)]
    if prefilled is not None:
        for layer, old in zip(cache.layers, prefilled.layers):
            layer.update(old.keys, old.values)
    return cache
