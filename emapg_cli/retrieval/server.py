"""`emapg retriever serve`: Search-R1's `/retrieve` API over a saved index, so one index can back several trainers.

Built on the standard library's `http.server` with one thread per connection: the API is one JSON
POST per agent turn, so the request rate is low and the work is the retrieval itself, which the
retriever serialises; no web framework is needed and nothing is added to emapg's dependencies.

  POST /retrieve  {"queries": [str], "topk": int | null, "return_scores": bool}
    -> {"result": [[{"document": {"id", "title", "contents"}, "score": float}, ...], ...]}
       (with return_scores false: a plain list of documents per query, as Search-R1's server)
  GET  /health    -> {"status": "ok", "rows": N}

Every resource a client can claim is bounded (`Limits`; docs/reliability.md "The retriever server's
limits"): the body is read only up to its declared `Content-Length`, itself at most `max_body_bytes`;
queries per request, the characters of each query and of all of them (which bound the search's work:
it cannot be interrupted), `topk`, their product (the hits) and the reply's size are capped; bodies are
parsed and searched one at a time (at most one parsed body in memory); each connection has `timeout_s` to
send each request (a watchdog shuts down sockets past it, so half-sent requests and idle keep-alive
connections are dropped); at most `max_connections` are served at once and the next ones get a 503
at once; the listen backlog is `BACKLOG`; running out of file descriptors pauses accepting instead
of spinning. Every refusal is a 4xx/503 with a JSON body `{"error": "..."}`.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from typing import Any, Optional

from emapg_cli.retrieval.base import Retriever

#: Largest request body accepted (bytes); `Content-Length` above it is refused (413) without reading.
MAX_BODY = 16 << 20
#: Most queries in one request (a training turn sends one per active episode).
MAX_QUERIES = 4096
#: Longest query (characters); a longer one is refused (413) before any search. The search's time grows with
#: the query's tokens (each walks its word's postings), and it cannot be interrupted: this bounds it per query.
MAX_QUERY_CHARS = 4096
#: Most characters of all the queries of one request together (413 above it): with MAX_QUERY_CHARS this bounds
#: the tokens one request can make the search walk (at most about half of them: a word and a space each).
MAX_REQUEST_CHARS = 1 << 20
#: Largest `topk` a request may ask for.
MAX_TOPK = 100
#: Most hits in one reply (queries x topk): bounds the reply's rows and the ranking's memory before the search.
MAX_HITS = 65536
#: Largest reply (bytes of JSON); a request whose reply would be larger is refused (413).
MAX_REPLY = 64 << 20
#: Seconds a connection has to send each full request (from its connect, or the end of the previous
#: reply: an idle keep-alive connection is closed after it), and to take each reply.
TIMEOUT_S = 10.0
#: Connections served at once; the next ones get a 503 at once.
MAX_CONNECTIONS = 64
#: The listen backlog (connections the kernel queues before `accept`).
BACKLOG = 256
#: Pause of the accept loop when the process is out of file descriptors (EMFILE/ENFILE).
FD_BACKOFF_S = 0.1
#: After refusing a request whose body was not read, read and drop at most this much of it (for at
#: most one second) before closing, so the client sees the reply rather than a connection reset.
_LINGER_BYTES = 1 << 20
#: The accept loop's 503 (no thread): drop at most `_LINGER_BYTES` of what the client already sent, for at most
#: this long, so a client that keeps sending cannot hold the accept loop.
_BUSY_DRAIN_S = 0.2


@dataclass(frozen=True)
class Limits:
    """The server's bounds (the options of `emapg retriever serve`)."""

    max_body_bytes: int = MAX_BODY
    max_queries: int = MAX_QUERIES
    max_query_chars: int = MAX_QUERY_CHARS
    max_request_chars: int = MAX_REQUEST_CHARS
    max_topk: int = MAX_TOPK
    max_hits: int = MAX_HITS
    max_reply_bytes: int = MAX_REPLY
    timeout_s: float = TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS


