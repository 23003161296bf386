"""The retriever server (`emapg retriever serve`) and its client (`search.url`) against hostile peers.

Every server probe starts the real `emapg retriever serve` on 127.0.0.1 port 0 (loopback only) and talks
to it with raw sockets; every count and wait is bounded. Client probes point the real client at a tiny
fake server on loopback that answers with what a broken or hostile server might send.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator, Optional

from . import probe
from .common import base_env, emapg, ok, one_line_error

_CACHE: dict[str, Path] = {}


def _tmp() -> Path:
    if "tmp" not in _CACHE:
        _CACHE["tmp"] = Path(tempfile.mkdtemp(prefix="emapg-server-probes-"))
        atexit.register(shutil.rmtree, _CACHE["tmp"], True)
    return _CACHE["tmp"]


def _index(ws: Path) -> Path:
    """A five-document bm25 index (each passage ~16 KB), built once per process with `emapg retriever index`."""
    if "index" not in _CACHE:
        root = _tmp()
        text = " ".join(["Paris is the capital of France and a city on the Seine."] * 300)  # ~17 KB
        rows = [{"id": f"d{i}", "contents": f'"Doc {i}"\n{w} {text}'} for i, w in enumerate(
            ["fort", "horror", "rocket", "lobbyist", "ethnologist"])]
        (root / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        ok(emapg(ws, "retriever", "index", str(root / "corpus.jsonl"), "--out", str(root / "index")))
        _CACHE["index"] = root / "index"
    return _CACHE["index"]


class _Server:
    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc, self.port = proc, port

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server process so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_kb(self) -> int:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{self.proc.pid}/status").read_text())
        return int(m.group(1)) if m else 0

    def alive(self) -> None:
        assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}): {self.proc.stderr.read()[-400:]!r}"


@contextmanager
def _serve(ws: Path, *options: str, nofile: Optional[int] = None) -> Iterator[_Server]:
    """`emapg retriever serve INDEX --port 0 OPTIONS` as a subprocess; its port read from the line it prints."""
    with serve_process(ws, ["retriever", "serve", str(_index(ws)), "--port", "0", *options], "serving",
                       nofile=nofile) as server:
        yield server


@contextmanager
def serve_process(ws: Path, argv: list[str], ready: str, nofile: Optional[int] = None,
                  env: Optional[dict[str, str]] = None, memory_gb: Optional[float] = None) -> Iterator[_Server]:
    """`emapg ARGV` (a server on 127.0.0.1 port 0) as a subprocess, once it printed a line containing `ready` and
    its URL; `nofile`: its file-descriptor limit; `memory_gb`: its address-space limit. Killed at the end, and
    its stderr must hold no traceback."""
    import resource

    def preexec() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        if memory_gb is not None:
            limit = int(memory_gb * (1 << 30))
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = subprocess.Popen([sys.executable, "-m", "emapg_cli", *argv], cwd=ws, env={**base_env(ws), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    try:
        line, end = "", time.monotonic() + 120
        while time.monotonic() < end and ready not in line:
            if proc.poll() is not None:
                raise AssertionError(f"`{' '.join(argv[:2])} {' '.join(argv[3:])[:100]}` exited {proc.returncode}: "
                                     f"{proc.stderr.read().strip()[-300:]!r}")
            if select.select([proc.stdout], [], [], 0.5)[0]:
                line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert m, f"the server did not say where it listens: {line!r}"
        yield _Server(proc, int(m.group(1)))
        proc.kill()
        proc.wait(timeout=30)
        err = proc.stderr.read()
        assert "Traceback" not in err and "Exception" not in err, f"the server printed a traceback: {err[-400:]!r}"
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for f in (proc.stdout, proc.stderr):
            f.close()


def _connect(port: int, timeout: float = 10) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def _read_reply(s: socket.socket) -> tuple[int, object]:
    """(status, parsed JSON body) of one HTTP reply; AssertionError on a reset, a timeout or a body not JSON."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, f"connection closed without a reply (got {data[:80]!r})"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        m = re.search(rb"content-length:\s*(\d+)", head, re.I)
        assert m, f"reply without Content-Length: {head[:200]!r}"
        while len(body) < int(m.group(1)):
            chunk = s.recv(65536)
            assert chunk, "connection closed in the reply's body"
            body += chunk
    except (ConnectionResetError, BrokenPipeError) as e:
        raise AssertionError(f"connection reset instead of a reply: {e}") from None
    except socket.timeout:
        raise AssertionError(f"no reply within the timeout (got {data[:80]!r})") from None
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        raise AssertionError(f"HTTP {status} with a body that is not JSON: {body[:120]!r}") from None


