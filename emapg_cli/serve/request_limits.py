"""What one generation request may ask of a rollout server (`emapg rollout serve`): its sampling parameters checked,
its size capped, before anything is generated.

Every route of the server that generates calls `check_generation` with the request's prompts (token ids) and
`SamplingParams`, whatever its wire format, so each carries the same limits. A refusal is `Refused`
(emapg_cli/serve/http_server.py) with its HTTP status: 400 for a value no engine can sample with (a temperature that is negative, NaN or infinite; a top_p outside
(0, 1]; an empty prompt; an empty stop string), 413 for a request over the server's limits (`RequestLimits`, the
options of `emapg rollout serve`). The work of a request is bounded by its sequences (prompts x n), the new tokens
of each, and its tokens in all (n x (prompt + max_new_tokens) summed over its prompts), which bounds the engine's
memory (an hf engine's [rows, max_new_tokens] buffers; vLLM's scheduled tokens) and the reply's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from emapg_cli.engines.base import SamplingParams
from emapg_cli.serve.http_server import Refused

#: Most sequences (prompts x n) in one request: a paper-scale RL step is 512 prompts x 16 = 8,192.
MAX_SEQUENCES = 65536
#: Most new tokens per sequence (`max_new_tokens`).
MAX_NEW_TOKENS = 32768
#: Most tokens of one request in all: n x (prompt tokens + max_new_tokens), summed over its prompts (2^28: a step of
#: 512 prompts x 16 samples x (300 + 8,192) tokens is 7.0e7).
MAX_REQUEST_TOKENS = 1 << 28
#: Largest `topk` (top-k ids recorded per generated token; the reply holds 4 bytes per id).
MAX_TOPK = 1024
#: Most stop strings per request, and characters per stop string.
MAX_STOP, MAX_STOP_CHARS = 32, 256
#: Largest seed (vLLM's engine takes a signed 64-bit one).
MAX_SEED = (1 << 63) - 1


@dataclass(frozen=True)
class RequestLimits:
    """The bounds of one generation request (the options of `emapg rollout serve`)."""

    max_sequences: int = MAX_SEQUENCES
    max_new_tokens: int = MAX_NEW_TOKENS
    max_request_tokens: int = MAX_REQUEST_TOKENS
    max_topk: int = MAX_TOPK


def check_params(params: SamplingParams, limits: RequestLimits) -> None:
    """`Refused` (400/413) for sampling parameters no engine can sample with or over `limits`."""
    t, p = params.temperature, params.top_p
    if not (math.isfinite(t) and t >= 0):
        raise Refused(400, f"temperature must be a finite number >= 0 (0: greedy), got {t!r:.30}")
    if not (math.isfinite(p) and 0 < p <= 1):
        raise Refused(400, f"top_p must be in (0, 1], got {p!r:.30}")
    if not 0 <= params.seed <= MAX_SEED:
        raise Refused(400, f"seed must be in [0, 2^63), got {str(params.seed)[:30]}")
    if params.topk > limits.max_topk:
        raise Refused(413, f"topk {params.topk}: at most {limits.max_topk}")
    if params.max_new_tokens > limits.max_new_tokens:
        raise Refused(413, f"max_new_tokens {params.max_new_tokens}: at most {limits.max_new_tokens} (the server's "
                           "--max-new-tokens)")
    if len(params.stop) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in params.stop):
        raise Refused(400, f"stop must be at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters")


def check_generation(prompts: list[list[int]], params: SamplingParams, limits: RequestLimits) -> None:
    """`Refused` (400/413) unless `params` pass `check_params` and the request fits `limits`: every prompt holds at
    least one token, prompts x n <= max_sequences, and n x (prompt + max_new_tokens) summed over the prompts <=
    max_request_tokens. Token ids against the vocabulary are checked where the prompts are parsed."""
    check_params(params, limits)
    empty = next((i for i, p in enumerate(prompts) if not p), None)
    if empty is not None:
        raise Refused(400, f"prompts[{empty}] is empty: a prompt needs at least one token")
    sequences = len(prompts) * params.n
    if sequences > limits.max_sequences:
        raise Refused(413, f"{len(prompts)} prompts x n {params.n} = {sequences} sequences: at most {limits.max_sequences} "
                           "per request (the server's --max-sequences)")
    tokens = params.n * (sum(map(len, prompts)) + len(prompts) * params.max_new_tokens)
    if tokens > limits.max_request_tokens:
        raise Refused(413, f"n x (prompt tokens + max_new_tokens) = {tokens} tokens: at most {limits.max_request_tokens} "
                           "per request (the server's --max-request-tokens)")