class Refused(Exception):
    """A request refused with HTTP status `code` and a one-line reason."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _check_request(request: Any, default_topk: int, limits: Limits) -> tuple[list[str], int, bool]:
    """(queries, topk, return_scores) of a parsed body; `Refused` (400/413) when malformed or over the limits."""
    if not isinstance(request, dict) or not isinstance(request.get("queries"), list) \
            or not all(isinstance(q, str) for q in request["queries"]):
        raise Refused(400, 'the body must be {"queries": [str, ...], "topk": int, "return_scores": bool}')
    queries = request["queries"]
    if len(queries) > limits.max_queries:
        raise Refused(413, f"{len(queries)} queries: at most {limits.max_queries} per request")
    longest = max(map(len, queries), default=0)
    if longest > limits.max_query_chars:
        raise Refused(413, f"a query of {longest} characters: at most {limits.max_query_chars}")
    total = sum(map(len, queries))
    if total > limits.max_request_chars:
        raise Refused(413, f"queries of {total} characters in all: at most {limits.max_request_chars} per request")
    topk = request.get("topk")
    if topk is None:
        topk = default_topk
    # bool is an int in Python: `true` is refused, not read as 1; 0, "3" and 2.5 are refused, not rewritten
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= limits.max_topk:
        raise Refused(400, f"topk must be an integer from 1 to {limits.max_topk}, got {json.dumps(topk)[:40]}")
    if len(queries) * topk > limits.max_hits:
        raise Refused(413, f"{len(queries)} queries x topk {topk} = {len(queries) * topk} hits: at most {limits.max_hits}")
    return_scores = request.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise Refused(400, "return_scores must be true or false")
    return queries, topk, return_scores


def _encode_reply(hits: list, return_scores: bool, max_bytes: int) -> bytes:
    """The `/retrieve` reply as JSON bytes, built row by row; `Refused` (413) as soon as it passes `max_bytes`."""
    parts, size = [], len('{"result": []}')
    for i, row in enumerate(hits):
        if return_scores:
            items = [{"document": {"id": h.id, "title": h.title, "contents": h.contents}, "score": h.score} for h in row]
        else:
            items = [{"id": h.id, "title": h.title, "contents": h.contents} for h in row]
        part = json.dumps(items)
        size += len(part) + 2 * (i > 0)
        if size > max_bytes:
            raise Refused(413, f"the reply would pass {max_bytes} bytes: ask fewer queries or a smaller topk")
        parts.append(part)
    return ('{"result": [' + ", ".join(parts) + "]}").encode()


def retrieve_reply(retriever: Retriever, request: Any, default_topk: int = 3,
                   limits: Limits = Limits()) -> dict[str, Any]:
    """The `/retrieve` reply to a parsed request body; ValueError on a malformed request or one over `limits`."""
    try:
        queries, topk, return_scores = _check_request(request, default_topk, limits)
        return json.loads(_encode_reply(retriever.search(queries, topk), return_scores, limits.max_reply_bytes))
    except Refused as e:
        raise ValueError(str(e)) from None


class _Watchdog:
    """Shuts down connections past their deadline (a blocked read or write then returns at once).

    A per-socket timeout alone bounds each `recv`, not a request: a client sending one byte every few
    seconds would hold its thread forever. Deadlines are set while reading a request and writing its
    reply, and cleared while waiting for and doing the search (bounded by the query limits instead).
    """

    def __init__(self, period_s: float):
        self._deadlines: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="emapg-retriever-watchdog", daemon=True)
        self._thread.start()

    def set(self, sock: socket.socket, deadline: Optional[float]) -> None:
        with self._lock:
            if deadline is None:
                self._deadlines.pop(sock, None)
            else:
                self._deadlines[sock] = deadline

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            now = time.monotonic()
            with self._lock:
                late = [s for s, d in self._deadlines.items() if d <= now]
                for s in late:
                    del self._deadlines[s]
            for s in late:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()


def _json_response(code: int, body: dict, close: bool) -> bytes:
    """A complete HTTP/1.1 response with a JSON body (for the 503 written by the accept loop)."""
    from http.server import BaseHTTPRequestHandler as B

    data = json.dumps(body).encode()
    reason = B.responses.get(code, ("",))[0]
    head = (f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            + ("Connection: close\r\n" if close else "") + "\r\n")
    return head.encode() + data


class RetrieverServer(ThreadingMixIn, HTTPServer):
    """`HTTPServer` with one daemon thread per connection, at most `limits.max_connections` of them."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = BACKLOG
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type, limits: Limits, retriever: Retriever,
                 default_topk: int = 3, rows: int | None = None):
        self.limits, self.retriever, self.default_topk, self.rows = limits, retriever, default_topk, rows
        #: parsing a body and searching happen one request at a time: the parsed objects of at most one body
        #: (bounded by max_body_bytes) are in memory at once, however many connections send bodies
        self.work = threading.Lock()
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self.watchdog = _Watchdog(min(0.5, limits.timeout_s / 4))
        try:
            super().__init__(address, handler)
        except BaseException:
            self.watchdog.stop()
            raise

    def get_request(self):
        try:
            return super().get_request()
        except OSError as e:
            # out of file descriptors: the listening socket stays readable, so retrying at once would spin;
            # pause, and accept again when connections have closed (the pending ones wait in the backlog)
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(FD_BACKOFF_S)
            raise

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self._busy(request)
            return
        try:
            self.watchdog.set(request, time.monotonic() + self.limits.timeout_s)
            super().process_request(request, client_address)
        except (RuntimeError, OSError, MemoryError):  # no thread could be started: refuse this one, keep serving
            self.watchdog.set(request, None)
            self._slots.release()
            self._busy(request)

    def _busy(self, request) -> None:
        """503 at once from the accept loop (no thread), then close."""
        try:
            request.settimeout(0.5)
            request.sendall(_json_response(503, {"error": f"busy: {self.limits.max_connections} connections are "
                                                          "being served; retry later"}, close=True))
            request.shutdown(socket.SHUT_WR)
            request.setblocking(False)
            dropped, end = 0, time.monotonic() + _BUSY_DRAIN_S
            try:  # drop what the client has already sent (bounded), so that closing does not reset the connection
                while dropped < _LINGER_BYTES and time.monotonic() < end:
                    chunk = request.recv(65536)
                    if not chunk:
                        break
                    dropped += len(chunk)
            except OSError:
                pass
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.watchdog.set(request, None)
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        """A connection that failed (reset, shut down by the watchdog) is dropped quietly; the server stays up."""

    def server_close(self) -> None:
        self.watchdog.stop()
        super().server_close()


