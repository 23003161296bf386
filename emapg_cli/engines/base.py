"""The interface every generation engine implements.

Engines take already-tokenised prompts (the caller renders the chat template) and return, per
prompt, `n` sampled completions with their token ids and, when the engine can give them, the
sampling log-probabilities of each generated token (used to measure the rollout/trainer mismatch).
Only `engines/hf.py` imports transformers' generation code and only `engines/vllm.py` imports vLLM.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Protocol


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions)."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def end_token_ids(tokenizer, generation_config: Any = None) -> tuple[int, ...]:
    """The token ids a sampled sequence ends on, for every engine: the tokenizer's EOS plus the
    generation config's `eos_token_id` (an int, a list of ints, or None), in that order, without
    repeats.

    Chat models often end a turn on a token other than the tokenizer's EOS (Llama 3's generation
    config lists `<|eot_id|>` and `<|end_of_text|>`; Qwen2.5-Instruct's lists `<|im_end|>` and
    `<|endoftext|>`). vLLM stops on both by default; transformers' `generate` stops on what it is
    given. Both emapg engines are given this set, so they end a response on the same tokens.
    """
    eos = getattr(generation_config, "eos_token_id", None)
    extra: Iterable[Any] = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    return tuple(dict.fromkeys(int(t) for t in [getattr(tokenizer, "eos_token_id", None), *extra] if t is not None))


class Cancelled(Exception):
    """A generation stopped because its `cancelled()` said so (the rollout server's client left, or its request's
    deadline passed): nothing is returned."""


#: A generation's `cancelled` hook: polled between decode steps (hf) or before the engine's call (vLLM).
CancelHook = Optional[Callable[[], bool]]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: shared by training rollouts and evaluation."""

    n: int = 1
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0  # each (prompt, sample) gets its own derived seed
    topk: int = 0  # > 0: also record each step's top-k token ids of the sampling distribution (engines that can)
    min_version: Optional[int] = None  # versioned engines: hold the request until weights_version >= this (None: no wait)


@dataclass
class Completion:
    """One generated response."""

    token_ids: list[int]  # generated tokens only, EOS included when it stopped on EOS
    text: str  # decoded, special tokens removed, cut at the first stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    logprobs: Optional[list[float]] = field(default=None)  # engine's sampling log-prob per token
    topk_index: Optional[Any] = field(default=None)  # [len, k] int64 tensor: each step's top-k ids (params.topk > 0)
    weights_version: Optional[int] = field(default=None)  # version of the weights that sampled it (versioned engines)


class Engine(Protocol):
    """A generation backend.

    What differs between engines is said by two attributes, read by the trainer (never probed):
    `shares_weights`: it samples from the live module it was given (`load_weights` copies nothing, so a
    sharded model need not be gathered for it); `records_topk`: it records each step's top-k ids of the
    sampling distribution when `SamplingParams.topk` > 0 (what reverse Top-k with `train.old_logprobs=engine` needs);
    `versioned`: its weights carry a version number and it can sample while new weights are pushed (the
    asynchronous rollouts of `rollout.max_staleness`). A versioned engine also has:

    - `weights_version: int`: the version it samples from now (the trainer's policy after RL step s is version s;
      the weights at setup are version 0 for a fresh run, the resumed step otherwise);
    - `push_weights(model, version)`: send `model`'s full weights as `version`; they are applied between
      generations, never in the middle of one; returns once sent (possibly before applied);
    - `wait_s: float`: cumulative seconds its generate requests waited for `SamplingParams.min_version`;
    - `generate` may run in a background thread while `push_weights` is called from the main thread, holds a
      request until `weights_version >= params.min_version` and sets `Completion.weights_version`;
    - `load_weights(model)` is `push_weights(model, self.weights_version + 1)`.

    Non-versioned engines ignore `SamplingParams.min_version` and leave `Completion.weights_version` None.
    """

    shares_weights: bool
    records_topk: bool
    versioned: bool

    def generate(self, prompts: list[list[int]], params: SamplingParams, cancelled: CancelHook = None) -> list[list[Completion]]:
        """`params.n` completions for each prompt, in prompt order; `Cancelled` once `cancelled()` (polled as each
        engine can: between decode steps, or before its call)."""
        ...

    def load_weights(self, model) -> None:
        """Make the engine sample from `model`'s current weights (after an optimizer update)."""
        ...

    def full_vocab_logprobs(self, params: SamplingParams) -> bool:
        """Whether the log-probs recorded for requests sampled with `params` are log softmax(logits / T) over the
        full vocabulary, the trainer's distribution (what `train.old_logprobs=engine` and rollout correction need)."""
        ...

    def release_memory(self) -> None:
        """Hand accelerator memory back during the update (no-op where unsupported)."""
        ...

    def resume_memory(self) -> None:
        """Take the memory back before the next rollout (no-op where unsupported)."""
        ...


class EngineBase:
    """Defaults for an `Engine`: weights of its own, no top-k records, no memory to hand back. Subclass it and
    write `generate`, `load_weights` and `full_vocab_logprobs` (a fake in a test may subclass it too)."""

    shares_weights: bool = False
    records_topk: bool = False
    versioned: bool = False  # see `Engine`: True only for engines with weights_version / push_weights / wait_s

    def release_memory(self) -> None:
        """Nothing to release."""

    def resume_memory(self) -> None:
        """Nothing to take back."""
