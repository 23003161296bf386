"""The rollout server's wire format (docs/rollout_server.md): JSON bodies for control, checked field by field.

Pure conversions, no I/O: `SamplingParams` and `Completion` to and from JSON objects, the manifest of a weight
push and the framing of its body. Arrays travel as base64 of little-endian binary (log-probs float64, top-k ids
int32), which keeps a reply with top-k ids a few times smaller than JSON numbers and its floats exact. Nothing is
ever pickled: a peer can only make the other side parse JSON and fixed-width numbers. Every malformed field raises
`ProtocolError` naming it; a reply's token ids are checked against the vocabulary and its length against the
request's `max_new_tokens` (a hostile server's ids would index past the trainer's embedding).

Every request carries `Authorization: Bearer <secret>` when the server was started with a secret
(`SECRET_ENV`); `token` is what `/weights/connect` returned to the trainer that connected last.

  GET  /health            -> {"status": "ok", "protocol", "engine", "dtype", "model": {fingerprint}, "tokenizer": sha256,
                              "weights_version", "records_topk", "connected", "device", "limits"}
  POST /generate          {"prompts": [[int]], "params": {SamplingParams}, "version": int | null, "timeout_s", "token"}
                          -> {"completions": [[{completion}]], "weights_version", "wait_s"}
  POST /full_vocab_logprobs {"params": {SamplingParams}} -> {"value": bool}
  POST /weights/connect   {"backend": "http"} -> {"ok": true, "token": str}
  POST /weights/push      (application/octet-stream) 8-byte little-endian length L, then L bytes of JSON
                          {"version": int, "token": str, "tensors": [[name, dtype, [shape]], ...]}, then
                          each tensor's bytes in that order -> {"ok": true} once received and checked
"""

from __future__ import annotations

import base64
from dataclasses import asdict, fields
from typing import Any, Optional

import numpy as np

from emapg_cli.engines.base import Completion, SamplingParams

#: Bumped whenever a request or reply changes shape; client and server must agree. 2 (issue 32): the connect's token
#: on every request, the weights in the push's own body (backend http), the server's limits in /health.
PROTOCOL = 2
#: The environment variable holding the shared secret, on both sides (`emapg rollout serve --secret` reads it too).
SECRET_ENV = "EMAPG_ROLLOUT_SECRET"
#: The push body's first field: the length of its JSON header, little-endian unsigned 64-bit.
HEADER_BYTES = 8
#: The dtypes a push may carry (their names as `str(torch.dtype)` without the "torch." prefix).
DTYPES = ("float32", "bfloat16", "float16")


class ProtocolError(ValueError):
    """A request or reply that does not have the protocol's shape (one line naming the field)."""


