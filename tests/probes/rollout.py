"""The rollout server (`emapg rollout serve`), its weight pushes and its client (`RemoteEngine`) against hostile peers
(issue 32, items 8-11).

Server probes run the real `emapg rollout serve` on a tiny model, on 127.0.0.1 port 0 only, under an address-space
limit (a request that used to allocate tens of GB fails there instead of on the machine). Most share one server per
process (`_shared`, ~10 s to start), each connecting its own trainer; those that need options of their own start
their own. The trainer is the project's `RemoteEngine`; a hostile peer speaks raw HTTP. Client probes point
`RemoteEngine` at a tiny fake server on loopback. Every count and wait is bounded.
"""

from __future__ import annotations

import atexit
import json
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from . import probe
from .common import emapg, one_line_error
from .server import (_connect, _dripper, _fake_server, _health, _post, _read_reply, _refused, _Server, _tiny_model, _tmp,
                     serve_process)


#: The address-space limit of the probes' servers (GiB): the tiny model's server needs ~2.
MEMORY_GB = 6.0
_SHARED: dict[str, Any] = {}


@contextmanager
def _shared() -> Iterator[_Server]:
    """One `emapg rollout serve` on the tiny model with `--timeout 2`, started once per process (each probe that uses
    it connects its own trainer, which resets the server's version); what it prints on stderr during the block must
    hold no traceback."""
    if "server" not in _SHARED or _SHARED["server"].proc.poll() is not None:
        cm = serve_process(_tmp(), ["rollout", "serve", "--model", str(_tiny_model()), "--port", "0", "--threads", "1",
                                    "--timeout", "2"], "ready", memory_gb=MEMORY_GB)
        _SHARED["cm"], _SHARED["server"] = cm, cm.__enter__()  # the generator kept: collected, it would kill it
        _SHARED["stderr"] = []  # drained by a thread: a full pipe would block the server
        drain = threading.Thread(target=lambda: _SHARED["stderr"].extend(iter(_SHARED["server"].proc.stderr.readline,
                                                                              "")), daemon=True)
        drain.start()
        atexit.register(_stop_shared, drain)
    start = len(_SHARED["stderr"])
    yield _SHARED["server"]
    time.sleep(0.2)
    err = "".join(_SHARED["stderr"][start:])
    assert "Traceback" not in err and "Exception" not in err, f"the server printed a traceback: {err[-400:]!r}"


def _stop_shared(drain: threading.Thread) -> None:
    """At exit: kill the shared server, let the drain thread read to end of file, then close its pipes (closing them
    while the thread still reads aborts the interpreter at shutdown)."""
    _SHARED["server"].proc.kill()
    drain.join(timeout=30)
    _SHARED["cm"].__exit__(None, None, None)


def _url(server: _Server) -> str:
    return f"http://127.0.0.1:{server.port}"


def _trainer(server: _Server, timeout_s: float = 60):
    """A `RemoteEngine` (the trainer's client) on `server`, and the tiny model's weights to push."""
    from emapg_cli.engines.remote import RemoteEngine
    from emapg_cli.models.loading import load_causal_lm

    if "model" not in _SHARED:
        _SHARED["model"] = load_causal_lm(str(_tiny_model()), "float32")
    return RemoteEngine(_url(server), timeout_s=timeout_s), _SHARED["model"]


def _json(port: int, path: str, obj: Any, headers: Optional[dict[str, str]] = None, timeout: float = 20) -> tuple[int, Any]:
    return _post(port, json.dumps(obj).encode(), headers, timeout=timeout, path=path)


def _generate(port: int, token: Optional[str] = None, timeout: float = 20, **params: Any) -> tuple[int, Any]:
    body = {"prompts": params.pop("prompts", [[10, 11, 12]]), "params": {"max_new_tokens": 2, **params}, "timeout_s": 10}
    if token is not None:
        body["token"] = token
    return _json(port, "/generate", body, timeout=timeout)


