"""`RemoteEngine`: the `Engine` of a rollout server (`emapg rollout serve`) in another process, at `rollout.engine_url`.

Control is JSON over HTTP (engines/rollout_protocol.py); weights go as raw tensors over a two-process
torch.distributed group (engines/weight_channel.py: gloo, or NCCL when both sides have CUDA), opened at the first
push. It is a versioned engine (engines/base.py): `push_weights(model, version)` sends every parameter (cast to the
server's dtype, one tensor at a time) and returns once sent; the server applies it between generations. A
`generate` without `SamplingParams.min_version` asks for exactly the version pushed last, so the synchronous loop
never samples from older weights; with `min_version` it takes any version at least that (the asynchronous
pipeline) and each `Completion.weights_version` says which one sampled it. Every failure is one line (UserError):
a server that is down, is not a rollout server, speaks another protocol, serves another model or tokenizer, does
not answer within `timeout_s`, or drops the weight channel.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional

from emapg_cli.engines.base import Completion, EngineBase, SamplingParams
from emapg_cli.engines.rollout_protocol import PROTOCOL, ProtocolError, completions_from_json, params_to_json
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


def _one_line(text: Any, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def named_tensors(model: Any) -> list[tuple[str, Any]]:
    """(name, parameter) of `model` in transformers' naming (unwrapped from DDP / torch.compile; tied weights once)."""
    module = getattr(model, "module", model)
    module = getattr(module, "_orig_mod", module)
    return [(n, p.detach()) for n, p in module.named_parameters()]


