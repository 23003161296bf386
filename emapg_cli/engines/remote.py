"""`RemoteEngine`: the `Engine` of a rollout server (`emapg rollout serve`) in another process, at `rollout.engine_url`.

Control is JSON over HTTP (engines/rollout_protocol.py), each request within `timeout_s` from its start to its last
byte (emapg_cli/http_client.py: a server that drips its reply is abandoned at the deadline). Weights go as raw tensor
bytes in the body of `/weights/push`. It is a versioned engine (engines/base.py): `push_weights(model, version)` connects at the first
push (the server's token then goes with every request), sends every parameter (cast to the server's dtype, one
tensor at a time) and returns once the server received and checked it; the server applies it between generations.
A `generate` without `SamplingParams.min_version` asks for exactly the version pushed last, so the synchronous loop
never samples from older weights; with `min_version` it takes any version at least that (the asynchronous pipeline)
and each `Completion.weights_version` says which one sampled it. The reply's token ids are checked against the
model's vocabulary. With `EMAPG_ROLLOUT_SECRET` set, every request carries it. Every failure is one line
(UserError): a server that is down, is not a rollout server, speaks another protocol, serves another model or
tokenizer, does not answer within `timeout_s`, refuses a push, or sends ids outside the vocabulary.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.parse
from http.client import HTTPException
from typing import Any, Iterator, Optional

from emapg_cli import http_client
from emapg_cli.engines.base import CancelHook, Cancelled, Completion, EngineBase, SamplingParams
from emapg_cli.engines.rollout_protocol import (
    PROTOCOL, SECRET_ENV, ProtocolError, completions_from_json, manifest, params_to_json, push_header,
)
from emapg_cli.errors import UserError

#: Largest reply read (bytes): completions with top-k ids can be large, but not unbounded.
MAX_REPLY_BYTES = 4 << 30
#: The share of `timeout_s` a generate request may wait at the server for its weights version (the server's
#: one-line 504 then names the version it waited for, before this side's socket timeout fires).
WAIT_SHARE = 0.9


def check_engine_url(url: Any) -> str:
    """`url` when it is http://HOST:PORT (a path is ignored); ValueError (one line) otherwise."""
    parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError("must be the http://HOST:PORT of a rollout server (`emapg rollout serve`), e.g. http://127.0.0.1:8100")
    return url.rstrip("/")


def named_tensors(model: Any) -> list[tuple[str, Any]]:
    """(name, parameter) of `model` in transformers' naming (unwrapped from DDP / torch.compile; tied weights once)."""
    module = getattr(model, "module", model)
    module = getattr(module, "_orig_mod", module)
    return [(n, p.detach()) for n, p in module.named_parameters()]