def _post(port: int, body: bytes, headers: Optional[dict[str, str]] = None, timeout: float = 10,
          path: str = "/retrieve") -> tuple[int, object]:
    """(status, JSON body) of a POST of `body` to `path` (headers None-valued are left out)."""
    h = {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items() if v is not None)
    with _connect(port, timeout) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        return _read_reply(s)


def _retrieve(port: int, queries: list[str], topk: object = 3, **extra: object) -> tuple[int, object]:
    return _post(port, json.dumps({"queries": queries, "topk": topk, "return_scores": True, **extra}).encode())


def _health(server: _Server, timeout: float = 10) -> None:
    """The server is up and answers GET /health with 200 (retried briefly: it may be shedding load)."""
    server.alive()
    end, last = time.monotonic() + timeout, ""
    while time.monotonic() < end:
        try:
            with _connect(server.port, 2) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                status, body = _read_reply(s)
            if status == 200 and isinstance(body, dict) and body.get("status") == "ok":
                return
            last = f"HTTP {status} {body}"
        except (AssertionError, OSError) as e:
            last = str(e)
        time.sleep(0.2)
    raise AssertionError(f"the server no longer answers /health: {last}")


def _refused(reply: tuple[int, object], *codes: int, needle: str = "") -> None:
    status, body = reply
    assert status in codes, f"expected HTTP {'/'.join(map(str, codes))}, got {status}: {str(body)[:200]}"
    assert isinstance(body, dict) and isinstance(body.get("error"), str), f"refusal without a JSON error: {body!r:.200}"
    assert needle in body["error"], f"{needle!r} not in {body['error']!r}"


# ---------------------------------------------------------------------------------------------- server: bodies

@probe("content_length_negative_large_body")
def content_length_negative_large_body(ws: Path) -> None:
    """A client sent `Content-Length: -1` and then 64 MiB: the server must refuse it (4xx, JSON error) without
    buffering the body (its peak memory grows far less than the body) and keep answering."""
    with _serve(ws) as server:
        _health(server)
        before = server.peak_rss_kb()
        s = _connect(server.port, 30)
        s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")

        def flood() -> None:
            chunk = b"x" * (1 << 20)
            try:
                for _ in range(64):
                    s.sendall(chunk)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server stopped reading: what it should do

        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        _refused(_read_reply(s), 400, 411, 413)
        sender.join(30)
        s.close()
        grown = (server.peak_rss_kb() - before) / 1024
        assert grown < 24, f"the server's peak memory grew by {grown:.0f} MiB reading a refused body"
        _health(server)


@probe("content_length_missing_or_invalid")
def content_length_missing_or_invalid(ws: Path) -> None:
    """POSTs without a Content-Length, with two of them, with `abc`, `1e3`, `+5`, `0x10`, and one over the 16 MiB
    cap: each one is refused with 4xx and a JSON error naming Content-Length; the server stays up."""
    body = b'{"queries": ["fort"], "topk": 1}'
    with _serve(ws) as server:
        status, _ = _post(server.port, body, {"Content-Length": None})
        assert status == 411, f"missing Content-Length: HTTP {status}, expected 411"
        for value in ("abc", "1e3", "+5", "0x10", " ", "99999999999999999999"):
            _refused(_post(server.port, body, {"Content-Length": value}), 400, 411, 413, needle="")
        with _connect(server.port) as s:
            s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n12345")
            _refused(_read_reply(s), 400, 411)
        _refused(_post(server.port, b"", {"Content-Length": str((16 << 20) + 1)}), 413)
        _health(server)


