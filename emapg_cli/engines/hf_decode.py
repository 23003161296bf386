"""The hf engine's own decode loop: the same samples as transformers' `generate`, with less work per token.

`generate` (engines/hf.py's `generate` path) grows every layer's key/value cache by `torch.cat` at each step
(a copy of the whole cache per token: O(T^2) bytes over a response), keeps computing rows that have
finished until the last one does, and runs its logits processors, stopping criteria and a one-hot mask
for the sampler's token around every step. This loop calls the model's own forward, step by step:

- the prompts are prefilled as `generate` would have been given them: each distinct prompt but its
  last token once (`models.prefix.prompt_cache`) and then every row's last prompt token, or, when no
  prompt repeats, every row's whole prompt;
- the key/value cache is preallocated (`PreallocatedLayer`: one [B, heads, P + N, d] buffer per layer
  and per keys / values, written in place; attention reads the view of the columns written so far,
  the very tensor `torch.cat` would have built);
- a row that ends (an end token, or a stop string as `generate`'s `StopStringCriteria` matches it) leaves
  the batch: its cache slot is refilled from the batch's last live row, so the GEMMs shrink with the live
  rows; never below `MIN_ROWS` (or the chunk), where a GEMM costs what it costs at one row (the weights'
  memory traffic) and where CPU BLAS kernels may round a row differently than in a larger batch;
- each step's token is drawn by the engine's seeded sampler (`SeededSampler.draw`) from the same float32 logits.

Every row sees the same operations on the same values as under `generate`; what can differ is how a
kernel rounds a row when the batch around it has another size (a finished row left it). On CPU, MKL's
GEMM gives each row the same bits at every batch from 12 to 256 rows, in any row order (measured at the 135M
model's shapes, 1 and 2 threads: docs/performance.md), and attention, norms and the sampler work row by row, so
the samples and their log-probs are bit-identical to `generate`'s there (tests/test_hf_decode.py).

Supported: decoder-only models whose forward takes `cache` (or `past_key_values`), `position_ids`,
`attention_mask` and `logits_to_keep`, and whose cache for this config is made of plain full-attention
layers (Llama, Qwen2, Mistral without a sliding window, the toys). `unsupported_reason` names what is
missing; the engine then uses `generate` and says so (engines/hf.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from emapg_cli.engines.base import Cancelled
from emapg_cli.engines.kv_cache import preallocated_cache
from emapg_cli.models.prefix import cache_kwarg, position_ids, prompt_cache

#: A batch never shrinks below this many rows (or the chunk's rows, when fewer): below it a step costs about
#: the same (the weights are read from memory once per step whatever the rows), and MKL's small-batch GEMM
#: kernels round some batch sizes (1-3 rows at 1 thread, 1-11 but 4 and 8 at 2 threads, on an AVX2 machine)
#: differently than larger batches.
MIN_ROWS = 16


def unsupported_reason(model) -> Optional[str]:
    """Why `decode` cannot run `model` (None: it can)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return "not a decoder-only transformers model"
    params = inspect.signature(model.forward).parameters
    missing = [p for p in ("attention_mask", "position_ids", "logits_to_keep") if p not in params]
    if "cache" not in params and "past_key_values" not in params:
        missing.append("cache")
    if missing:
        return f"{type(model).__name__}.forward takes no {', '.join(missing)}"
    try:
        kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    except Exception as e:  # noqa: BLE001 - any failure to build the model's own cache means: not supported
        return f"its key/value cache cannot be built ({type(e).__name__})"
    if kinds - {"DynamicLayer"}:
        return f"its cache has {', '.join(sorted(kinds - {'DynamicLayer'}))} layers (sliding-window or other attention)"
    return None


@dataclass
class Decoded:
    """Every row's drawn tokens [B, N], their log-probs [B, N], top-k ids [B, N, k] (or None) and how many
    steps each row ran (`steps` [B]: through its end token, or N)."""

    tokens: Tensor
    logprobs: Tensor
    topk: Optional[Tensor]
    steps: Tensor


#: draw(scores [B, V] float32, uniforms [B]) -> (tokens [B], log-probs [B], top-k ids [B, k] or None)
Draw = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Optional[Tensor]]]


