"""`emapg retriever serve`: Search-R1's `/retrieve` API over a saved index, so one index can back several trainers.

Built on the standard library's `ThreadingHTTPServer` (one thread per connection): the API is one
JSON POST per agent turn, so the request rate is low and the work is the retrieval itself, which
the retriever serialises; no web framework is needed and nothing is added to emapg's dependencies.

  POST /retrieve  {"queries": [str], "topk": int | null, "return_scores": bool}
    -> {"result": [[{"document": {"id", "title", "contents"}, "score": float}, ...], ...]}
       (with return_scores false: a plain list of documents per query, as Search-R1's server)
  GET  /health    -> {"status": "ok", "rows": N}
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from emapg_cli.retrieval.base import Retriever

#: Largest request body accepted (bytes).
MAX_BODY = 16 << 20


def retrieve_reply(retriever: Retriever, request: Any, default_topk: int = 3) -> dict[str, Any]:
    """The `/retrieve` reply to a parsed request body; ValueError on a malformed request."""
    if not isinstance(request, dict) or not isinstance(request.get("queries"), list) \
            or not all(isinstance(q, str) for q in request["queries"]):
        raise ValueError('the body must be {"queries": [str, ...], "topk": int, "return_scores": bool}')
    topk = request.get("topk") or default_topk
    if not isinstance(topk, int) or topk < 1:
        raise ValueError("topk must be a positive integer")
    hits = retriever.search(request["queries"], topk)
    if request.get("return_scores", False):
        return {"result": [[{"document": {"id": h.id, "title": h.title, "contents": h.contents}, "score": h.score}
                            for h in row] for row in hits]}
    return {"result": [[{"id": h.id, "title": h.title, "contents": h.contents} for h in row] for row in hits]}


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, default_topk: int = 3,
                rows: int | None = None) -> ThreadingHTTPServer:
    """A bound (not yet serving) server; call `serve_forever()` (port 0 picks a free port: `server.server_address`)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                self._send(200, {"status": "ok", "rows": rows})
            else:
                self._send(404, {"error": f"no route {self.path} (POST /retrieve, GET /health)"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/retrieve":
                self._send(404, {"error": f"no route {self.path} (POST /retrieve)"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self._send(413, {"error": f"body over {MAX_BODY} bytes"})
                return
            try:
                request = json.loads(self.rfile.read(length) or b"null")
                reply = retrieve_reply(retriever, request, default_topk)
            except (ValueError, json.JSONDecodeError) as e:
                self._send(400, {"error": str(e)})
                return
            self._send(200, reply)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise here
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