@probe("hostile_bodies")
def hostile_bodies(ws: Path) -> None:
    """Bodies that are not UTF-8, not JSON, JSON nested 100,000 deep, of the wrong shape, and an unknown path: each a
    4xx with a JSON error (the nested one used to kill the handler without a reply); the server stays up."""
    with _serve(ws) as server:
        for body in (b"\xff\xfe\x00garbage", b"{not json", b"[" * 100_000 + b"]" * 100_000,
                     b'{"queries": "fort"}', b'{"queries": [1, 2]}', b"[]",
                     b'{"queries": ["fort"], "return_scores": "yes"}'):
            _refused(_post(server.port, body), 400)
        with _connect(server.port) as s:
            s.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            _refused(_read_reply(s), 404)
        _health(server)


# ---------------------------------------------------------------------------------------------- server: request bounds

@probe("topk_invalid_refused")
def topk_invalid_refused(ws: Path) -> None:
    """`topk` of 0, true, "3", 2.5, -1, null-free dicts and 10**9 are refused with 400 (0 used to become 3 and
    true to become 1); a valid topk still answers."""
    with _serve(ws) as server:
        for topk in (0, True, False, "3", 2.5, -1, [3], {"k": 3}, 10 ** 9):
            _refused(_retrieve(server.port, ["fort"], topk), 400, needle="topk")
        status, body = _retrieve(server.port, ["fort"], 2)
        assert status == 200 and [len(r) for r in body["result"]] == [2], f"valid topk: HTTP {status} {body!r:.200}"


@probe("too_many_queries_refused")
def too_many_queries_refused(ws: Path) -> None:
    """5,000 queries in one request (over the default 4,096) and 4,000 queries x topk 20 (over the default 65,536
    hits) are refused with 413 before any search; an 18 KB request can no longer ask for a 100 MB reply."""
    with _serve(ws) as server:
        _refused(_retrieve(server.port, ["fort"] * 5000, 1), 413, needle="queries")
        _refused(_retrieve(server.port, ["q"] * 4000, 20), 413, needle="hits")
        _health(server)


@probe("reply_size_bounded")
def reply_size_bounded(ws: Path) -> None:
    """A request whose reply would pass `--max-reply-bytes` (40 queries x 5 passages of ~17 KB, 3.4 MB, against a
    1 MB bound) is refused with 413 and a JSON error; a small one still answers."""
    with _serve(ws, "--max-reply-bytes", str(1 << 20)) as server:
        _refused(_retrieve(server.port, ["fort"] * 40, 5), 413, needle="reply")
        status, _ = _retrieve(server.port, ["fort"], 1)
        assert status == 200, f"a small request after the refusal: HTTP {status}"


@probe("long_query_refused")
def long_query_refused(ws: Path) -> None:
    """One query of 200,000 characters ("one one one ...", over the default 4,096) and 300 queries of 4,000
    characters (1.2 M in all, over the default 1,048,576) are refused with 413 and a JSON error before any search
    (a 16 MiB query used to hold the search lock, untimed, for minutes); a 4,096-character query is answered."""
    with _serve(ws) as server:
        _refused(_retrieve(server.port, ["one " * 50_000], 1), 413, needle="characters")
        _refused(_retrieve(server.port, ["fort " * 800] * 300, 1), 413, needle="in all")
        status, body = _retrieve(server.port, [("fort " * 1000)[:4096]], 1)
        assert status == 200 and len(body["result"]) == 1, f"a 4,096-character query: HTTP {status} {body!r:.200}"
        _health(server)


# ---------------------------------------------------------------------------------------------- server: connections