@torch.inference_mode()
def decode(model, input_ids: Tensor, attention: Tensor, uniforms: Tensor, draw: Draw, end_ids: tuple[int, ...],
           stop: Optional[Callable[[Tensor], Tensor]] = None, *, share_prompts: bool = True,
           min_rows: Optional[int] = None, cancelled: Optional[Callable[[], bool]] = None) -> Decoded:
    """Sample up to N = uniforms.shape[1] tokens for each left-padded prompt row (input_ids, attention [B, P]).

    `stop(sequences [b, P + t]) -> [b] bool`: rows that end on a stop string (generate's StopStringCriteria).
    Step t of row r draws with uniforms[r, t]. `min_rows`: the batch's floor (None: `MIN_ROWS`). `cancelled`: polled before every step; once it returns True, `engines.base.Cancelled` is raised
    (the rollout server's client left)."""
    b, plen = input_ids.shape
    n = uniforms.shape[1]
    dev = input_ids.device
    key = cache_kwarg(model.get_decoder()) if hasattr(model, "get_decoder") else "cache"
    seqs = torch.cat([input_ids, input_ids.new_zeros(b, n)], 1)  # [B, P + N] prompt and drawn tokens
    mask = torch.cat([attention, attention.new_ones(b, n)], 1)  # [B, P + N]
    pos = position_ids(mask)  # [B, P + N] as generate assigns them
    out = Decoded(tokens=torch.zeros(b, n, dtype=torch.long), logprobs=torch.zeros(b, n), topk=None,
                  steps=torch.full((b,), n))
    cache = _step_cache(model, input_ids, attention, n, share_prompts)
    start = plen - 1 if cache.get_seq_length() else 0  # columns already in the cache
    live = torch.arange(b, device=dev)  # [b'] the original row of each live batch row
    ends = torch.tensor(end_ids, device=dev)
    floor = min(MIN_ROWS if min_rows is None else min_rows, b)
    for t in range(n):
        if cancelled is not None and cancelled():
            raise Cancelled("the generation was cancelled")
        cols = slice(start, plen + t)
        logits = model(input_ids=seqs[live, cols], attention_mask=mask[live, : plen + t],
                       position_ids=pos[live, cols], use_cache=True, logits_to_keep=1, **{key: cache}).logits
        scores = logits[:, -1, :].to(dtype=torch.float32, copy=True)  # [b', V] as generate takes them
        tokens, logp, top = draw(scores, uniforms[live, t])
        seqs[live, plen + t] = tokens
        out.tokens[live.cpu(), t], out.logprobs[live.cpu(), t] = tokens.cpu(), logp.float().cpu()
        if top is not None:
            if out.topk is None:
                out.topk = torch.zeros(b, n, top.shape[1], dtype=torch.long)  # [B, N, k]
            out.topk[live.cpu(), t] = top.cpu()
        done = torch.isin(tokens, ends)  # [b']
        if stop is not None:
            done |= stop(seqs[live, : plen + t + 1])
        start = plen + t
        if done.any():
            out.steps[live[done].cpu()] = torch.minimum(out.steps[live[done].cpu()], torch.tensor(t + 1))
            live = _compact(cache, live, floor, out.steps, t + 1)
        if not len(live) or bool((out.steps[live.cpu()] <= t + 1).all()):
            break
    return out


def _step_cache(model, input_ids: Tensor, attention: Tensor, n: int, share_prompts: bool) -> DynamicCache:
    """The decode loop's cache with the prompts prefilled (each distinct prompt once, when they repeat and
    `share_prompts`; else empty)."""
    plen = input_ids.shape[1]
    decoder = model.get_decoder()
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    shared = prompt_cache(decoder, input_ids, attention) if share_prompts else None
    return preallocated_cache(layers, plen + n, shared)


def _compact(cache: DynamicCache, live: Tensor, floor: int, steps: Tensor, t: int) -> Tensor:
    """Drop finished rows from the batch (keeping at least `floor` rows: some finished ones stay and their draws are
    ignored); a dropped row's slot takes a live row from the end of the batch. Returns the new `live`."""
    still = (steps[live.cpu()] > t).to(live.device)  # [b'] rows not finished yet
    keep_n = max(int(still.sum()), min(floor, len(live)))
    if keep_n == len(live):
        return live
    order = torch.argsort((~still).to(torch.int8), stable=True)  # unfinished first, in batch order
    kept = order[:keep_n].sort().values  # batch rows that stay
    # rows that stay but sit past keep_n move into the holes below keep_n
    holes = torch.tensor(sorted(set(range(keep_n)) - set(kept.tolist())), dtype=torch.long, device=live.device)
    movers = kept[kept >= keep_n]
    for layer in cache.layers:
        layer.move(movers, holes, keep_n)
    new = live.clone()
    new[holes] = live[movers]
    return new[:keep_n]
