"""Padding removed from the decoder passes: several sequences share one row ("packing").

A rollout micro-batch is [B, L]: prompts left-padded, responses right-padded, so every row costs the
longest row. Packing lays the real tokens of the rows end to end into fewer rows of the same width
(first-fit decreasing, each sequence whole in one row), with position ids that restart at 0 at each
sequence. transformers reads those restarts as sequence boundaries when no attention mask is given
(`masking_utils.find_packed_sequence_indices`): each token attends causally within its own sequence
only, the attention a padded row with its mask gives. The width stays the longest sequence's, so
the attention's [L, L] scores per row are never larger than unpacked; what shrinks is the number of
rows and with it every projection and MLP of the decoder.

Pure tensor bookkeeping: the decoder call and the gather of hidden states are the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of sequence indices whose lengths sum to at most `capacity` (a longer one gets a bin of its
    own); the longest sequences are placed first, each in the first bin with room."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


@dataclass
class Packed:
    """A padded batch [B, L] laid out as packed rows [b, C] (b <= B, C = the longest real sequence)."""

    input_ids: Tensor  # [b, C] real tokens end to end, `pad_id` after the last sequence of a row
    position_ids: Tensor  # [b, C] 0, 1, ... within each sequence; 0 at padding (each pad is its own "sequence")
    source: Tensor  # [B, L] flat index (row * C + column) into the packed batch of each real token; -1 at padding

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


def pack(input_ids: Tensor, attention_mask: Tensor, pad_id: int = 0) -> Packed:
    """Pack the real tokens (attention_mask 1) of input_ids [B, L]; each row's real tokens must be
    contiguous (left and/or right padding only), as rollout batches are."""
    keep = attention_mask.bool()  # [B, L]
    lengths = keep.sum(-1).tolist()  # B ints
    width = max(max(lengths, default=1), 1)
    bins = first_fit_decreasing(lengths, width)
    row_of = torch.empty(len(lengths), dtype=torch.long)  # [B] packed row of each sequence
    start_of = torch.empty(len(lengths), dtype=torch.long)  # [B] its first column there
    for r, members in enumerate(bins):
        col = 0
        for i in members:
            row_of[i], start_of[i] = r, col
            col += lengths[i]
    device = input_ids.device
    row_of, start_of = row_of.to(device), start_of.to(device)
    offset = keep.long().cumsum(-1) - 1  # [B, L] index of each real token within its sequence
    flat = row_of[:, None] * width + start_of[:, None] + offset  # [B, L]
    source = torch.where(keep, flat, torch.full_like(flat, -1))  # [B, L]
    ids = torch.full((len(bins) * width,), pad_id, dtype=input_ids.dtype, device=device)  # [b * C]
    ids[source[keep]] = input_ids[keep]
    pos = torch.zeros(len(bins) * width, dtype=torch.long, device=device)  # [b * C]
    pos[source[keep]] = offset[keep]
    return Packed(input_ids=ids.view(len(bins), width), position_ids=pos.view(len(bins), width), source=source)


#: `pack="auto"` packs a micro-batch whose longest sequence has at least this many tokens. Measured
#: with `emapg bench step` (2 threads, interleaved): the toy's ~45-token sequences ran 10-15% slower
#: packed (the packed mask and the gather back cost more than the padding they save), toy-search's
#: 100-320-token ones 1.2x faster (passes 0.38-0.46 s vs 0.53-0.61 s, update 0.56-0.61 s vs 0.74-0.76 s).
AUTO_MIN_WIDTH = 128


def plan(input_ids: Tensor, attention_mask: Tensor, mode: Union[bool, str]) -> Optional[Packed]:
    """The packed layout to run, or None for the padded batch: `mode` True / "always" packs, False /
    "never" does not, "auto" packs when the longest sequence has at least `AUTO_MIN_WIDTH` tokens."""
    if mode in (False, "never"):
        return None
    if mode not in (True, "always", "auto"):
        raise ValueError(f"unknown packing mode {mode!r}")
    if mode == "auto" and (attention_mask.numel() == 0 or int(attention_mask.sum(-1).max()) < AUTO_MIN_WIDTH):
        return None
    return pack(input_ids, attention_mask)


def unpack(hidden: Tensor, source: Tensor) -> Tensor:
    """Hidden states [b, C, H] of a packed batch back at the padded positions `source` [B, L'] (any
    column slice of `Packed.source`): [B, L', H], zeros where `source` is -1."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # [b * C, H]
    out = flat[source.clamp(min=0)]  # [B, L', H]
    return out * (source >= 0).unsqueeze(-1).to(out.dtype)