class RemoteEngine(EngineBase):
    """A rollout server's engine, reached over HTTP (see the module's docstring)."""

    versioned = True
    shares_weights = False

    def __init__(self, url: str, timeout_s: float = 1800.0, weights_backend: str = "auto"):
        """Reads the server's /health (one-line UserError when it is down or not a rollout server of this
        protocol); `check_compatible` then compares the model and the tokenizer. `weights_backend`: the weight
        channel's torch.distributed backend, gloo, nccl, or auto (nccl when both sides are on CUDA, else gloo)."""
        try:
            self.url = check_engine_url(url)
        except ValueError as e:
            raise UserError(f"rollout.engine_url {e}, got {url!r:.100}") from None
        self.timeout_s, self.weights_backend = timeout_s, weights_backend
        self._opener = urllib.request.build_opener(_NoRedirect)
        health = self._request("GET", "/health")
        if not isinstance(health, dict) or "protocol" not in health or not isinstance(health.get("model"), dict):
            raise UserError(f"rollout server {self.url}: /health answers, but not as an emapg rollout server")
        if health["protocol"] != PROTOCOL:
            raise UserError(f"rollout server {self.url} speaks protocol {_one_line(health['protocol'], 20)}, this emapg "
                            f"speaks {PROTOCOL}: run the same emapg version on both sides")
        self.health = health
        self.records_topk = bool(health.get("records_topk"))
        self.engine_name = str(health.get("engine"))
        self.weights_version: int = int(health.get("weights_version", -1))
        self.wait_s = 0.0
        self._pushed = False
        self._channel: Any = None
        self._session: Any = None  # the server's number of this client's weight channel
        self._lock = threading.Lock()  # one push at a time
        self._wait_lock = threading.Lock()  # wait_s updates
        self._full_vocab: dict[tuple, bool] = {}

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, body: Optional[dict] = None, timeout_s: Optional[float] = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        timeout = timeout_s or self.timeout_s
        try:
            with self._opener.open(request, timeout=timeout) as response:
                raw = response.read(MAX_REPLY_BYTES + 1)
        except urllib.error.HTTPError as e:
            said = self._server_says(e)
            if e.code == 404 and path == "/health":
                raise UserError(f"rollout server {self.url}: no /health route there (not an emapg rollout server?)") from None
            raise UserError(f"rollout server {self.url}{path}: HTTP {e.code}{': ' + said if said else ''}") from None
        except (TimeoutError, socket.timeout):
            raise UserError(f"rollout server {self.url}{path}: no reply within {timeout:g} s (rollout.engine_timeout_s)") from None
        except (urllib.error.URLError, ConnectionError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise UserError(f"rollout server {self.url}{path}: no reply within {timeout:g} s (rollout.engine_timeout_s)") from None
            raise UserError(f"rollout server {self.url}: cannot reach it ({_one_line(reason, 120)}); is `emapg rollout "
                            "serve` running there?") from None
        if len(raw) > MAX_REPLY_BYTES:
            raise UserError(f"rollout server {self.url}{path}: reply over {MAX_REPLY_BYTES} bytes")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise UserError(f"rollout server {self.url}{path}: the reply is not JSON (not an emapg rollout server?)") from None

    @staticmethod
    def _server_says(e: urllib.error.HTTPError) -> str:
        try:
            said = json.loads(e.read(4096).decode("utf-8"))["error"]
            return _one_line(said) if isinstance(said, str) else ""
        except Exception:  # any other body: the status alone says enough
            return ""

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
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per prompt from the server: exactly the version pushed last (no `min_version`),
        or any version >= `params.min_version`."""
        if not prompts:
            return []
        exact = self.weights_version if params.min_version is None and self._pushed else None
        reply = self._request("POST", "/generate", {"prompts": [list(map(int, p)) for p in prompts], "params": params_to_json(params),
                                                    # the server gives up waiting first: its 504 says which version
                                                    "version": exact, "timeout_s": WAIT_SHARE * self.timeout_s})
        try:
            rows, _, waited = completions_from_json(reply, len(prompts), params.n)
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
        """Send `model`'s parameters as `version` (opening the weight channel at the first push); returns once sent."""
        from emapg_cli.engines.rollout_protocol import manifest

        dtype = self.health.get("dtype")
        with self._lock:
            channel = self._channel or self._connect()
            named = named_tensors(model)
            rows = manifest([(n, _Shape(t, dtype)) for n, t in named])
            self._request("POST", "/weights/push", {"version": int(version), "session": self._session, "tensors": rows})
            try:
                for _, t in named:
                    channel.send(_cast(t, dtype, channel.backend))
            except Exception as e:  # gloo/NCCL errors are long and multi-line: one line, the channel dropped
                self._channel = None
                raise UserError(f"rollout server {self.url}: the weight push of version {version} failed "
                                f"({_one_line(e, 160)})") from None
            self.weights_version, self._pushed = int(version), True

    def _connect(self):
        """Host the store, ask the server to join, build this end of the group (rank 0)."""
        import torch

        from emapg_cli.engines.weight_channel import TRAINER, WeightChannel, host_store

        parsed = urllib.parse.urlsplit(self.url)
        try:  # the address this machine reaches the server from is one the server can reach back
            with socket.create_connection((parsed.hostname, parsed.port or 80), timeout=10) as s:
                host = s.getsockname()[0]
        except OSError as e:
            raise UserError(f"rollout server {self.url}: cannot reach it ({_one_line(e, 120)})") from None
        backend = self.weights_backend
        if backend == "auto":  # two processes on one GPU cannot form an NCCL group: set gloo there
            backend = "nccl" if torch.cuda.is_available() and str(self.health.get("device", "")).startswith("cuda") else "gloo"
        store = host_store(host, self.timeout_s)
        reply = self._request("POST", "/weights/connect", {"host": host, "port": store.port, "backend": backend, "timeout_s": self.timeout_s})
        self._session = reply.get("session") if isinstance(reply, dict) else None
        try:
            self._channel = WeightChannel(store, TRAINER, backend, self.timeout_s)
        except Exception as e:
            raise UserError(f"rollout server {self.url}: the weight channel ({backend}) did not open ({_one_line(e, 160)})") from None
        return self._channel


class _Shape:
    """A tensor's name-less (dtype, shape) as the push's manifest reads it (`dtype` the server's)."""

    def __init__(self, t: Any, dtype: Optional[str]):
        import torch

        self.shape = t.shape
        self.dtype = getattr(torch, dtype) if dtype else t.dtype


def _cast(t: Any, dtype: Optional[str], backend: str) -> Any:
    """`t` in the server's dtype, on the device the channel's backend sends from."""
    import torch

    t = t.to(getattr(torch, dtype)) if dtype else t
    return t.to("cuda") if backend == "nccl" else t.cpu()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is reported as the HTTP error it is, never followed."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None
