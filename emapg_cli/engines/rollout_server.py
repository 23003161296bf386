"""`emapg rollout serve`'s HTTP front: the routes of engines/rollout_protocol.py over a `RolloutService`.

The standard library's threading `http.server` (no web framework): a trainer sends a few requests per RL step.
Bodies are read only up to a declared `Content-Length` of at most `max_body_bytes`; each socket read and write has
`io_timeout_s`; every refusal is a status with a one-line JSON `{"error": "..."}` (no traceback reaches a client; an
unexpected failure is a 500 naming its type and message). Generation and weight updates are ordered by the
service's lock, not here.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from typing import Any

from emapg_cli.engines.rollout_protocol import ProtocolError, params_from_json, token_lists
from emapg_cli.engines.rollout_service import RolloutService, Unavailable
from emapg_cli.http_reply import write_json

#: Largest request body (bytes): prompts as token ids (a 64-prompt step of 2,048-token prompts is about 1 MB).
MAX_BODY = 256 << 20
#: Seconds each socket read or write may take.
IO_TIMEOUT_S = 60.0
#: Longest a generate request may wait for its weights version when it names no timeout.
WAIT_TIMEOUT_S = 600.0


class RolloutServer(ThreadingMixIn, HTTPServer):
    """`HTTPServer` with one daemon thread per connection, over one `RolloutService`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], service: RolloutService, max_body_bytes: int = MAX_BODY,
                 io_timeout_s: float = IO_TIMEOUT_S, openai: Any = None):
        self.service, self.max_body_bytes, self.io_timeout_s = service, max_body_bytes, io_timeout_s
        self.openai = openai  # `--openai`: an OpenAIService answering /v1/... (engines/openai_http.py)
        super().__init__(address, _Handler)

    def handle_error(self, request, client_address) -> None:
        """A connection that failed (reset, timed out) is dropped quietly; the server stays up."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RolloutServer

    def setup(self) -> None:
        self.timeout = self.server.io_timeout_s
        super().setup()

    def _send(self, code: int, body: dict) -> None:
        write_json(self, code, json.dumps(body).encode())

    def send_error(self, code: int, message: Any = None, explain: Any = None) -> None:
        """http.server's own refusals (bad request line, headers too long) as JSON too."""
        self.close_connection = True
        try:
            self._send(code, {"error": message or self.responses.get(code, ("error",))[0]})
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:  # one line per request is noise here
        pass

    def _openai(self, method: str) -> bool:
        """`--openai`: answer a /v1/... request with OpenAI's wire format (engines/openai_http.py)."""
        if self.server.openai is None or not self.path.startswith("/v1/"):
            return False
        from emapg_cli.engines.openai_http import answer

        answer(self, self.server.openai, method)
        return True

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self._openai("GET"):
            return
        if self.path == "/health":
            self._send(200, self.server.service.health())
        else:
            self._send(404, {"error": f"no route GET {self.path[:100]} (GET /health)"})

    def _body(self) -> Any:
        """The parsed JSON body; ProtocolError (answered 400/411/413 by `do_POST`) when it cannot be read."""
        text = (self.headers.get("Content-Length") or "").strip()
        if not (text.isascii() and text.isdigit()) or len(text) > 12:
            self.close_connection = True
            raise ProtocolError("a Content-Length header is required")
        length = int(text)
        if length > self.server.max_body_bytes:
            self.close_connection = True
            raise ProtocolError(f"body of {length} bytes: at most {self.server.max_body_bytes}")
        data = self.rfile.read(length)
        if len(data) != length:
            self.close_connection = True
            raise ProtocolError("the body ended early")
        try:
            return json.loads(data or b"null")
        except (ValueError, RecursionError) as e:
            raise ProtocolError(f"the body is not JSON: {_one_line(e)[:100]}") from None

    def do_POST(self) -> None:  # noqa: N802
        if self._openai("POST"):
            return
        route = {"/generate": self._generate, "/full_vocab_logprobs": self._full_vocab,
                 "/weights/connect": self._connect, "/weights/push": self._push}.get(self.path)
        if route is None:
            self.close_connection = True
            self._send(404, {"error": f"no route POST {self.path[:100]} (/generate, /full_vocab_logprobs, /weights/connect, /weights/push)"})
            return
        try:
            request = self._body()
            if not isinstance(request, dict):
                raise ProtocolError("the body must be a JSON object")
            code, reply = 200, route(request)
        except ProtocolError as e:
            code, reply = 400, {"error": str(e)}
        except Unavailable as e:
            code, reply = e.code, {"error": str(e)}
        except Exception as e:  # never a traceback to the client; the server keeps serving
            code, reply = 500, {"error": f"{type(e).__name__}: {_one_line(e)}"}
        try:
            self._send(code, reply)
        except OSError:
            self.close_connection = True

    def _generate(self, request: dict) -> dict:
        from emapg_cli.engines.rollout_protocol import completion_to_json

        service = self.server.service
        prompts = token_lists(request.get("prompts"), "prompts", service.served.fingerprint.get("vocab_size"))
        params = params_from_json(request.get("params"))
        version = request.get("version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ProtocolError("version must be an integer or null")
        timeout = request.get("timeout_s", WAIT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise ProtocolError("timeout_s must be a number of seconds in (0, 86400]")
        rows, used, waited = service.generate(prompts, params, version, float(timeout))
        return {"completions": [[completion_to_json(c) for c in row] for row in rows], "weights_version": used,
                "wait_s": waited}

    def _full_vocab(self, request: dict) -> dict:
        return {"value": bool(self.server.service.served.engine.full_vocab_logprobs(params_from_json(request.get("params"))))}

    def _connect(self, request: dict) -> dict:
        host, port, backend, timeout = (request.get(k) for k in ("host", "port", "backend", "timeout_s"))
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ProtocolError("connect needs a host string and a port in 1..65535")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise ProtocolError("timeout_s must be a number of seconds in (0, 86400]")
        return {"ok": True, "session": self.server.service.connect(host, port, str(backend), float(timeout))}

    def _push(self, request: dict) -> dict:
        version = request.get("version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ProtocolError("version must be an integer")
        self.server.service.push(version, request.get("tensors"), request.get("session"))
        return {"ok": True}


def make_server(service: RolloutService, host: str = "127.0.0.1", port: int = 8100, max_body_bytes: int = MAX_BODY,
                io_timeout_s: float = IO_TIMEOUT_S, openai: Any = None) -> RolloutServer:
    """A bound (not yet serving) server; call `serve_forever()` (port 0: a free one, in `server.server_address`).
    `openai`: an `OpenAIService` that also answers OpenAI's routes (`emapg rollout serve --openai`)."""
    return RolloutServer((host, port), service, max_body_bytes=max_body_bytes, io_timeout_s=io_timeout_s, openai=openai)
