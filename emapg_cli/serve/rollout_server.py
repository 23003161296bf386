"""`emapg rollout serve`'s HTTP front: the routes of engines/rollout_protocol.py over a `RolloutService`.

A `BoundedServer` (emapg_cli/serve/http_server.py, as the retriever server): at most `max_connections` connections, each
request read within `timeout_s` (idle and half-sent connections are dropped), a JSON body read only up to its one
`Content-Length`, at most `max_body_bytes`, and parsed one at a time; running out of file descriptors pauses
accepting. What a generation may ask is checked by serve/request_limits.py (every route that generates calls it).
A weight push's body is read exactly as its manifest declares (serve/rollout_weights.py). With a `secret`, every
request must carry `Authorization: Bearer <secret>` (401 otherwise). Every refusal is a status with a one-line JSON
`{"error": "..."}` (no traceback reaches a client; an unexpected failure is a 500 naming its type and message).
With `openai` (`--openai`), the `/v1/...` paths are OpenAI's routes (serve/openai_http.py), on the same limits,
secret and deadlines; their refusals are OpenAI's error body.
Generation and weight updates are ordered by the service's lock, not here.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from emapg_cli.http_client import one_line
from emapg_cli.serve.request_limits import RequestLimits, check_generation
from emapg_cli.engines.rollout_protocol import (
    HEADER_BYTES, ProtocolError, completion_to_json, header_length, params_from_json, parse_push_header, token_lists,
)
from emapg_cli.serve import openai_wire
from emapg_cli.serve.openai_http import answer
from emapg_cli.serve.rollout_service import RolloutService
from emapg_cli.serve.rollout_weights import read_exactly_into
from emapg_cli.serve.http_server import BoundedHandler, BoundedServer, Refused, drain, peer_closed

#: Largest JSON body (bytes): prompts as token ids (a 64-prompt step of 2,048-token prompts is about 1 MB; a body
#: parses into ~36 bytes of Python objects per token id, and bodies are parsed one at a time).
MAX_BODY = 32 << 20
#: Seconds a connection has to send each full request (and to take each reply); an idle connection is closed after it.
TIMEOUT_S = 60.0
#: Connections served at once; the next ones get a 503 at once.
MAX_CONNECTIONS = 64
#: Longest a generate request may take when it names no timeout.
WAIT_TIMEOUT_S = 600.0
#: The slowest a weight push's bytes may come (bytes per second): its body has `timeout_s` + its size / this.
MIN_PUSH_RATE = 16 << 20
#: Largest Content-Length a push may declare before its manifest is read (its exact size is checked against it).
MAX_PUSH_BYTES = 1 << 44


@dataclass(frozen=True)
class ServerLimits:
    """The server's bounds (the options of `emapg rollout serve`)."""

    max_body_bytes: int = MAX_BODY
    timeout_s: float = TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    request: RequestLimits = field(default_factory=RequestLimits)


class RolloutServer(BoundedServer):
    """A `BoundedServer` over one `RolloutService`, with the request limits and the optional shared secret."""

    watchdog_name = "emapg-rollout-watchdog"

    def __init__(self, address: tuple[str, int], service: RolloutService, limits: ServerLimits = ServerLimits(),
                 secret: Optional[str] = None, openai: Any = None):
        self.service, self.limits, self.secret = service, limits, secret
        self.openai = openai  # `--openai`: an OpenAIService answering /v1/... (serve/openai_http.py)
        super().__init__(address, _Handler, max_connections=limits.max_connections, timeout_s=limits.timeout_s,
                         max_body_bytes=limits.max_body_bytes)

    def error_json(self, code: int, message: str, path: str = "") -> dict:
        """A refusal of an OpenAI route (`--openai`; the accept loop's 503 included) is OpenAI's error body; of the
        others, `{"error": "..."}`."""
        if self.openai is not None and path.startswith("/v1/"):
            return openai_wire.error_json(code, message)
        return super().error_json(code, message, path)


def _keys(request: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(request) - set(allowed))
    if unknown:
        raise ProtocolError(f"the body has unknown key {unknown[0]!r:.40} (known: {', '.join(allowed)})")


