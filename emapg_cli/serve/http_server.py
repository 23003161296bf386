"""What emapg's HTTP servers (the retriever server, the rollout server with its OpenAI routes, the trainer's agent
endpoint) bound the same way, on the standard library's threading `http.server`.

A `BoundedServer` serves at most `max_connections` connections at once (the next ones get a 503 from the accept
loop at once, without a thread), keeps a listen backlog of `BACKLOG`, pauses accepting when the process runs out of
file descriptors instead of spinning, and gives each connection `timeout_s` to send each full request (a `Watchdog`
shuts down sockets past their deadline, so half-sent requests and idle keep-alive connections are dropped: a
per-socket timeout alone bounds one `recv`, not a request). A `BoundedHandler` reads a body only up to its one
declared `Content-Length`, itself at most `max_body_bytes`, and answers every refusal, its own and http.server's,
with a JSON `{"error": "..."}` (a server or route whose clients expect another shape overrides `error_json`: the
OpenAI routes answer OpenAI's error body). Each server adds its routes and its own limits on what a request may ask
for.
"""

from __future__ import annotations

import errno
import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from typing import Any, Optional


#: The listen backlog (connections the kernel queues before `accept`).
BACKLOG = 256
#: Pause of the accept loop when the process is out of file descriptors (EMFILE/ENFILE).
FD_BACKOFF_S = 0.1
#: After refusing a request whose body was not read, read and drop at most this much of it (for at
#: most one second) before closing, so the client sees the reply rather than a connection reset.
LINGER_BYTES = 1 << 20
#: The accept loop's 503 (no thread): wait at most this long for the request line (its path picks the body's shape).
BUSY_PEEK_S = 0.05
#: The accept loop's 503 (no thread): drop at most `LINGER_BYTES` of what the client already sent, for at most
#: this long, so a client that keeps sending cannot hold the accept loop.
BUSY_DRAIN_S = 0.2


def drain(sock: socket.socket, seconds: float, timeout: float) -> None:
    """Half-close `sock`, then read and drop at most LINGER_BYTES of what the client sends (for at most `seconds`, each
    read waiting at most `timeout`; 0: non-blocking), so that closing does not reset the connection."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(timeout)
        dropped, end = 0, time.monotonic() + seconds
        while dropped < LINGER_BYTES and time.monotonic() < end:
            chunk = sock.recv(65536)
            if not chunk:
                break
            dropped += len(chunk)
    except OSError:
        pass


class Refused(Exception):
    """A request refused with HTTP status `code` and a one-line reason (each server's checks raise it)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class Watchdog:
    """Shuts down connections past their deadline (a blocked read or write then returns at once).

    A per-socket timeout alone bounds each `recv`, not a request: a client sending one byte every few
    seconds would hold its thread forever. Deadlines are set while reading a request and writing its
    reply, and cleared while the server works on it (bounded by the server's own limits instead).
    """

    def __init__(self, period_s: float, name: str = "emapg-http-watchdog"):
        self._deadlines: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
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


def json_response(code: int, body: dict, close: bool) -> bytes:
    """A complete HTTP/1.1 response with a JSON body (for the 503 written by the accept loop)."""
    data = json.dumps(body).encode()
    reason = BaseHTTPRequestHandler.responses.get(code, ("",))[0]
    head = (f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            + ("Connection: close\r\n" if close else "") + "\r\n")
    return head.encode() + data


def peer_closed(sock: socket.socket) -> bool:
    """Whether the client of `sock` has closed its end (or reset it): readable with nothing to read. A client that
    is still waiting for its reply sends nothing, so its socket is not readable. Never blocks."""
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):  # reset, or already shut down (by the watchdog)
        return True