def _send_flood(port: int, path: str, body: bytes, declared: Optional[int] = None) -> tuple[int, Any]:
    """(status, JSON reply) of a POST whose `body` is sent by another thread while the reply is read: a server that
    refuses before reading the whole body may close the connection under the sender (what it should do)."""
    s = _connect(port, 30)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"
              % (path.encode(), len(body) if declared is None else declared))

    def send() -> None:
        try:
            s.sendall(body)
        except OSError:
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        return _read_reply(s)
    finally:
        sender.join(30)
        s.close()


def _push_body(token: Any, version: int, rows: list, tensors: bytes) -> bytes:
    from emapg_cli.engines.rollout_protocol import push_header

    return push_header(version, token, rows) + tensors


def _manifest(model: Any) -> tuple[list, list]:
    """(manifest rows, each tensor's bytes) of the tiny model as the server holds it (float32)."""
    import torch

    from emapg_cli.engines.remote import named_tensors
    from emapg_cli.engines.rollout_protocol import manifest

    named = named_tensors(model)
    return manifest(named), [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for _, t in named]


def _threads(server: _Server) -> int:
    return int(re.search(r"Threads:\s+(\d+)", Path(f"/proc/{server.proc.pid}/status").read_text()).group(1))


# ---------------------------------------------------------------------------------------------- weights (item 8)