@probe("concurrent_clients")
def concurrent_clients(ws: Path) -> None:
    """100 clients connect at once and each sends one request (default limits: 64 connections at once): every one
    gets an answer (200) or a 503 with a JSON error, no reset or timeout, and every connect is accepted at once (the
    listen backlog of 5 used to drop or reset some)."""
    with _serve(ws) as server:
        results: list[str] = []
        body = json.dumps({"queries": ["fort", "rocket"], "topk": 2, "return_scores": True}).encode()
        barrier = threading.Barrier(100)

        connects: list[float] = []

        def client() -> None:
            try:
                barrier.wait(10)
                t0 = time.monotonic()
                with _connect(server.port, 20) as s:
                    connects.append(time.monotonic() - t0)  # the kernel's handshake: slow only when the backlog is full
                    s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                    status, reply = _read_reply(s)
                results.append(str(status) if status == 200 or (status == 503 and "error" in reply) else f"bad {status}")
            except (AssertionError, OSError, threading.BrokenBarrierError) as e:
                results.append(f"{type(e).__name__}: {str(e)[:80]}")

        threads = [threading.Thread(target=client, daemon=True) for _ in range(100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        bad = [r for r in results if r not in ("200", "503")]
        assert len(results) == 100 and not bad, f"{len(bad) + 100 - len(results)} of 100 clients failed: {bad[:3]}"
        assert "200" in results, "no client was served"
        # a SYN dropped because the listen backlog is full is retried after 1 s
        assert max(connects) < 1.0, f"a connect took {max(connects):.1f} s: the listen backlog overflowed"
        _health(server)


@probe("half_sent_requests_dropped")
def half_sent_requests_dropped(ws: Path) -> None:
    """60 sockets send half a request (some then drip one byte every 0.3 s) and stop: with `--timeout 1` the server
    closes every one of them within a few seconds and answers /health afterwards (they used to hold a thread each
    forever)."""
    with _serve(ws, "--timeout", "1", "--max-connections", "80") as server:
        socks = [_connect(server.port, 10) for _ in range(60)]
        for s in socks:
            s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"queries\"")
        drip, end = socks[:10], time.monotonic() + 6
        open_ = set(socks)
        while open_ and time.monotonic() < end:
            for s in drip:
                if s in open_:
                    try:
                        s.send(b" ")
                    except OSError:
                        open_.discard(s)
            for s in select.select(list(open_), [], [], 0.3)[0]:
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                if not data or data.endswith(b"}"):  # closed, or a timeout reply (then closed)
                    open_.discard(s)
        for s in socks:
            s.close()
        assert not open_, f"{len(open_)} of 60 half-sent requests still open after 6 s (--timeout 1)"
        _health(server)


@probe("idle_socket_closed")
def idle_socket_closed(ws: Path) -> None:
    """A keep-alive client asks /health once and then sits idle: with `--timeout 1` the server closes the
    connection within a few seconds instead of holding it (and a thread) forever."""
    with _serve(ws, "--timeout", "1") as server:
        with _connect(server.port, 10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _ = _read_reply(s)
            assert status == 200
            s.settimeout(5)
            try:
                assert s.recv(1) == b"", "the server sent more than its reply"
            except socket.timeout:
                raise AssertionError("an idle keep-alive connection was still open after 5 s (--timeout 1)") from None
            except ConnectionResetError:
                pass


@probe("fd_exhaustion_no_spin")
def fd_exhaustion_no_spin(ws: Path) -> None:
    """The server runs out of file descriptors (RLIMIT_NOFILE 64, 80 idle clients): it must not spin on accept (CPU
    stays low while the clients wait) and must answer again once they have gone."""
    with _serve(ws, "--timeout", "60", "--max-connections", "200", nofile=64) as server:
        _health(server)
        socks = []
        for _ in range(80):
            try:
                socks.append(_connect(server.port, 5))
            except OSError:
                break
        time.sleep(1.0)
        cpu0 = server.cpu_s()
        time.sleep(2.0)
        spent = server.cpu_s() - cpu0
        for s in socks:
            s.close()
        assert spent < 0.25, f"the server used {spent:.2f} s of CPU in 2 s while out of file descriptors (spinning)"
        _health(server, timeout=15)


# ---------------------------------------------------------------------------------------------- client

@contextmanager
def _fake_server(answer: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """A loopback server whose every POST (and GET) is answered by `answer(handler)`; yields its /retrieve URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            answer(self)

        def do_GET(self) -> None:  # noqa: N802
            answer(self)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()  # shutdown() waits a poll
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()
        server.server_close()


def _raw(body: bytes, code: int = 200, headers: Optional[dict[str, str]] = None) -> Callable:
    def answer(h: BaseHTTPRequestHandler) -> None:
        h.send_response(code)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}.items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)

    return answer


def _doc(contents: object = "T\nx", score: object = 1.0) -> dict:
    return {"document": {"id": "1", "contents": contents}, "score": score}


#: What a broken or hostile server answered (to a one-query request), and a word the error line must contain.
BAD_REPLIES = [
    ("not UTF-8", _raw(b'{"result": [[{"document": {"contents": "\xff\xfe"}}]]}'), "UTF-8"),
    ("not JSON", _raw(b"<html>hello</html>"), "not JSON"),
    ("nested 100,000 deep", _raw(b'{"result": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nested"),
    ("not a dict", _raw(b"[1, 2]"), "result"),
    ("result not a list", _raw(b'{"result": "x"}'), "result"),
    ("two lists for one query", _raw(json.dumps({"result": [[_doc()], [_doc()]]}).encode()), "2 result lists"),
    ("hits not a list", _raw(json.dumps({"result": [{"a": 1}]}).encode()), "not a list"),
    ("passage not a string", _raw(json.dumps({"result": [[_doc(contents={"x": 1})]]}).encode()), "contents"),
    ("passage a number", _raw(json.dumps({"result": [[_doc(contents=12)]]}).encode()), "contents"),
    ("score a string", _raw(json.dumps({"result": [[_doc(score="high")]]}).encode()), "score"),
    ("score NaN", _raw(b'{"result": [[{"document": {"contents": "x"}, "score": NaN}]]}'), "score"),
    ("score of 400 digits (no float)", _raw(b'{"result": [[{"document": {"contents": "x"}, "score": 1'
                                            + b"0" * 400 + b"}]]}"), "score"),
    ("a 2 MB reply over a 1 MB cap", _raw(b'{"result": [[' + b" " * (2 << 20) + b"]]}"), "bytes"),
    ("a redirect to file:///etc/passwd", _raw(b"{}", 307, {"Location": "file:///etc/passwd"}), "307"),
    ("HTTP 500 with a non-UTF-8 body", _raw(b"\xff" * 100, 500), "500"),
]


@probe("client_bad_replies")
def client_bad_replies(ws: Path) -> None:
    """The search agent's HTTP client against servers answering non-UTF-8, not JSON, JSON nested 100,000 deep, other
    shapes, non-string passages, a reply over its byte cap, a redirect to a local file: each is one UserError line
    naming the URL and what was wrong (they used to be UnicodeDecodeError / RecursionError / TypeError tracebacks)."""
    from emapg_cli.errors import UserError
    from emapg_cli.retrieval.http import HTTPRetriever

    for what, answer, needle in BAD_REPLIES:
        with _fake_server(answer) as url:
            client = HTTPRetriever(url, timeout_s=10, retries=1, backoff_s=0.01)
            client.max_reply_bytes = 1 << 20
            try:
                client.search(["q"], 3)
            except UserError as e:
                line = str(e)
                assert "\n" not in line and url in line and needle in line, f"{what}: {line[:300]!r}"
                continue
            except Exception as e:
                raise AssertionError(f"{what}: {type(e).__name__} instead of one line: {str(e)[:200]}") from None
            raise AssertionError(f"{what}: accepted")


def _dripper(count: int, delay_s: float, headers: bool = False) -> Callable:
    """An answer that drips: a reply of `count` bytes announced at once, then one byte every `delay_s`; with
    `headers`, a status line at once and then its headers, `count` bytes of them one every `delay_s`."""

    def answer(h: BaseHTTPRequestHandler) -> None:
        try:
            if headers:
                h.wfile.write(b"HTTP/1.1 200 OK\r\n")
            else:
                h.send_response(200)
                h.send_header("Content-Length", str(count))
                h.end_headers()
            h.wfile.flush()
            for _ in range(count):
                h.wfile.write(b"X" if headers else b" ")
                h.wfile.flush()
                time.sleep(delay_s)
        except OSError:
            pass  # the client gave up: what it should do

    return answer


@probe("client_reply_deadline")
def client_reply_deadline(ws: Path) -> None:
    """A server sends its reply one byte every 0.2 s, each byte well within the client's 0.5 s timeout: the client
    gives up within a few seconds (the whole reply must come within 3 x the timeout) with one line naming the URL,
    instead of reading for as long as the server drips (hours for a large reply)."""
    from emapg_cli.errors import UserError
    from emapg_cli.retrieval.http import HTTPRetriever

    with _fake_server(_dripper(200, 0.2)) as url:  # 40 s in all
        client = HTTPRetriever(url, timeout_s=0.5, retries=0)
        t0 = time.monotonic()
        try:
            client.search(["q"], 3)
        except UserError as e:
            took = time.monotonic() - t0
            assert took < 8, f"the client read a dripping reply for {took:.0f} s (timeout 0.5 s)"
            assert "\n" not in str(e) and url in str(e) and "took over" in str(e), f"{str(e)[:300]!r}"
            return
        raise AssertionError("a dripped reply of spaces was accepted")


@probe("client_failover_from_dripping_server")
def client_failover_from_dripping_server(ws: Path) -> None:
    """`search.url` lists a server that drips its reply (its headers, then its body) one byte a second and a healthy
    one, with `search.timeout_s` 2: each search is answered by the healthy one within ~2 s, the dripping try
    abandoned at its deadline (the timeout used to bound each read of the socket, so the first try read for as long
    as the server dripped, a minute and more, before the search failed or failed over)."""
    from emapg_cli.errors import UserError
    from emapg_cli.retrieval.http import HTTPRetriever

    good = _raw(json.dumps({"result": [[_doc("T\nParis")]]}).encode())
    for what, drip in (("headers", _dripper(30, 1.0, headers=True)), ("body", _dripper(60, 1.0))):
        with _fake_server(drip) as slow, _fake_server(good) as fast:
            client = HTTPRetriever([slow, fast], timeout_s=2, retries=0)
            t0 = time.monotonic()
            try:
                hits = client.search(["q"], 3)
            except UserError as e:
                raise AssertionError(f"dripping its {what}: the search failed instead of failing over: {e}") from None
            took = time.monotonic() - t0
            assert hits[0][0].contents.endswith("Paris"), f"dripping its {what}: {hits!r:.200}"
            assert took < 4, f"dripping its {what}: the search took {took:.0f} s (search.timeout_s 2, a healthy second URL)"


@probe("client_url_not_http")
def client_url_not_http(ws: Path) -> None:
    """`--set search.url=notaurl`, `file:///etc/passwd`, `ftp://h/x` and `http://` (no host) are refused as config
    errors (exit 2, one line naming search.url), so nothing is ever read from a local file."""
    for url in ("notaurl", "file:///etc/passwd"):
        one_line_error(emapg(ws, "config", "show", "--set", f"search.url={url}"), "search.url")
    from emapg_cli.config.models import SearchConfig

    for url in ("ftp://example.org/x", "http://", "https:///retrieve", "//host/retrieve"):
        try:
            SearchConfig(url=url)
        except ValueError:
            continue
        raise AssertionError(f"search.url={url} accepted")


@probe("client_train_not_utf8_reply", slow=True)
def client_train_not_utf8_reply(ws: Path) -> None:
    """`emapg train` with the search agent against a server answering bytes that are not UTF-8: the retriever check
    before the models load stops it with one line naming the URL (it used to be a UnicodeDecodeError traceback)."""
    model = _tiny_model()
    data = ws / "qa.jsonl"
    data.write_text(json.dumps({"id": "q0", "question": "What is the capital of France", "answers": ["Paris"]}) + "\n")
    with _fake_server(_raw(b'{"result": [[{"document": {"contents": "\xff"}}]]}')) as url:
        sets = [f"model.path={model}", f"data.train={data}", "rollout.reward=em", "rollout.prompts_per_step=1",
                "rollout.n=2", "rollout.max_new_tokens=4", "train.steps=1", "train.mini_batch_prompts=1",
                "train.micro_batch_size=2", "search.enabled=true",
                "search.retriever=http", f"search.url={url}", "search.retries=0"]
        r = emapg(ws, "train", *[x for kv in sets for x in ("--set", kv)], "--out", str(ws / "run"), timeout=180)
        one_line_error(r, url, "UTF-8")


def _tiny_model() -> Path:
    """A tiny random llama (tokenizer and weights), built once per process by the project's own test helper."""
    if "model" not in _CACHE:
        out = _tmp() / "tiny"
        code = "import sys; from emapg_cli.models.tiny import save_tiny; save_tiny(sys.argv[1], arch='llama')"
        r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300,
                           env=base_env(_tmp()))
        assert r.returncode == 0, f"building the tiny model failed: {r.stderr[-300:]}"
        _CACHE["model"] = out
    return _CACHE["model"]
