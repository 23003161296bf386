"""One JSON reply on a `http.server.BaseHTTPRequestHandler`: what the retriever server and the rollout server send."""

from __future__ import annotations

from typing import Any


def write_json(handler: Any, code: int, data: bytes) -> None:
    """Send `data` (an encoded JSON body) with status `code`, its length, and `Connection: close` when the handler
    will close the connection after it; flushed."""
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    if handler.close_connection:
        handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(data)
    handler.wfile.flush()