def _int(value: Any, name: str, lo: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
        raise ProtocolError(f"{name} must be an integer{'' if lo is None else f' >= {lo}'}, got {str(value)[:40]}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ProtocolError(f"{name} must be a number, got {str(value)[:40]}")
    return float(value)


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    """`params` as a JSON object (every field, `stop` as a list)."""
    out = asdict(params)
    out["stop"] = list(params.stop)
    return out


def params_from_json(obj: Any) -> SamplingParams:
    """The `SamplingParams` of a request; `ProtocolError` on an unknown key or a value of the wrong type."""
    if not isinstance(obj, dict):
        raise ProtocolError("params must be an object")
    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ProtocolError(f"params has unknown key {unknown[0]!r:.40}")
    kw: dict[str, Any] = {}
    for key, lo in (("n", 1), ("max_new_tokens", 1), ("seed", 0), ("topk", 0)):
        if key in obj:
            kw[key] = _int(obj[key], f"params.{key}", lo)
    for key in ("temperature", "top_p"):
        if key in obj:
            kw[key] = _float(obj[key], f"params.{key}")
    if obj.get("min_version") is not None:
        kw["min_version"] = _int(obj["min_version"], "params.min_version")
    if "stop" in obj:
        if not isinstance(obj["stop"], list) or not all(isinstance(s, str) for s in obj["stop"]):
            raise ProtocolError("params.stop must be a list of strings")
        kw["stop"] = tuple(obj["stop"])
    return SamplingParams(**kw)


def token_lists(obj: Any, name: str, vocab: Optional[int] = None) -> list[list[int]]:
    """A list of lists of token ids in [0, vocab); `ProtocolError` otherwise."""
    if not isinstance(obj, list) or not all(isinstance(p, list) for p in obj):
        raise ProtocolError(f"{name} must be a list of lists of token ids")
    for i, p in enumerate(obj):
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t and (vocab is None or t < vocab) for t in p):
            raise ProtocolError(f"{name}[{i}] holds something other than token ids in [0, {vocab})")
    return obj


def _pack(values: Any, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode("ascii")


def _unpack(text: Any, dtype: str, name: str) -> np.ndarray:
    if not isinstance(text, str):
        raise ProtocolError(f"{name} must be a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ProtocolError(f"{name} is not base64") from None
    if len(raw) % np.dtype(dtype).itemsize:
        raise ProtocolError(f"{name} has {len(raw)} bytes, not a whole number of {dtype}")
    return np.frombuffer(raw, dtype=dtype)


def completion_to_json(c: Completion) -> dict[str, Any]:
    """One completion: token ids, text, finish_reason, log-probs (base64 float64, or null) and top-k ids (base64
    int32 with their k, or null)."""
    out: dict[str, Any] = {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
                           "logprobs": None if c.logprobs is None else _pack(c.logprobs, "<f8"), "topk": None, "k": 0}
    if c.topk_index is not None:
        index = np.asarray(c.topk_index.cpu() if hasattr(c.topk_index, "cpu") else c.topk_index)  # [len, k]
        out["topk"], out["k"] = _pack(index, "<i4"), int(index.shape[-1]) if index.ndim == 2 else 0
    return out


def completion_from_json(obj: Any, version: Optional[int], vocab: Optional[int] = None,
                         max_tokens: Optional[int] = None) -> Completion:
    """A `Completion` of a reply (its `weights_version` set to the reply's); `ProtocolError` on a malformed one: token
    and top-k ids outside [0, vocab), more than `max_tokens` tokens, log-probs that are NaN or positive."""
    import torch

    if not isinstance(obj, dict):
        raise ProtocolError("a completion must be an object")
    ids = token_lists([obj.get("token_ids")], "token_ids", vocab)[0]
    if max_tokens is not None and len(ids) > max_tokens:
        raise ProtocolError(f"a completion of {len(ids)} tokens for max_new_tokens {max_tokens}")
    if not isinstance(obj.get("text"), str) or obj.get("finish_reason") not in ("stop", "length"):
        raise ProtocolError("a completion needs a text string and finish_reason stop or length")
    logprobs = None
    if obj.get("logprobs") is not None:
        values = _unpack(obj["logprobs"], "<f8", "logprobs")
        if len(values) != len(ids):
            raise ProtocolError(f"{len(values)} log-probs for {len(ids)} tokens")
        if not (values <= 0).all():  # NaN compares false: refused with the positive ones
            raise ProtocolError("log-probs that are NaN or above 0")
        logprobs = values.tolist()
    topk = None
    if obj.get("topk") is not None:
        k = _int(obj.get("k"), "k", 1)
        flat = _unpack(obj["topk"], "<i4", "topk")
        if flat.size != k * len(ids):
            raise ProtocolError(f"{flat.size} top-k ids for {len(ids)} tokens x k {k}")
        if flat.size and (flat.min() < 0 or (vocab is not None and flat.max() >= vocab)):
            raise ProtocolError(f"top-k ids outside [0, {vocab})")
        topk = torch.from_numpy(flat.astype(np.int64)).view(len(ids), k)  # [len, k]
    return Completion(token_ids=ids, text=obj["text"], finish_reason=obj["finish_reason"], logprobs=logprobs,
                      topk_index=topk, weights_version=version)


def completions_from_json(reply: Any, prompts: int, n: int, vocab: Optional[int] = None,
                          max_tokens: Optional[int] = None) -> tuple[list[list[Completion]], int, float]:
    """(completions per prompt, weights_version, wait_s) of a /generate reply for `prompts` prompts x `n`, each
    checked by `completion_from_json` against `vocab` and `max_tokens`."""
    if not isinstance(reply, dict) or not isinstance(reply.get("completions"), list):
        raise ProtocolError('the reply has no "completions" list')
    version = _int(reply.get("weights_version"), "weights_version")
    wait_s = _float(reply.get("wait_s", 0.0), "wait_s")
    rows = reply["completions"]
    if len(rows) != prompts or not all(isinstance(r, list) and len(r) == n for r in rows):
        raise ProtocolError(f"the reply does not hold {n} completions for each of {prompts} prompts")
    return [[completion_from_json(c, version, vocab, max_tokens) for c in row] for row in rows], version, wait_s


def manifest(named: list[tuple[str, Any]]) -> list[list[Any]]:
    """[[name, dtype, shape], ...] of the tensors of a push, in the order they are sent."""
    return [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in named]


def check_manifest(obj: Any, expected: dict[str, tuple[str, list[int]]]) -> list[tuple[str, str, list[int]]]:
    """A push's manifest checked against the server's parameters {name: (dtype, shape)}: every parameter once,
    with its dtype and shape; `ProtocolError` naming the first mismatch."""
    if not isinstance(obj, list):
        raise ProtocolError("tensors must be a list of [name, dtype, shape]")
    seen: list[tuple[str, str, list[int]]] = []
    for row in obj:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and isinstance(row[1], str)
                and isinstance(row[2], list)):
            raise ProtocolError("each tensor must be [name, dtype, shape]")
        name, dtype, shape = row
        if name not in expected:
            raise ProtocolError(f"the server's model has no parameter {name!r:.80}")
        if (dtype, shape) != (expected[name][0], list(expected[name][1])):
            raise ProtocolError(f"{name:.80}: {dtype} {shape} pushed, the server holds {expected[name][0]} {list(expected[name][1])}")
        seen.append((name, dtype, shape))
    names = {n for n, _, _ in seen}
    if len(names) != len(seen) or names != set(expected):
        missing = sorted(set(expected) - names)
        raise ProtocolError(f"the push misses parameter {missing[0]!r:.80}" if missing else "the push repeats a parameter")
    return seen


def push_header(version: int, token: str, rows: list[list[Any]]) -> bytes:
    """The start of a push's body: `HEADER_BYTES` of length, then the JSON {"version", "token", "tensors": rows}."""
    import json

    head = json.dumps({"version": version, "token": token, "tensors": rows}).encode()
    return len(head).to_bytes(HEADER_BYTES, "little") + head


def header_length(prefix: bytes, cap: int) -> int:
    """The JSON header's length from a push body's first `HEADER_BYTES`; `ProtocolError` when over `cap`."""
    length = int.from_bytes(prefix, "little")
    if length > cap:
        raise ProtocolError(f"a push header of {length} bytes: at most {cap}")
    return length


def parse_push_header(data: bytes) -> tuple[int, Any, Any]:
    """(version, token, tensors) of a push's JSON header; `ProtocolError` when it is not that."""
    import json

    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        raise ProtocolError("the push header is not JSON") from None
    if not isinstance(obj, dict) or set(obj) != {"version", "token", "tensors"}:
        raise ProtocolError('the push header must be {"version", "token", "tensors"}')
    return _int(obj["version"], "version"), obj["token"], obj["tensors"]


def tensor_bytes(rows: list[tuple[str, str, list[int]]]) -> int:
    """Bytes of the tensors a (checked) manifest lists."""
    import math

    import torch

    return sum(torch.empty((), dtype=getattr(torch, dtype)).element_size() * math.prod(shape) for _, dtype, shape in rows)