@probe("push_sizes_checked_before_reading")
def push_sizes_checked_before_reading(ws: Path) -> None:
    """The connected trainer's token in hand, a peer pushes a manifest whose first tensor is followed by 40 MB where
    66 KB belong, then a body shorter than its manifest, then a misshapen tensor: each is a 4xx naming the size or
    shape and nothing is applied (a 40 MB tensor into a 66 KB parameter used to abort the server: gloo's enforce,
    exit -6); the server keeps serving and the trainer's next push and generate work."""
    with _shared() as server:
        trainer, model = _trainer(server)
        trainer.push_weights(model, 0)
        rows, data = _manifest(model)
        body = b"".join(data)
        token = trainer._token
        _refused(_send_flood(server.port, "/weights/push", _push_body(token, 1, rows, body + b"\0" * (40 << 20))), 400,
                 needle="bytes of tensors")
        short = _push_body(token, 1, rows, body)[:-1000]
        with _connect(server.port, 20) as s:  # declares the whole body, sends all but 1,000 bytes, then stops
            s.sendall(b"POST /weights/push HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (len(short) + 1000) + short)
            s.shutdown(socket.SHUT_WR)
            status, reply = _read_reply(s)
        assert 400 <= status < 500, f"a push cut short: HTTP {status} {reply!r:.200}"
        bad = [list(r) for r in rows]
        bad[0][2] = [bad[0][2][0] * 600] + bad[0][2][1:]
        _refused(_send_flood(server.port, "/weights/push", _push_body(token, 1, bad, body)), 400, needle="the server holds")
        _health(server)
        assert trainer.generate([[10, 11]], _params(max_new_tokens=2))[0][0].weights_version == 0, "a refused push applied"
        trainer.push_weights(model, 1)
        assert trainer.generate([[10, 11]], _params(max_new_tokens=2))[0][0].weights_version == 1


def _params(**kw: Any):
    from emapg_cli.engines.base import SamplingParams

    return SamplingParams(**kw)


@probe("second_trainer_cannot_hijack")
def second_trainer_cannot_hijack(ws: Path) -> None:
    """Trainer A connects and pushes version 1; trainer B connects and pushes version 5: A's next generate (as its
    asynchronous pipeline asks: any version >= 1) is refused (409, another trainer connected) instead of being served
    B's version 5 with 200."""
    from emapg_cli.errors import UserError

    with _shared() as server:
        a, model = _trainer(server)
        a.push_weights(model, 1)
        b, _ = _trainer(server)
        b.push_weights(model, 5)
        try:
            got = a.generate([[10, 11]], _params(max_new_tokens=2, min_version=1))
        except UserError as e:
            assert "409" in str(e) and "another trainer" in str(e), str(e)
            return
        raise AssertionError(f"trainer A was served version {got[0][0].weights_version} of trainer B with 200")


@probe("push_without_connect_refused")
def push_without_connect_refused(ws: Path) -> None:
    """A client that never connected pushes version 99 while a trainer is connected: as the old protocol's JSON with a
    guessed session number, and with a guessed or empty token: each is refused (4xx) and the served version stays
    the trainer's (a guessed session number used to be accepted and the tensors applied as version 99)."""
    with _shared() as server:
        trainer, model = _trainer(server)
        trainer.push_weights(model, 3)
        rows, data = _manifest(model)
        for session in range(1, 6):  # session numbers counted connects
            status, _ = _json(server.port, "/weights/push", {"version": 99, "session": session, "tensors": rows})
            assert 400 <= status < 500, f"a push with session {session}: HTTP {status}"
        for token in ("1", "", None, "x" * 32):
            status, _ = _send_flood(server.port, "/weights/push", _push_body(token, 99, rows, b"".join(data)))
            assert 400 <= status < 500, f"a push with token {token!r}: HTTP {status}"
        assert trainer.generate([[10, 11]], _params(max_new_tokens=2))[0][0].weights_version == 3


@probe("nan_weights_refused")
def nan_weights_refused(ws: Path) -> None:
    """The trainer pushes a version with one NaN and then one with an infinity: each push fails with one line (HTTP
    422 naming the tensor), nothing is applied, and the server keeps sampling the last finite version (NaN weights
    used to be applied and served)."""
    import torch

    from emapg_cli.errors import UserError

    with _shared() as server:
        trainer, model = _trainer(server)
        trainer.push_weights(model, 2)
        name, p = next(iter(model.named_parameters()))
        for value in (float("nan"), float("inf")):
            saved = p.detach().clone()
            with torch.no_grad():
                p.view(-1)[7] = value
            try:
                trainer.push_weights(model, 3)
                raise AssertionError(f"a version holding {value} in {name} was accepted")
            except UserError as e:
                assert "422" in str(e) and name in str(e) and "\n" not in str(e), str(e)
            finally:
                with torch.no_grad():
                    p.copy_(saved)
        got = trainer.generate([[10, 11]], _params(max_new_tokens=2, min_version=0))[0][0].weights_version
        assert got == 2, f"the server samples version {got}, not the last finite one (2)"


@probe("connect_flood_bounded")
def connect_flood_bounded(ws: Path) -> None:
    """100 `POST /weights/connect` naming a store on a loopback black hole (a socket that never answers), in the old
    protocol's shapes (gloo to any host; nccl, since removed): each is answered within seconds and the
    server holds no thread for them (each used to hold a thread for its timeout, 10 minutes; the server dialled any
    host:port a client named); /health answers."""
    with _shared() as server:
        hole = socket.create_server(("127.0.0.1", 0), backlog=1)  # never accepts: connects hang in its backlog
        try:
            before, t0 = _threads(server), time.monotonic()
            for i in range(100):
                old = {"host": "127.0.0.1", "port": hole.getsockname()[1], "backend": "gloo", "timeout_s": 600}
                new = {"backend": "nccl", "port": hole.getsockname()[1], "timeout_s": 600}
                status, _ = _json(server.port, "/weights/connect", old if i % 2 else new, timeout=10)
                assert 400 <= status < 500, f"connect {i}: HTTP {status}"
            took = time.monotonic() - t0
            time.sleep(0.5)
            grown = _threads(server) - before
            assert grown < 10, f"the server holds {grown} more threads after 100 connects to a black hole"
            assert took < 30, f"100 connects took {took:.0f} s"
            _health(server)
        finally:
            hole.close()


@probe("secret_required_off_loopback", slow=True)
def secret_required_off_loopback(ws: Path) -> None:
    """`rollout serve --host 192.0.2.1` (an address beyond this machine, never assigned) without a secret is one line
    naming --secret, before anything loads or listens; a secret of 8 characters too. A server started with
    EMAPG_ROLLOUT_SECRET (on 127.0.0.1) answers 401 to requests without it, and the trainer with the same variable
    connects, pushes and samples."""
    model = str(_tiny_model())
    one_line_error(emapg(ws, "rollout", "serve", "--model", model, "--host", "192.0.2.1", "--port", "0", timeout=60),
                   "--secret", "EMAPG_ROLLOUT_SECRET")
    one_line_error(emapg(ws, "rollout", "serve", "--model", model, "--secret", "short", "--port", "0", timeout=60),
                   "at least 16")
    secret = "s3cret-for-the-probe-0123456789"
    with serve_process(ws, ["rollout", "serve", "--model", model, "--port", "0", "--threads", "1"], "ready",
                       env={"EMAPG_ROLLOUT_SECRET": secret}, memory_gb=MEMORY_GB) as server:
        with _connect(server.port) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            _refused(_read_reply(s), 401, needle="EMAPG_ROLLOUT_SECRET")
        _refused(_generate(server.port), 401)
        _refused(_json(server.port, "/weights/connect", {"backend": "http", "timeout_s": 60},
                       headers={"Authorization": "Bearer wrong"}), 401)
        import os

        os.environ["EMAPG_ROLLOUT_SECRET"] = secret
        try:
            trainer, model_ = _trainer(server)
            trainer.push_weights(model_, 4)
            assert trainer.generate([[10, 11]], _params(max_new_tokens=2))[0][0].weights_version == 4
        finally:
            del os.environ["EMAPG_ROLLOUT_SECRET"]


# ---------------------------------------------------------------------------------------------- requests (item 9)

@probe("generate_caps")
def generate_caps(ws: Path) -> None:
    """`n=64, max_new_tokens=10**8` (it used to allocate ~51 GB), `n=200000` (it used to generate for hours after the
    client left) and prompts of 2^28 tokens in all are refused with 413 at once, and the server's memory does not
    grow."""
    with _shared() as server:
        before = server.peak_rss_kb()
        t0 = time.monotonic()
        _refused(_generate(server.port, n=64, max_new_tokens=10 ** 8), 413, needle="max_new_tokens")
        _refused(_generate(server.port, n=200_000, max_new_tokens=16), 413, needle="sequences")
        _refused(_generate(server.port, prompts=[[5] * 4000] * 1000, n=64, max_new_tokens=1024, timeout=60), 413,
                 needle="tokens")
        assert time.monotonic() - t0 < 30, "the refusals took over 30 s"
        grown = (server.peak_rss_kb() - before) / 1024
        assert grown < 300, f"the server's peak memory grew by {grown:.0f} MiB refusing them"
        _health(server)


@probe("sampling_params_refused")
def sampling_params_refused(ws: Path) -> None:
    """A temperature of Infinity, -Infinity, -1 or NaN, a top_p of 0, -0.1, 1.5 or Infinity, an empty prompt, token ids
    outside the vocabulary, n 0, an unknown key, two conflicting Content-Length headers: each a 4xx with a JSON error,
    nothing generated; the server stays up (an infinite or negative temperature used to be sampled with)."""
    with _shared() as server:
        vocab = _json_get(server.port, "/health")["model"]["vocab_size"]
        for body in ('"temperature": Infinity', '"temperature": -Infinity', '"temperature": -1', '"temperature": NaN',
                     '"temperature": 1e400', '"top_p": 0', '"top_p": -0.1', '"top_p": 1.5', '"top_p": Infinity',
                     '"n": 0', '"max_new_tokens": 0', '"stop": [""]', '"seed": -1'):
            raw = ('{"prompts": [[10, 11]], "timeout_s": 10, "params": {"max_new_tokens": 2, %s}}' % body).encode()
            status, reply = _post(server.port, raw, path="/generate")
            assert 400 <= status < 500 and "error" in reply, f"{body}: HTTP {status} {reply!r:.200}"
        for prompts in ([[]], [[10], []], [[-1]], [[vocab]], [[10 ** 30]], [["a"]], [[1.5]]):
            status, reply = _json(server.port, "/generate", {"prompts": prompts, "params": {"max_new_tokens": 2}})
            assert 400 <= status < 500, f"prompts {prompts!r:.40}: HTTP {status} {reply!r:.200}"
        _refused(_json(server.port, "/generate", {"prompts": [[1]], "params": {}, "extra": 1}), 400, needle="unknown key")
        with _connect(server.port) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 70\r\n\r\n{}")
            _refused(_read_reply(s), 400, 411)
        _health(server)


def _json_get(port: int, path: str) -> Any:
    with _connect(port) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        status, body = _read_reply(s)
    assert status == 200, f"GET {path}: HTTP {status}"
    return body


def _long_request(port: int) -> socket.socket:
    """A socket whose generate request holds the server for well over the probes' 2-s deadlines: 4 prompts x 256
    sequences of up to 1,000 tokens on one CPU thread. (One prompt x 256 took about 3 s once the decode loop dropped
    ended rows: the tiny model's responses end at EOS, and the probe that waited behind it then got its 200.)"""
    prompts = [[10, 11, 12], [13, 14, 15], [16, 17, 18], [19, 20, 21]]
    body = json.dumps({"prompts": prompts, "params": {"n": 256, "max_new_tokens": 1000}, "timeout_s": 600}).encode()
    s = _connect(port, 30)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    return s


@probe("deadline_counts_from_arrival")
def deadline_counts_from_arrival(ws: Path) -> None:
    """While one request generates for minutes, a second one with `timeout_s` 2 is answered (504) within a few
    seconds of its arrival: its deadline counts from then, not from when it got the generation lock (it used to get
    no reply until the first one was done)."""
    with _shared() as server:
        long = _long_request(server.port)
        try:
            time.sleep(1.5)
            t0 = time.monotonic()
            body = {"prompts": [[10]], "params": {"max_new_tokens": 2}, "timeout_s": 2}
            status, reply = _json(server.port, "/generate", body, timeout=30)
            took = time.monotonic() - t0
            assert status == 504 and took < 6, f"HTTP {status} after {took:.1f} s (timeout_s 2): {reply!r:.200}"
        finally:
            long.close()


@probe("generation_cancelled_when_client_left")
def generation_cancelled_when_client_left(ws: Path) -> None:
    """A client asks for minutes of generation and hangs up after 1.5 s: the server stops that generation, and the
    next request is served within seconds (the generation used to go on to its end, holding the lock)."""
    with _shared() as server:
        long = _long_request(server.port)
        time.sleep(1.5)
        long.close()
        t0 = time.monotonic()
        status, reply = _json(server.port, "/generate", {"prompts": [[10]], "params": {"max_new_tokens": 2}, "timeout_s": 60},
                              timeout=60)
        took = time.monotonic() - t0
        assert status == 200 and took < 8, f"HTTP {status} after {took:.1f} s: {reply!r:.200}"


@probe("body_bounded")
def body_bounded(ws: Path) -> None:
    """A client declares a 200 MB body and sends it: refused with 413 before it is read (the server's peak memory
    grows far less than the body; it used to read and parse it: 4.3 GB); the server keeps answering."""
    with _shared() as server:
        before = server.peak_rss_kb()
        body = b'{"prompts": [' + b"[1, 2, 3, 4, 5, 6, 7, 8], " * ((200 << 20) // 26) + b"[1]]}"
        _refused(_send_flood(server.port, "/generate", body), 413)
        del body
        grown = (server.peak_rss_kb() - before) / 1024
        assert grown < 64, f"the server's peak memory grew by {grown:.0f} MiB refusing a 200 MB body"
        _health(server)


@probe("idle_connections_keep_health", slow=True)
def idle_connections_keep_health(ws: Path) -> None:
    """150 clients connect and stay idle while the server has 64 file descriptors: it does not spin (CPU stays low)
    and /health answers within seconds while they are still connected (idle connections are dropped after
    --timeout; it used to spin at 98% CPU and stop answering)."""
    with serve_process(ws, ["rollout", "serve", "--model", str(_tiny_model()), "--port", "0", "--threads", "1",
                            "--timeout", "1"], "ready", nofile=64, memory_gb=MEMORY_GB) as server:
        _health(server)
        socks = []
        for _ in range(150):
            try:
                socks.append(_connect(server.port, 5))
            except OSError:
                break
        try:
            time.sleep(1.0)
            cpu0 = server.cpu_s()
            time.sleep(2.0)
            spent = server.cpu_s() - cpu0
            assert spent < 0.5, f"the server used {spent:.2f} s of CPU in 2 s with idle clients (spinning)"
            _health(server, timeout=15)
        finally:
            for s in socks:
                s.close()


# ---------------------------------------------------------------------------------------------- client (items 10, 11)

@probe("client_deadline_covers_request")
def client_deadline_covers_request(ws: Path) -> None:
    """`RemoteEngine(timeout_s=2)` against a server that drips its reply one byte a second: one line naming the
    timeout within ~2 s (the timeout bounded each read of the socket, so it read for as long as the server dripped)."""
    from emapg_cli.engines.remote import RemoteEngine
    from emapg_cli.errors import UserError

    with _fake_server(_dripper(30, 1.0, headers=True)) as url:
        t0 = time.monotonic()
        try:
            RemoteEngine(url.rsplit("/", 1)[0], timeout_s=2)
            raise AssertionError("a dripping server was accepted")
        except UserError as e:
            took = time.monotonic() - t0
            assert took < 5, f"the client read a dripping server for {took:.0f} s (timeout_s 2)"
            assert "no reply within 2 s" in str(e) and "\n" not in str(e), str(e)


def _fake_rollout(completion: dict) -> Any:
    """A loopback stand-in of a rollout server: a /health of the project's protocol, every /generate answered with
    one `completion`."""
    from emapg_cli.engines.rollout_protocol import PROTOCOL

    health = {"status": "ok", "protocol": PROTOCOL, "engine": "hf", "model": {"vocab_size": 259}, "tokenizer": "x",
              "weights_version": -1, "records_topk": True, "dtype": "float32", "connected": False, "device": "cpu"}

    def answer(h: BaseHTTPRequestHandler) -> None:
        body = json.dumps(health if h.command == "GET" else
                          {"completions": [[completion]], "weights_version": -1, "wait_s": 0.0}).encode()
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return answer


@probe("client_ids_outside_vocabulary")
def client_ids_outside_vocabulary(ws: Path) -> None:
    """A hostile rollout server answers token ids outside the model's vocabulary (259 tokens: id 10**6, id -1), top-k
    ids outside it, NaN log-probs, or more tokens than max_new_tokens: each is one UserError line, never a completion
    the trainer would index its embedding with (an IndexError on CPU, a device-side assert on a GPU)."""
    import base64

    from emapg_cli.engines.remote import RemoteEngine
    from emapg_cli.errors import UserError

    def f8(*v: float) -> str:
        import struct

        return base64.b64encode(struct.pack(f"<{len(v)}d", *v)).decode()

    def i4(*v: int) -> str:
        import struct

        return base64.b64encode(struct.pack(f"<{len(v)}i", *v)).decode()

    base = {"text": "x", "finish_reason": "stop", "logprobs": None, "topk": None, "k": 0}
    cases = [("id 10**6", {**base, "token_ids": [5, 10 ** 6]}), ("id -1", {**base, "token_ids": [-1]}),
             ("id 259", {**base, "token_ids": [259]}),
             ("top-k id 300", {**base, "token_ids": [5], "topk": i4(300), "k": 1}),
             ("NaN log-prob", {**base, "token_ids": [5], "logprobs": f8(float("nan"))}),
             ("5 tokens for max_new_tokens 2", {**base, "token_ids": [5, 6, 7, 8, 9]})]
    for what, completion in cases:
        with _fake_server(_fake_rollout(completion)) as url:
            engine = RemoteEngine(url.rsplit("/", 1)[0], timeout_s=10)
            try:
                engine.generate([[1, 2]], _params(max_new_tokens=2))
            except UserError as e:
                assert "\n" not in str(e) and "unexpected reply" in str(e), f"{what}: {e}"
                continue
            except Exception as e:
                raise AssertionError(f"{what}: {type(e).__name__} instead of one line: {str(e)[:200]}") from None
            raise AssertionError(f"{what}: accepted")
