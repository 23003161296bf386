"""One HTTP request whose deadline covers all of it: what emapg's clients (the search agent's retriever client, the
rollout server's `RemoteEngine`) send with.

A socket timeout bounds one `recv`, not a request: a server that drips one byte a second, each well within the
timeout, held a client for as long as it dripped. Here a timer shuts the connection down when `timeout_s` has passed
since the request began (connecting, sending, the reply's head and its body together), and the request then fails
with `Deadline`. The reply's body is read up to `max_reply_bytes` (more is `ReplyTooLarge`, not a memory spike).
Redirects are never followed: a 3xx is a status like any other. A body may be bytes or a sequence of buffers sent in
order (the raw tensors of a weight push, without copying them into one); while it is sent, a reply that comes first
(a refusal before the body was read) stops the sending, and is returned. Standard library only.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

#: Bytes handed to the socket per send while watching for an early reply.
_SEND_CHUNK = 1 << 20


class Deadline(TimeoutError):
    """The whole request took longer than its `timeout_s`."""


class ReplyTooLarge(ValueError):
    """The reply's body is longer than the caller accepts."""


@dataclass(frozen=True)
class Reply:
    status: int
    reason: str
    body: bytes


Body = Union[bytes, Iterable[memoryview]]


def _send_body(conn: http.client.HTTPConnection, parts: Iterable[memoryview]) -> None:
    """Send `parts` in order; stop early (quietly) when the server has already answered (readable socket)."""
    sock = conn.sock
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:  # the server answered before reading everything: a refusal, read by the caller
                return
            if writable:
                sent = sock.send(view[:_SEND_CHUNK])
                view = view[sent:]


def _read_capped(response: http.client.HTTPResponse, limit: int) -> bytes:
    chunks, got = [], 0
    while True:
        chunk = response.read1(min(65536, limit + 1 - got))  # at most one read of the socket
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        got += len(chunk)
        if got > limit:
            raise ReplyTooLarge(f"the reply is over {limit} bytes")


def request(url: str, method: str = "GET", body: Optional[Body] = None, *, timeout_s: float,
            max_reply_bytes: int, headers: Optional[dict[str, str]] = None, body_length: Optional[int] = None) -> Reply:
    """`method url` with `body` (bytes, or buffers sent in order: then give `body_length`, their total); the reply
    whatever its status. Raises `Deadline` when it all took over `timeout_s`, `ReplyTooLarge`, and OSError or
    http.client.HTTPException when the connection failed or the reply is not HTTP."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"not an http(s) URL: {url[:100]!r}")
    cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    conn = cls(parsed.hostname, parsed.port, timeout=timeout_s)
    expired, held = threading.Event(), []  # held: the connected socket (http.client drops `conn.sock` once the
    # reply that will close it has begun, while the reply still reads from it)

    def expire() -> None:
        expired.set()
        for sock in held:
            try:  # the plain socket's shutdown (an SSL socket's own would drop its state under the reading thread)
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    t0 = time.monotonic()
    try:
        conn.connect()
        held.append(conn.sock)
        if expired.is_set():  # the deadline passed while connecting: the socket was not there to shut down
            raise Deadline(f"no reply within {timeout_s:g} s")
        path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
        conn.putrequest(method, path, skip_accept_encoding=True)
        for key, value in (headers or {}).items():
            conn.putheader(key, value)
        if body is not None:
            length = len(body) if isinstance(body, (bytes, bytearray)) else body_length
            conn.putheader("Content-Length", str(length))
        conn.endheaders()
        if body is not None:
            _send_body(conn, [memoryview(body)] if isinstance(body, (bytes, bytearray)) else body)
        response = conn.getresponse()
        data = _read_capped(response, max_reply_bytes)
        if expired.is_set():
            raise Deadline(f"no reply within {timeout_s:g} s")
        return Reply(response.status, response.reason, data)
    except (OSError, http.client.HTTPException, ValueError) as e:
        if expired.is_set() or time.monotonic() - t0 >= timeout_s or isinstance(e, socket.timeout):
            raise Deadline(f"no reply within {timeout_s:g} s") from None
        raise
    finally:
        timer.cancel()
        conn.close()


def one_line(text: Any, limit: int = 200) -> str:
    """`text` on one line (runs of whitespace joined), at most `limit` characters (then "...")."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def server_error(body: bytes) -> str:
    """The `{"error": "..."}` string of a reply's JSON body on one line (at most 4 KiB read), else ""."""
    try:
        said = json.loads(body[:4096].decode("utf-8"))["error"]
        return one_line(said) if isinstance(said, str) else ""
    except Exception:  # any other body: the status alone says enough
        return ""