class RemoteEngine(EngineBase):
    """A rollout server's engine, reached over HTTP (see the module's docstring)."""

    versioned = True
    shares_weights = False

    def __init__(self, url: str, timeout_s: float = 1800.0):
        """Reads the server's /health (one-line UserError when it is down or not a rollout server of this
        protocol); `check_compatible` then compares the model and the tokenizer."""
        try:
            self.url = check_engine_url(url)
        except ValueError as e:
            raise UserError(f"rollout.engine_url {e}, got {url!r:.100}") from None
        self.timeout_s = timeout_s
        self._secret = os.environ.get(SECRET_ENV) or None
        health = self._request("GET", "/health")
        if not isinstance(health, dict) or "protocol" not in health or not isinstance(health.get("model"), dict):
            raise UserError(f"rollout server {self.url}: /health answers, but not as an emapg rollout server")
        if health["protocol"] != PROTOCOL:
            raise UserError(f"rollout server {self.url} speaks protocol {http_client.one_line(health['protocol'], 20)}, this emapg "
                            f"speaks {PROTOCOL}: run the same emapg version on both sides")
        self.health = health
        self.records_topk = bool(health.get("records_topk"))
        self.engine_name = str(health.get("engine"))
        self.weights_version: int = int(health.get("weights_version", -1))
        vocab = health["model"].get("vocab_size")
        self._vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None
        self.wait_s = 0.0
        self._pushed = False
        self._token: Optional[str] = None  # what the server's /weights/connect returned
        self._lock = threading.Lock()  # one push at a time
        self._wait_lock = threading.Lock()  # wait_s updates
        self._full_vocab: dict[tuple, bool] = {}

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, body: Optional[dict] = None, timeout_s: Optional[float] = None,
                 raw: Optional[Iterator[Any]] = None, raw_length: int = 0) -> Any:
        """The parsed JSON reply of one request (all of it within the timeout); one-line UserError otherwise. `raw`:
        buffers sent in order as an octet-stream body of `raw_length` bytes instead of `body`."""
        headers = {"Content-Type": "application/octet-stream" if raw is not None else "application/json"}
        if self._secret:
            headers["Authorization"] = f"Bearer {self._secret}"
        timeout = timeout_s or self.timeout_s
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        try:
            reply = http_client.request(self.url + path, method, data, timeout_s=timeout, max_reply_bytes=MAX_REPLY_BYTES,
                                        headers=headers, body_length=raw_length)
        except http_client.Deadline:
            raise UserError(f"rollout server {self.url}{path}: no reply within {timeout:g} s (rollout.engine_timeout_s)") from None
        except http_client.ReplyTooLarge:
            raise UserError(f"rollout server {self.url}{path}: reply over {MAX_REPLY_BYTES} bytes") from None
        except (OSError, HTTPException, ValueError) as e:
            raise UserError(f"rollout server {self.url}: cannot reach it ({http_client.one_line(e, 120) or type(e).__name__}); is "
                            "`emapg rollout serve` running there?") from None
        if reply.status != 200:
            said = http_client.server_error(reply.body)
            if reply.status == 404 and path == "/health":
                raise UserError(f"rollout server {self.url}: no /health route there (not an emapg rollout server?)")
            if reply.status == 401 and not self._secret:
                said += f" ({SECRET_ENV} is not set here)"
            raise UserError(f"rollout server {self.url}{path}: HTTP {reply.status}{': ' + said if said else ''}")
        try:
            return json.loads(reply.body)
        except (ValueError, RecursionError):
            raise UserError(f"rollout server {self.url}{path}: the reply is not JSON (not an emapg rollout server?)") from None

    # ------------------------------------------------------------------ checks
    def check_compatible(self, model: Any, tokenizer: Any) -> None:
        """Refuse (one line) a server whose model or tokenizer is not the trainer's: the fingerprints of
        models/fingerprint.py, the first field that differs named."""
        from emapg_cli.models.fingerprint import first_difference, module_fingerprint, tokenizer_fingerprint

        differs = first_difference(module_fingerprint(model), self.health.get("model"))
        if differs:
            raise UserError(f"rollout server {self.url} serves another model ({differs}): start it with the run's model.path")
        if self.health.get("tokenizer") != tokenizer_fingerprint(tokenizer):
            raise UserError(f"rollout server {self.url} has another tokenizer (vocabulary, special tokens or chat "
                            "template differ): start it with the run's model.path")

    # ------------------------------------------------------------------ Engine
    def generate(self, prompts: list[list[int]], params: SamplingParams, cancelled: CancelHook = None) -> list[list[Completion]]:
        """`params.n` completions per prompt from the server: exactly the version pushed last (no `min_version`),
        or any version >= `params.min_version`. `cancelled` is polled before the request is sent (as vLLM's)."""
        if not prompts:
            return []
        if cancelled is not None and cancelled():
            raise Cancelled("the generation was cancelled")
        exact = self.weights_version if params.min_version is None and self._pushed else None
        reply = self._request("POST", "/generate", {"prompts": [list(map(int, p)) for p in prompts], "params": params_to_json(params),
                                                    # the server gives up first: its 504 says which version
                                                    "version": exact, "timeout_s": WAIT_SHARE * self.timeout_s,
                                                    "token": self._token})
        try:
            rows, _, waited = completions_from_json(reply, len(prompts), params.n, self._vocab, params.max_new_tokens)
        except ProtocolError as e:
            raise UserError(f"rollout server {self.url}/generate: unexpected reply ({e})") from None
        with self._wait_lock:  # not the push's lock: a background generate returns while a push runs
            self.wait_s += waited
        return rows

    def full_vocab_logprobs(self, params: SamplingParams) -> bool:
        """The server engine's answer for `params` (asked once per distinct sampling settings)."""
        key = (params.temperature, params.top_p)
        if key not in self._full_vocab:
            reply = self._request("POST", "/full_vocab_logprobs", {"params": params_to_json(params)})
            self._full_vocab[key] = bool(reply.get("value")) if isinstance(reply, dict) else False
        return self._full_vocab[key]

    def load_weights(self, model) -> None:
        """`push_weights(model, weights_version + 1)`."""
        self.push_weights(model, self.weights_version + 1)

    def push_weights(self, model, version: int) -> None:
        """Send `model`'s parameters as `version` (asking the server for a session, its token, at the first push);
        returns once the server received and checked them."""
        dtype = self.health.get("dtype")
        with self._lock:
            if self._token is None:
                self._connect()
            named = named_tensors(model)
            head = push_header(int(version), self._token, manifest([(n, _Shape(t, dtype)) for n, t in named]))
            size = sum(_Shape(t, dtype).nbytes for _, t in named)  # the tensors in the body, cast one at a time as sent
            self._request("POST", "/weights/push", raw=_body(head, named, dtype), raw_length=len(head) + size)
            self.weights_version, self._pushed = int(version), True

    def _connect(self) -> None:
        """Ask the server for a session: its token, which every request carries from then on."""
        reply = self._request("POST", "/weights/connect", {"backend": "http"})
        self._token = reply.get("token") if isinstance(reply, dict) else None


def _body(head: bytes, named: list[tuple[str, Any]], dtype: Optional[str]) -> Iterator[Any]:
    """A push's body: its header, then each tensor's bytes in the server's dtype (cast on CPU one at a time)."""
    import torch

    yield memoryview(head)
    for _, t in named:
        t = t.to(getattr(torch, dtype)) if dtype else t
        yield memoryview(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


class _Shape:
    """A tensor's name-less (dtype, shape) as the push's manifest reads it (`dtype` the server's), and its bytes."""

    def __init__(self, t: Any, dtype: Optional[str]):
        import torch

        self.shape = t.shape
        self.dtype = getattr(torch, dtype) if dtype else t.dtype
        self.nbytes = t.numel() * torch.empty((), dtype=self.dtype).element_size()

