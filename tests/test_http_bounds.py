"""The HTTP pieces both servers and both clients share (issue 32): a client request whose deadline covers all of it
(emapg_cli/http_client.py), and a refusal that reaches a client still sending its body. Real sockets on 127.0.0.1
only; every wait bounded (seconds)."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from emapg_cli import http_client


def _drip_server(script: bytes, delay_s: float) -> tuple[socket.socket, threading.Thread]:
    """A loopback server that answers one connection with `script`, one byte every `delay_s` (all at once for 0)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            try:
                for b in script if delay_s else [script]:
                    conn.sendall(bytes([b]) if delay_s else b)
                    time.sleep(delay_s)
            except OSError:
                pass  # the client gave up: what it should do

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize("script", [b"HTTP/1.1 200 OK\r\nX-A: " + b"a" * 100,  # dripping its headers
                                    b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n" + b" " * 50])  # its body
def test_the_deadline_covers_the_whole_request(script):
    """A server sending a byte every 0.3 s (each read well within a 1 s socket timeout) is abandoned at the 1 s
    deadline: `Deadline` after ~1 s, not once it stopped dripping (~9 s here; 30 s in the reviewer's case)."""
    listener, thread = _drip_server(script, 0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(http_client.Deadline):
            http_client.request(f"http://127.0.0.1:{listener.getsockname()[1]}/x", timeout_s=1.0, max_reply_bytes=1 << 20)
        assert time.monotonic() - t0 < 2.5
    finally:
        listener.close()
        thread.join(15)


def test_a_reply_over_its_cap_is_refused():
    listener, thread = _drip_server(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n" + b"x" * 20, 0.0)
    try:
        with pytest.raises(http_client.ReplyTooLarge, match="over 10 bytes"):
            http_client.request(f"http://127.0.0.1:{listener.getsockname()[1]}/", timeout_s=5, max_reply_bytes=10)
    finally:
        listener.close()
        thread.join(15)


def test_a_refusal_reaches_a_client_still_sending_its_body():
    """The shared server refuses a 64 MiB body over its 1 KiB cap before reading it; the client, which sends the body
    as buffers, stops sending and gets the 413 with its JSON error (not a connection reset)."""
    from emapg_cli.serve.http_server import BoundedHandler, BoundedServer

    class Handler(BoundedHandler):
        def do_POST(self) -> None:  # noqa: N802
            if self.read_body() is not None:
                self.send_json(200, {"ok": True})

    server = BoundedServer(("127.0.0.1", 0), Handler, max_connections=4, timeout_s=5, max_body_bytes=1024)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        chunk = memoryview(bytes(1 << 20))
        t0 = time.monotonic()
        reply = http_client.request(f"http://127.0.0.1:{server.server_address[1]}/", "POST", iter([chunk] * 64),
                                    timeout_s=20, max_reply_bytes=1 << 20, body_length=64 << 20)
        assert reply.status == 413 and b"at most 1024" in reply.body and time.monotonic() - t0 < 10
        ok = http_client.request(f"http://127.0.0.1:{server.server_address[1]}/", "POST", b"{}", timeout_s=5,
                                 max_reply_bytes=1 << 20)
        assert (ok.status, ok.body) == (200, b'{"ok": true}')
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_with_a_secret_answers_only_requests_that_carry_it(monkeypatch):
    """With a secret, every request, /health included, needs `Authorization: Bearer <secret>` (401 with one line
    naming EMAPG_ROLLOUT_SECRET otherwise); `RemoteEngine` sends the secret of its EMAPG_ROLLOUT_SECRET."""
    from types import SimpleNamespace

    from emapg_cli.engines.remote import RemoteEngine
    from emapg_cli.serve.rollout_server import make_server
    from emapg_cli.serve.rollout_service import RolloutService, ServedModel
    from emapg_cli.errors import UserError

    engine = SimpleNamespace(records_topk=False)
    served = ServedModel(engine, "hf", {"vocab_size": 7}, "t", {"w": ("float32", [2])}, "cpu")
    secret = "a-secret-of-24-characters"
    server = make_server(RolloutService(served), "127.0.0.1", 0, secret=secret)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": secret}):
            reply = http_client.request(url + "/health", timeout_s=5, max_reply_bytes=1 << 16, headers=headers)
            assert reply.status == 401 and b"EMAPG_ROLLOUT_SECRET" in reply.body, (headers, reply)
        monkeypatch.delenv("EMAPG_ROLLOUT_SECRET", raising=False)
        with pytest.raises(UserError, match=r"HTTP 401: .*\(EMAPG_ROLLOUT_SECRET is not set here\)"):
            RemoteEngine(url, timeout_s=5)
        monkeypatch.setenv("EMAPG_ROLLOUT_SECRET", secret)
        assert RemoteEngine(url, timeout_s=5).health["model"] == {"vocab_size": 7}
    finally:
        server.shutdown()
        server.server_close()


def test_the_agent_endpoint_is_a_bounded_server_answering_in_openais_error_body():
    """The trainer's agent endpoint (serve/openai_http.OpenAIServer) keeps the shared server's bounds: a client that
    drips its request a byte at a time is dropped at `timeout_s` (0.5 s here; a per-recv timeout alone held it for as
long as it dripped),
    a connection past `max_connections` (1) gets a 503 at once, a body over `max_body_bytes` a 413 unread, and each
    refusal is OpenAI's error body (`{"error": {"message", "type", ...}}`, which the `openai` client reads)."""
    import json
    from types import SimpleNamespace

    from emapg_cli.serve.openai_http import start_server

    never = lambda *a: pytest.fail("a refused request reached the service")  # noqa: E731
    service = SimpleNamespace(models=never, chat=never, completions=never)
    server, url = start_server(service, "127.0.0.1", 0, max_connections=1, timeout_s=0.5, max_body_bytes=64)
    port = server.server_address[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as stalled:
            stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            time.sleep(0.2)  # its thread has taken the one slot
            busy = http_client.request(url + "/models", timeout_s=5, max_reply_bytes=1 << 16)
            assert busy.status == 503 and json.loads(busy.body)["error"]["type"] == "server_error"
            t0, closed = time.monotonic(), None
            for byte in b"ngth: 5\r\nX-Drip: " + b"a" * 40:  # one byte every 0.2 s: each recv well within 0.5 s
                stalled.sendall(bytes([byte]))
                if select.select([stalled], [], [], 0.2)[0] and stalled.recv(1) == b"":
                    closed = time.monotonic() - t0
                    break
            assert closed is not None and closed < 2.0, closed  # dropped at its request's deadline
        time.sleep(0.2)
        big = http_client.request(url + "/chat/completions", "POST", b"x" * 100, timeout_s=5, max_reply_bytes=1 << 16)
        error = json.loads(big.body)["error"]
        assert big.status == 413 and error["type"] == "invalid_request_error" and "at most 64" in error["message"]
    finally:
        server.shutdown()
        server.server_close()