class _Handler(BaseHTTPRequestHandler):
    """One connection of a `RetrieverServer`: `/retrieve` and `/health`, every refusal a JSON error."""

    protocol_version = "HTTP/1.1"
    server: RetrieverServer

    def setup(self) -> None:
        self.timeout = self.server.limits.timeout_s  # each recv/send; the watchdog bounds whole requests
        super().setup()

    def _deadline(self, seconds: Optional[float]) -> None:
        self.server.watchdog.set(self.connection, None if seconds is None else time.monotonic() + seconds)

    def _send(self, code: int, body: dict | bytes) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self._deadline(self.server.limits.timeout_s)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        self._deadline(self.server.limits.timeout_s)  # the next request on this connection, or an idle one is closed

    def _refuse(self, code: int, message: str, unread: bool = False) -> None:
        """A 4xx with `{"error"}`; `unread`: the body was not read, so the connection closes after it."""
        if unread:
            self.close_connection = True
        self._send(code, {"error": message})
        if unread:
            self._linger()

    def _linger(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(1.0)
            dropped, end = 0, time.monotonic() + 1.0
            while dropped < _LINGER_BYTES and time.monotonic() < end:
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                dropped += len(chunk)
        except OSError:
            pass

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """http.server's own refusals (bad request line, headers too long, ...) as JSON too."""
        self.close_connection = True
        try:
            self._send(code, {"error": message or self.responses.get(code, ("error",))[0]})
        except OSError:
            pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/health":
            self._send(200, {"status": "ok", "rows": self.server.rows})
        else:
            self._send(404, {"error": f"no route {self.path[:200]} (POST /retrieve, GET /health)"})

    def _content_length(self) -> Optional[int]:
        """The declared body length, checked (one plain integer, at most max_body_bytes); None after a refusal."""
        if self.headers.get("Transfer-Encoding"):
            self._refuse(411, "send the body with a Content-Length (no Transfer-Encoding)", unread=True)
            return None
        declared = self.headers.get_all("Content-Length") or []
        if len(declared) != 1:
            self._refuse(411, "one Content-Length header is required", unread=True)
            return None
        text = declared[0].strip()
        if not (text.isascii() and text.isdigit()) or len(text) > 12:
            self._refuse(400, f"Content-Length must be a non-negative integer, got {text[:20]!r}", unread=True)
            return None
        length, cap = int(text), self.server.limits.max_body_bytes
        if length > cap:
            self._refuse(413, f"body of {length} bytes: at most {cap}", unread=True)
            return None
        return length

    def _read_body(self) -> Optional[bytes]:
        """The body, read up to its Content-Length (at most limits.max_body_bytes); None after a refusal."""
        length = self._content_length()
        if length is None:
            return None
        chunks, got = [], 0
        while got < length:  # never more than the declared length, itself at most the cap
            chunk = self.rfile.read(min(65536, length - got))
            if not chunk:
                self.close_connection = True  # the client stopped sending (or the watchdog shut it down)
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _answer(self, body: bytes) -> tuple[int, dict | bytes]:
        """(status, reply) to a `/retrieve` body: parsed, checked and searched one request at a time."""
        server = self.server
        with server.work:
            try:
                request = json.loads(body or b"null")
                queries, topk, return_scores = _check_request(request, server.default_topk, server.limits)
            except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deeply
                return 400, {"error": f"the body is not JSON: {str(e)[:200] or type(e).__name__}"}
            except Refused as e:
                return e.code, {"error": str(e)}
            finally:
                request = None  # the parsed body is freed before the next one is parsed
            try:
                hits = server.retriever.search(queries, topk)
                return 200, _encode_reply(hits, return_scores, server.limits.max_reply_bytes)
            except Refused as e:
                return e.code, {"error": str(e)}

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/retrieve":
            self._refuse(404, f"no route {self.path[:200]} (POST /retrieve)", unread=True)
            return
        body = self._read_body()
        if body is None:
            return
        # waiting for the work lock and the search are bounded by the query limits, not by the clock
        self._deadline(None)
        code, reply = self._answer(body)
        del body
        self._send(code, reply)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise here
        pass


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, default_topk: int = 3,
                rows: int | None = None, limits: Limits = Limits()) -> RetrieverServer:
    """A bound (not yet serving) server; call `serve_forever()` (port 0 picks a free port: `server.server_address`)."""
    return RetrieverServer((host, port), _Handler, limits, retriever, default_topk=default_topk, rows=rows)
