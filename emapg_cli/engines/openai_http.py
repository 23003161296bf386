"""The HTTP of the OpenAI routes (engines/openai_service.py): one function the rollout server's handler calls for
`/v1/...` paths (`emapg rollout serve --openai`), and a server of those routes alone for the trainer's agent endpoint.

Every reply is JSON; a refusal is OpenAI's error body with a 4xx status (a 500 names an unexpected failure's type and
first line, never a traceback). A body is read only up to its declared `Content-Length`, itself at most
`max_body_bytes` (413 beyond, without reading it); each socket read and write has the server's `io_timeout_s`; the
agent endpoint serves at most `max_connections` connections at once (503 at once beyond: an agent's client is told,
the server is not held). The caller's API key is read from `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from typing import Any, Optional

from emapg_cli.engines.openai_wire import OpenAIError, error_body
from emapg_cli.http_reply import write_json

#: Largest request body (bytes): a long conversation with tool schemas is well below it.
MAX_BODY = 8 << 20
#: Seconds each socket read or write may take.
IO_TIMEOUT_S = 60.0
#: Connections the agent endpoint serves at once.
MAX_CONNECTIONS = 512


def api_key(headers: Any) -> Optional[str]:
    """The key of `Authorization: Bearer KEY` (None without one)."""
    value = headers.get("Authorization") or ""
    scheme, _, key = value.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def _read_json(handler: BaseHTTPRequestHandler, max_body: int) -> Any:
    if handler.headers.get("Transfer-Encoding"):
        handler.close_connection = True
        raise OpenAIError(411, "send the body with a Content-Length (no Transfer-Encoding)")
    declared = handler.headers.get_all("Content-Length") or []
    text = declared[0].strip() if len(declared) == 1 else ""
    if not (text.isascii() and text.isdigit()):
        handler.close_connection = True
        raise OpenAIError(411, "one Content-Length header with the body's length is required")
    length = int(text[:16])
    if length > max_body:
        handler.close_connection = True
        raise OpenAIError(413, f"body of {length} bytes: at most {max_body}")
    data = handler.rfile.read(length)
    if len(data) != length:
        handler.close_connection = True
        raise OpenAIError(400, "the body ended early")
    try:
        return json.loads(data or b"null")
    except (ValueError, RecursionError) as e:
        raise OpenAIError(400, f"the body is not JSON: {' '.join(str(e).split())[:100]}") from None


def answer(handler: BaseHTTPRequestHandler, service: Any, method: str, max_body: int = MAX_BODY) -> None:
    """Answer one `/v1/...` request on `handler` with `service` (an `OpenAIService`)."""
    from emapg_cli.errors import UserError

    path = handler.path.split("?", 1)[0]
    try:
        if method == "GET":
            if path != "/v1/models":
                raise OpenAIError(404, f"no route GET {path[:100]} (GET /v1/models)", "not_found_error")
            code, reply = 200, service.models()
        else:
            route = {"/v1/chat/completions": service.chat, "/v1/completions": service.completions}.get(path)
            if route is None:
                handler.close_connection = True
                raise OpenAIError(404, f"no route POST {path[:100]} (/v1/chat/completions, /v1/completions)", "not_found_error")
            code, reply = 200, route(_read_json(handler, max_body), api_key(handler.headers))
    except OpenAIError as e:
        code, reply = e.status, error_body(e)
    except UserError as e:  # the engine behind it failed (a rollout server that went away): the caller is told
        code, reply = 503, error_body(OpenAIError(503, str(e), "server_error"))
    except Exception as e:  # never a traceback to the client; the server keeps serving
        line = " ".join(str(e).split())[:300]
        code, reply = 500, error_body(OpenAIError(500, f"{type(e).__name__}: {line}" if line else type(e).__name__, "server_error"))
    try:
        write_json(handler, code, json.dumps(reply).encode())
    except OSError:
        handler.close_connection = True


class OpenAIServer(ThreadingMixIn, HTTPServer):
    """The OpenAI routes alone (the trainer's agent endpoint): one daemon thread per connection, at most
    `max_connections` at once."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], service: Any, max_connections: int = MAX_CONNECTIONS,
                 io_timeout_s: float = IO_TIMEOUT_S, max_body_bytes: int = MAX_BODY):
        self.service, self.io_timeout_s, self.max_body_bytes = service, io_timeout_s, max_body_bytes
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            try:
                body = json.dumps(error_body(OpenAIError(503, "busy: too many connections; retry later", "server_error"))).encode()
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except (RuntimeError, OSError):  # no thread could be started
            self._slots.release()
            self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        """A connection that failed (reset, timed out) is dropped quietly; the server stays up."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: OpenAIServer

    def setup(self) -> None:
        self.timeout = self.server.io_timeout_s
        super().setup()

    def send_error(self, code: int, message: Any = None, explain: Any = None) -> None:
        """http.server's own refusals (bad request line, headers too long) as OpenAI's error body too."""
        self.close_connection = True
        try:
            write_json(self, code, json.dumps(error_body(OpenAIError(code, str(message or "bad request")))).encode())
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        answer(self, self.server.service, "GET", self.server.max_body_bytes)

    def do_POST(self) -> None:  # noqa: N802
        answer(self, self.server.service, "POST", self.server.max_body_bytes)


def start_server(service: Any, host: str = "127.0.0.1", port: int = 0, **limits: Any) -> tuple[OpenAIServer, str]:
    """An `OpenAIServer` serving in a daemon thread; (server, base URL `http://HOST:PORT/v1`)."""
    server = OpenAIServer((host, port), service, **limits)
    threading.Thread(target=server.serve_forever, name="emapg-openai", daemon=True).start()
    h, p = server.server_address[:2]
    return server, f"http://{h}:{p}/v1"