class BoundedServer(ThreadingMixIn, HTTPServer):
    """`HTTPServer` with one daemon thread per connection, at most `max_connections` of them, each request read
    within `timeout_s` (see the module's docstring)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = BACKLOG
    allow_reuse_address = True
    #: The thread name of the watchdog (a server's own, for `py-spy` and the like).
    watchdog_name = "emapg-http-watchdog"

    def __init__(self, address: tuple[str, int], handler: type, *, max_connections: int, timeout_s: float,
                 max_body_bytes: int):
        self.max_connections, self.timeout_s, self.max_body_bytes = max_connections, timeout_s, max_body_bytes
        #: parsing a body happens one request at a time: the parsed objects of at most one body (bounded by
        #: max_body_bytes) are in memory at once, however many connections send bodies
        self.work = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self.watchdog = Watchdog(min(0.5, timeout_s / 4), self.watchdog_name)
        if ":" in address[0]:  # an IPv6 address (::1, ::)
            self.address_family = socket.AF_INET6
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
            self.watchdog.set(request, time.monotonic() + self.timeout_s)
            super().process_request(request, client_address)
        except (RuntimeError, OSError, MemoryError):  # no thread could be started: refuse this one, keep serving
            self.watchdog.set(request, None)
            self._slots.release()
            self._busy(request)

    def _busy(self, request) -> None:
        """503 at once from the accept loop (no thread), then close; its body in the shape of the request's path, when
        the request line has come within BUSY_PEEK_S."""
        try:
            request.settimeout(0.5)
            head = request.recv(512, socket.MSG_PEEK) if select.select([request], [], [], BUSY_PEEK_S)[0] else b""
            path = head.split(b" ", 2)[1].decode("latin-1") if head.count(b" ") >= 2 else ""
            request.sendall(json_response(503, self.error_json(503, f"busy: {self.max_connections} connections are "
                                                                        "being served; retry later", path), close=True))
            drain(request, BUSY_DRAIN_S, 0.0)  # non-blocking: only what the client has already sent
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.watchdog.set(request, None)
            self._slots.release()

    def error_json(self, code: int, message: str, path: str = "") -> dict:
        """The JSON body of a refusal of a request to `path` (`{"error": message}`; a server whose clients expect
        another shape overrides it)."""
        return {"error": message}

    def handle_error(self, request, client_address) -> None:
        """A connection that failed (reset, shut down by the watchdog) is dropped quietly; the server stays up."""

    def server_close(self) -> None:
        self.watchdog.stop()
        super().server_close()


class BoundedHandler(BaseHTTPRequestHandler):
    """One connection of a `BoundedServer`: each request and reply within the server's `timeout_s`, a body read only
    up to its declared length, every refusal a JSON `{"error"}`."""

    protocol_version = "HTTP/1.1"
    server: BoundedServer

    def setup(self) -> None:
        self.timeout = self.server.timeout_s  # each recv/send; the watchdog bounds whole requests
        super().setup()
        try:  # the reply's head and body are two writes: without this, Nagle + the client's delayed ACK add ~40 ms
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def deadline(self, seconds: Optional[float]) -> None:
        """The connection is shut down `seconds` from now unless set again (None: no deadline, the server works)."""
        self.server.watchdog.set(self.connection, None if seconds is None else time.monotonic() + seconds)

    def error_json(self, code: int, message: str) -> dict:
        """The JSON body of a refusal of this request (the server's, unless a route's clients expect another shape)."""
        return self.server.error_json(code, message, getattr(self, "path", "") or "")

    def client_left(self) -> bool:
        """Whether this request's client has closed its connection (a `cancelled` hook of its generation)."""
        return peer_closed(self.connection)

    def send_json(self, code: int, body: dict | bytes) -> None:
        """Send `body` (encoded JSON, or a dict) with status `code`, its length, and `Connection: close` when the
        connection closes after it; flushed."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.deadline(self.server.timeout_s)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        self.deadline(self.server.timeout_s)  # the next request on this connection, or an idle one is closed

    def send_reply(self, code: int, body: dict) -> bool:
        """`send_json`, the connection closed after anything but a 200; False when the reply could not be written
        (the client is gone)."""
        if code != 200:
            self.close_connection = True
        try:
            self.send_json(code, body)
        except OSError:
            self.close_connection = True
            return False
        return True

    def refuse(self, code: int, message: str, unread: bool = False) -> None:
        """A 4xx with `{"error"}`; `unread`: the body was not read, so the connection closes after it."""
        if unread:
            self.close_connection = True
        self.send_json(code, self.error_json(code, message))
        if unread:
            drain(self.connection, 1.0, 1.0)

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """http.server's own refusals (bad request line, headers too long, ...) as JSON too."""
        self.close_connection = True
        try:
            self.send_json(code, self.error_json(code, message or self.responses.get(code, ("error",))[0]))
        except OSError:
            pass

    def content_length(self, cap: Optional[int] = None) -> Optional[int]:
        """The declared body length, checked (one plain integer, at most `cap`, default the server's
        max_body_bytes); None after a refusal (411, 400 or 413, the body unread)."""
        if self.headers.get("Transfer-Encoding"):
            self.refuse(411, "send the body with a Content-Length (no Transfer-Encoding)", unread=True)
            return None
        declared = self.headers.get_all("Content-Length") or []
        if len(declared) != 1:
            self.refuse(411, "one Content-Length header is required", unread=True)
            return None
        text = declared[0].strip()
        if not (text.isascii() and text.isdigit()) or len(text) > 12:
            self.refuse(400, f"Content-Length must be a non-negative integer, got {text[:20]!r}", unread=True)
            return None
        length, cap = int(text), self.server.max_body_bytes if cap is None else cap
        if length > cap:
            self.refuse(413, f"body of {length} bytes: at most {cap}", unread=True)
            return None
        return length

    def read_exactly(self, length: int) -> Optional[bytes]:
        """`length` bytes of the body (never more); None when the client stopped sending (or the watchdog shut the
        connection down), the connection then closed."""
        chunks, got = [], 0
        while got < length:
            chunk = self.rfile.read(min(65536, length - got))
            if not chunk:
                self.close_connection = True
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def read_body(self) -> Optional[bytes]:
        """The body, read up to its Content-Length (at most max_body_bytes); None after a refusal."""
        length = self.content_length()
        return None if length is None else self.read_exactly(length)

    def parse_json(self, body: bytes) -> Any:
        """The JSON value of a body, parsed one body at a time (the parsed objects of at most one body in memory at
        once); `Refused` 400 when it is not JSON (or nests past the parser's recursion limit)."""
        with self.server.work:
            try:
                return json.loads(body or b"null")
            except (ValueError, RecursionError) as e:
                raise Refused(400, f"the body is not JSON: {' '.join(str(e).split())[:100]}") from None

    def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise here
        pass
