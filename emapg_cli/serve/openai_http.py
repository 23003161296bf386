"""The HTTP of the OpenAI routes (serve/openai_service.py), on the shared bounded server (emapg_cli/serve/http_server.py):
`answer`, which the rollout server's handler calls for `/v1/...` paths (`emapg rollout serve --openai`: its
connection caps, timeouts, body cap, request limits and secret), and `OpenAIServer`, those routes alone, for the
trainer's agent endpoint.

A body is read as the rollout server reads one (one `Content-Length`, at most `max_body_bytes`, 413 unread beyond;
within the connection's `timeout_s`) and parsed one body at a time. A request's deadline counts from its arrival, and
its generation stops once its client has left (`Caller`: the engines' `cancelled` hook). Every refusal, the HTTP
server's own included, is OpenAI's error body `{"error": {"message", "type", "param", "code"}}` with its status (a 500
names an unexpected failure's type and first line, never a traceback). The caller's API key is read from
`Authorization: Bearer KEY`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from emapg_cli.serve.openai_service import Caller
from emapg_cli.serve.openai_wire import OpenAIError, error_body, error_json
from emapg_cli.serve.http_server import BoundedHandler, BoundedServer, Refused

#: Largest request body (bytes) of the agent endpoint: a long conversation with tool schemas is well below it.
MAX_BODY = 8 << 20
#: Seconds a connection of the agent endpoint has to send each request (idle connections are closed after it).
TIMEOUT_S = 60.0
#: Connections the agent endpoint serves at once (503 at once beyond).
MAX_CONNECTIONS = 512


def api_key(headers: Any) -> Optional[str]:
    """The key of `Authorization: Bearer KEY` (None without one)."""
    value = headers.get("Authorization") or ""
    scheme, _, key = value.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def answer(handler: BoundedHandler, service: Any, arrival: float) -> None:
    """Answer one `/v1/...` request on `handler` with `service` (an `OpenAIService`); `arrival`: when it came
    (time.monotonic())."""
    path = handler.path.split("?", 1)[0]
    if handler.command == "GET":
        if path == "/v1/models":
            handler.send_json(200, service.models())
        else:
            handler.refuse(404, f"no route GET {path[:100]} (GET /v1/models)")
        return
    route = {"/v1/chat/completions": service.chat, "/v1/completions": service.completions}.get(path)
    if route is None:
        handler.refuse(404, f"no route POST {path[:100]} (/v1/chat/completions, /v1/completions)", unread=True)
        return
    body = handler.read_body()
    if body is None:
        return
    handler.deadline(None)  # the server works: bounded by the request's limits and its deadline from `arrival`
    handler.send_reply(*_reply(lambda: route(handler.parse_json(body), Caller(api_key(handler.headers), arrival,
                                                                              handler.client_left))))


def _reply(work: Any) -> tuple[int, dict]:
    """(status, body) of `work()`: its reply, or the refusal of what it raised as OpenAI's error body."""
    from emapg_cli.errors import UserError

    try:
        return 200, work()
    except OpenAIError as e:
        return e.status, error_body(e)
    except Refused as e:  # the request limits, the deadline, a client that left, the server's generation lock
        return e.code, error_json(e.code, str(e))
    except UserError as e:  # the engine behind it failed (a rollout server that went away): the caller is told
        return 503, error_json(503, str(e))
    except Exception as e:  # never a traceback to the client; the server keeps serving
        line = " ".join(str(e).split())[:300]
        return 500, error_json(500, f"{type(e).__name__}: {line}" if line else type(e).__name__)


class OpenAIServer(BoundedServer):
    """The OpenAI routes alone (the trainer's agent endpoint), on a `BoundedServer`: every refusal OpenAI's body."""

    watchdog_name = "emapg-openai-watchdog"

    def __init__(self, address: tuple[str, int], service: Any, max_connections: int = MAX_CONNECTIONS,
                 timeout_s: float = TIMEOUT_S, max_body_bytes: int = MAX_BODY):
        self.service = service
        super().__init__(address, _Handler, max_connections=max_connections, timeout_s=timeout_s,
                         max_body_bytes=max_body_bytes)

    def error_json(self, code: int, message: str, path: str = "") -> dict:
        return error_json(code, message)


class _Handler(BoundedHandler):
    server: OpenAIServer

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        answer(self, self.server.service, time.monotonic())

    do_GET = do_POST  # answer() routes on the method


def start_server(service: Any, host: str = "127.0.0.1", port: int = 0, **limits: Any) -> tuple[OpenAIServer, str]:
    """An `OpenAIServer` serving in a daemon thread; (server, base URL `http://HOST:PORT/v1`)."""
    server = OpenAIServer((host, port), service, **limits)
    threading.Thread(target=server.serve_forever, name="emapg-openai", daemon=True).start()
    h, p = server.server_address[:2]
    return server, f"http://{f'[{h}]' if ':' in h else h}:{p}/v1"