class _Handler(BoundedHandler):
    server: RolloutServer

    def _is_openai(self) -> bool:
        return self.server.openai is not None and self.path.startswith("/v1/")

    def _answer(self, work: Callable[[], dict], linger: bool = False) -> None:
        """Reply with what `work()` returns, or with the status of what it raised (one line); `linger`: a refusal
        may leave the body unread (a push), so the connection drops what follows before it closes."""
        try:
            code, reply = 200, work()
        except ProtocolError as e:
            code, reply = 400, {"error": str(e)}
        except Refused as e:
            code, reply = e.code, {"error": str(e)}
        except Exception as e:  # never a traceback to the client; the server keeps serving
            code, reply = 500, {"error": f"{type(e).__name__}: {one_line(e, 300)}".rstrip(": ")}
        if self.send_reply(code, reply) and code != 200 and linger:
            drain(self.connection, 1.0, 1.0)

    def _authorized(self, unread: bool) -> bool:
        secret = self.server.secret
        if secret is None:
            return True
        given = self.headers.get("Authorization") or ""
        if hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {secret}".encode()):
            return True
        self.refuse(401, "this rollout server needs its secret: set EMAPG_ROLLOUT_SECRET to the value it was started "
                         "with (sent as Authorization: Bearer; an OpenAI client's api_key)", unread=unread)
        return False

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if not self._authorized(unread=False):
            return
        if self._is_openai():
            answer(self, self.server.openai, time.monotonic())
        elif self.path == "/health":
            limits = self.server.limits
            self.send_json(200, {**self.server.service.health(), "limits": {**asdict(limits.request),
                                                                            "max_body_bytes": limits.max_body_bytes}})
        else:
            self.send_json(404, {"error": f"no route GET {self.path[:100]} (GET /health)"})

    def do_POST(self) -> None:  # noqa: N802
        arrival = time.monotonic()  # a request's deadline counts from here
        if self._is_openai():
            if self._authorized(unread=True):
                answer(self, self.server.openai, arrival)
            return
        route = {"/generate": self._generate, "/full_vocab_logprobs": self._full_vocab,
                 "/weights/connect": self._connect}.get(self.path)
        if route is None and self.path != "/weights/push":
            self.refuse(404, f"no route POST {self.path[:100]} (/generate, /full_vocab_logprobs, /weights/connect, "
                             "/weights/push)", unread=True)
            return
        if not self._authorized(unread=True):
            return
        if self.path == "/weights/push":
            length = self.content_length(cap=MAX_PUSH_BYTES)
            if length is not None:
                self._answer(lambda: self._push(length), linger=True)
            return
        body = self.read_body()
        if body is not None:
            self.deadline(None)  # the server works: bounded by the request's limits and its own deadline
            self._answer(lambda: route(self._parsed(body), arrival))

    def _parsed(self, body: bytes) -> dict:
        """The JSON object of a body, parsed one body at a time (the parsed objects of one body in memory at once)."""
        request = self.parse_json(body)
        if not isinstance(request, dict):
            raise ProtocolError("the body must be a JSON object")
        return request

    def _generate(self, request: dict, arrival: float) -> dict:
        _keys(request, ("prompts", "params", "version", "timeout_s", "token"))
        service = self.server.service
        prompts = token_lists(request.get("prompts"), "prompts", service.served.fingerprint.get("vocab_size"))
        params = params_from_json(request.get("params"))
        check_generation(prompts, params, self.server.limits.request)
        version = request.get("version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ProtocolError("version must be an integer or null")
        timeout = WAIT_TIMEOUT_S if request.get("timeout_s") is None else request["timeout_s"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise ProtocolError("timeout_s must be a number of seconds in (0, 86400]")
        rows, used, waited = service.generate(prompts, params, version, float(timeout), arrival,
                                              token=request.get("token"), cancelled=self.client_left)
        return {"completions": [[completion_to_json(c) for c in row] for row in rows], "weights_version": used,
                "wait_s": waited}

    def _full_vocab(self, request: dict, arrival: float) -> dict:
        _keys(request, ("params",))
        return {"value": bool(self.server.service.served.engine.full_vocab_logprobs(params_from_json(request.get("params"))))}

    def _connect(self, request: dict, arrival: float) -> dict:
        _keys(request, ("backend",))
        return {"ok": True, "token": self.server.service.connect(str(request.get("backend")))}

    def _push(self, length: int) -> dict:
        """`POST /weights/push` of `length` bytes: the manifest (JSON header), then the tensors' bytes, read exactly as
        the manifest declares."""
        timeout = self.server.timeout_s
        prefix = self.read_exactly(HEADER_BYTES) if length >= HEADER_BYTES else None
        if prefix is None:
            raise ProtocolError("the push body ended before its header")
        head_len = header_length(prefix, min(self.server.max_body_bytes, length - HEADER_BYTES))
        head = self.read_exactly(head_len)
        if head is None:
            raise ProtocolError("the push body ended in its header")
        version, token, tensors = parse_push_header(head)
        size = length - HEADER_BYTES - head_len
        self.deadline(None)  # waiting for the previous version to be applied: bounded by the pusher staying
        started: list[bool] = []

        def read_into(view: memoryview) -> int:
            if not started:  # the tensors' bytes: `timeout` plus their size at MIN_PUSH_RATE
                started.append(True)
                self.deadline(timeout + size / MIN_PUSH_RATE)
            return self.rfile.readinto(view)

        self.server.service.push(token, version, tensors, read_exactly_into(read_into), size,
                                 still_wanted=lambda: not peer_closed(self.connection))
        self.deadline(timeout)
        return {"ok": True}


#: Shortest shared secret accepted.
MIN_SECRET_CHARS = 16


def check_exposure(host: str, secret: Optional[str]) -> None:
    """ValueError (one line) for a secret too short, or for a `host` other than loopback without a secret: anyone
    who reaches the port could push weights or take the server's time."""
    import ipaddress

    if secret is not None and len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"--secret must be at least {MIN_SECRET_CHARS} characters (EMAPG_ROLLOUT_SECRET too), got {len(secret)}")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and secret is None:
        raise ValueError(f"--host {host[:60]} listens beyond this machine: give a shared secret (--secret, or the "
                         "EMAPG_ROLLOUT_SECRET environment variable, the same on the trainer's side)")


def make_server(service: RolloutService, host: str = "127.0.0.1", port: int = 8100,
                limits: ServerLimits = ServerLimits(), secret: Optional[str] = None, openai: Any = None) -> RolloutServer:
    """A bound (not yet serving) server; call `serve_forever()` (port 0: a free one, in `server.server_address`).
    `openai`: an `OpenAIService` that also answers OpenAI's routes (`emapg rollout serve --openai`)."""
    return RolloutServer((host, port), service, limits, secret, openai)
