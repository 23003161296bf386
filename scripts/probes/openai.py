"""OpenAI's wire format for the policy (issue 36): `emapg rollout serve --openai` and the trainer's agent endpoint
against hostile clients.

One real `emapg rollout serve --openai` on a tiny model (built locally) serves every probe of this module, on
127.0.0.1 port 0, with a secret (EMAPG_ROLLOUT_SECRET: every request sends it as its API key) and tight limits
(`--timeout 2 --max-connections 8 --max-new-tokens 64 --max-request-tokens 65536`); each probe talks to it with raw
sockets or the real `openai` client and ends by checking that it still answers. Every refusal must be OpenAI's error
body (`{"error": {"message", "type", ...}}`) with a 4xx/5xx status, quickly, without a traceback (on the wire or on
the server's stderr); every count and wait is bounded.
"""

from __future__ import annotations

import atexit
import json
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from . import probe
from .common import base_env
from .server import _connect, _read_reply

_CACHE: dict[str, object] = {}
#: The server's secret: an OpenAI client sends it as its api_key.
SECRET = "openai-probe-secret-0123456789"
AUTH = {"Authorization": f"Bearer {SECRET}"}


def _server(ws: Path) -> int:
    """The port of the module's one `emapg rollout serve --openai` (started on first use, killed at exit); its stderr
    since the previous call must hold no traceback."""
    if "port" not in _CACHE:
        from emapg_cli.models.tiny import save_tiny

        root = Path(tempfile.mkdtemp(prefix="emapg-openai-probes-"))
        atexit.register(shutil.rmtree, root, True)
        model = _CACHE["model"] = save_tiny(root / "model", arch="qwen2")
        proc = subprocess.Popen([sys.executable, "-m", "emapg_cli", "rollout", "serve", "--model", str(model), "--port", "0",
                                 "--threads", "1", "--openai", "--timeout", "2", "--max-connections", "8",
                                 "--max-new-tokens", "64", "--max-request-tokens", "65536"], cwd=root,
                                env={**base_env(ws), "EMAPG_ROLLOUT_SECRET": SECRET}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        err: list[str] = []  # drained by a thread: a full pipe would block the server
        drain = threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, "")), daemon=True)
        drain.start()
        atexit.register(_stop, proc, drain)
        _CACHE["stderr"], _CACHE["seen"] = err, 0
        line, end = "", time.monotonic() + 120
        while time.monotonic() < end and "ready" not in line:
            if proc.poll() is not None:
                drain.join(5)
                raise AssertionError(f"`rollout serve --openai` exited {proc.returncode}: {''.join(err)[-300:]!r}")
            if select.select([proc.stdout], [], [], 0.5)[0]:
                line = proc.stdout.readline()
        m = re.search(r"OpenAI API at http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, f"the server did not say where its OpenAI API is: {line!r}"
        _CACHE["port"], _CACHE["proc"] = int(m.group(1)), proc
    proc = _CACHE["proc"]
    assert proc.poll() is None, f"the server exited ({proc.returncode})"  # type: ignore[union-attr]
    err, seen = _CACHE["stderr"], int(_CACHE["seen"])  # type: ignore[arg-type]
    new, _CACHE["seen"] = "".join(err[seen:]), len(err)  # type: ignore[arg-type]
    assert "Traceback" not in new and "Fatal Python error" not in new, f"the server printed a traceback: {new[-400:]!r}"
    return int(_CACHE["port"])  # type: ignore[arg-type]


def _stop(proc: subprocess.Popen, drain: threading.Thread) -> None:
    """At exit: kill the server, let the drain thread read to end of file, then close the pipes (closing them while
    the thread still reads aborts the interpreter at shutdown)."""
    proc.kill()
    proc.wait(30)
    drain.join(timeout=30)
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()


def _request(port: int, head: str, body: bytes = b"", timeout: float = 30) -> tuple[int, object, float]:
    """(status, parsed JSON body, seconds) of one raw request."""
    t0 = time.monotonic()
    with _connect(port, timeout) as s:
        try:
            s.sendall(head.encode() + b"\r\n" + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused before reading it all: its reply is still there
        status, reply = _read_reply(s)
    return status, reply, time.monotonic() - t0


def _post(port: int, path: str, obj: object = None, raw: Optional[bytes] = None, headers: Optional[dict] = None):
    body = raw if raw is not None else json.dumps(obj).encode()
    h = {"Content-Type": "application/json", "Content-Length": str(len(body)), **AUTH, **(headers or {})}
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items() if v is not None)
    return _request(port, head, body)


def _refused(reply, *codes: int, param: Optional[str] = None, within_s: float = 10.0, needle: str = "") -> None:
    status, body, seconds = reply
    assert status in codes, f"expected HTTP {'/'.join(map(str, codes))}, got {status}: {str(body)[:200]}"
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str), \
        f"refusal without OpenAI's error body: {body!r:.200}"
    assert "Traceback" not in err["message"] and "\n" not in err["message"], f"not one line: {err['message']!r:.200}"
    assert needle in err["message"], f"the refusal does not name {needle!r}: {err['message']!r:.200}"
    if param is not None:
        assert err.get("param") == param, f"param {err.get('param')!r}, expected {param!r}: {err['message']!r:.200}"
    assert seconds < within_s, f"the refusal took {seconds:.1f} s"


def _still_serves(port: int) -> None:
    status, body, _ = _request(port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n")
    assert status == 200 and body.get("object") == "list", f"/v1/models no longer answers: {status} {body!r:.200}"


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@probe("body-declared-huge")
def body_declared_huge(ws: Path) -> None:
    """A client declared a 100 GB body: 413 at once, nothing read; a 13-digit length: 400; the server keeps serving."""
    port = _server(ws)
    _refused(_post(port, "/v1/chat/completions", raw=b"{}", headers={"Content-Length": str(10**11)}), 413)
    _refused(_post(port, "/v1/chat/completions", raw=b"{}", headers={"Content-Length": str(10**12)}), 400)
    _still_serves(port)


@probe("body-without-length")
def body_without_length(ws: Path) -> None:
    """A chunked body (no Content-Length): 411, OpenAI's error body."""
    port = _server(ws)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\nTransfer-Encoding: chunked\r\n"
    _refused(_request(port, head, b"2\r\n{}\r\n0\r\n\r\n"), 411)
    _still_serves(port)


@probe("body-not-json-or-nested")
def body_not_json(ws: Path) -> None:
    """Bytes that are not JSON, and JSON nested 200,000 deep: 400 each, no recursion crash."""
    port = _server(ws)
    _refused(_post(port, "/v1/chat/completions", raw=b"\xff{not json"), 400)
    _refused(_post(port, "/v1/completions", raw=b"[" * 200_000 + b"]" * 200_000), 400)
    _still_serves(port)


@probe("sampling-asks-too-much")
def sampling_asks_too_much(ws: Path) -> None:
    """n of a billion, max_tokens past the context, top_logprobs 10^6, streaming, penalties: each refused with the
    field named; max_tokens past --max-new-tokens, n x (prompt + max_tokens) past --max-request-tokens: 413 naming
    the option; a stop string past 256 characters: 400; all before anything is sampled."""
    port = _server(ws)
    for extra, param, code in (({"n": 10**9}, "n", 400), ({"max_tokens": 10**9}, "max_tokens", 400),
                               ({"logprobs": True, "top_logprobs": 10**6}, "top_logprobs", 400),
                               ({"stream": True}, "stream", 400), ({"frequency_penalty": 2}, "frequency_penalty", 400),
                               ({"logit_bias": {"5": 100}}, "logit_bias", 400), ({"tool_choice": "required"}, "tool_choice", 400)):
        _refused(_post(port, "/v1/chat/completions", {**CHAT, **extra}), code, param=param)
    for extra, words in (({"max_tokens": 65}, "--max-new-tokens"), ({"stop": ["x" * 300]}, "256 characters")):
        _refused(_post(port, "/v1/chat/completions", {**CHAT, **extra}), 413 if "max" in words else 400, needle=words)
    many = {"model": "m", "prompt": [[5, 6]] * 64, "n": 16, "max_tokens": 64}  # 16 x 64 x (2 + 64) = 67,584 tokens
    _refused(_post(port, "/v1/completions", many), 413, needle="--max-request-tokens")
    _refused(_post(port, "/v1/completions", {"model": "m", "prompt": [[5]] * 65}), 400, param="prompt")
    _still_serves(port)


@probe("prompts-out-of-bounds")
def prompts_out_of_bounds(ws: Path) -> None:
    """Token ids past the vocabulary, negative ids, 5,000 messages, a 3 MB message: refused quickly (no tokenizing of
    a text that cannot fit the context)."""
    port = _server(ws)
    _refused(_post(port, "/v1/completions", {"model": "m", "prompt": [[10**9]]}), 400, param="prompt")
    _refused(_post(port, "/v1/completions", {"model": "m", "prompt": [[-1, 2]]}), 400, param="prompt")
    _refused(_post(port, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x"}] * 5000}), 400,
             param="messages")
    _refused(_post(port, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * (3 << 20)}]}), 400,
             param="messages", within_s=5)
    _still_serves(port)


@probe("template-text-is-data")
def template_text_is_data(ws: Path) -> None:
    """Message text that looks like Jinja (`{{ ... }}`, `{% for %}` over a billion items) is rendered as text by the
    chat template, never run: the reply comes at once and the prompt holds the characters as they were sent."""
    port = _server(ws)
    text = "{% for i in range(10**9) %}x{% endfor %}{{ raise_exception('boom') }}"
    status, body, seconds = _post(port, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": text}]})
    assert status == 200 and seconds < 30, f"HTTP {status} in {seconds:.1f} s: {str(body)[:200]}"
    from emapg_cli.models.tiny import build_byte_tokenizer

    assert text in build_byte_tokenizer().decode(body["prompt_token_ids"]), "the message text was not kept as text"
    _still_serves(port)


@probe("client-chat-template-and-deep-tool-arguments")
def client_chat_template(ws: Path) -> None:
    """A client sends its own Jinja as chat_template_kwargs.chat_template (two nested range(100000) loops gave no
    reply in 10 s and the server spun on after the client left; `'x' * 500000000` took 2 GB): 400 naming
    chat_template_kwargs, at once. Tool-call arguments nested 900 deep (an object, or a JSON string of one): 400
    with one line (it was `500 RecursionError`)."""
    port = _server(ws)
    for template in ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "{{ 'x' * 500000000 }}"):
        _refused(_post(port, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"chat_template": template}}), 400,
                 param="chat_template_kwargs", within_s=2)
    deep = "[" * 900 + "]" * 900
    for arguments in (deep, json.loads(deep)):
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": "1", "tool_call_id": "c1"}]
        _refused(_post(port, "/v1/chat/completions", {**CHAT, "messages": messages}), 400, param="messages", needle="deep")
    _still_serves(port)


@probe("listens-on-ipv6-loopback")
def listens_on_ipv6_loopback(ws: Path) -> None:
    """`emapg rollout serve --host ::1 --openai` (a loopback address, as docs/rollout_server.md lists it): it
    listens (it could not: an IPv4 socket), says `http://[::1]:PORT`, and answers GET /v1/models over IPv6."""
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        return  # no IPv6 loopback on this machine: nothing to probe
    _server(ws)  # builds the tiny model
    proc = subprocess.Popen([sys.executable, "-m", "emapg_cli", "rollout", "serve", "--model", str(_CACHE["model"]),
                             "--host", "::1", "--port", "0", "--threads", "1", "--openai"], cwd=ws,
                            env={**base_env(ws), "EMAPG_ROLLOUT_SECRET": SECRET}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line, end = "", time.monotonic() + 120
        while time.monotonic() < end and "ready" not in line and proc.poll() is None:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                line = proc.stdout.readline()
        m = re.search(r"OpenAI API at http://\[::1\]:(\d+)/v1", line)
        assert m, f"`rollout serve --host ::1` did not listen: {line!r} {proc.stderr.read()[-300:] if proc.poll() is not None else ''!r}"
        with socket.create_connection(("::1", int(m.group(1))), timeout=30) as s:
            s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n\r\n".encode())
            status, body = _read_reply(s)
        assert status == 200 and body.get("object") == "list", f"{status} {body!r:.200}"
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()


@probe("unknown-routes-and-methods")
def unknown_routes(ws: Path) -> None:
    """Routes OpenAI has and this server does not (embeddings, responses): JSON 404; a path with a query is the route;
    a DELETE is refused with a JSON body."""
    port = _server(ws)
    _refused(_post(port, "/v1/embeddings", {"model": "m", "input": "x"}), 404)
    _refused(_post(port, "/v1/responses", {"model": "m", "input": "x"}), 404)
    status, body, _ = _request(port, f"GET /v1/models?limit=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n")
    assert status == 200, f"GET /v1/models?limit=1: {status}"
    status, body, _ = _request(port, f"DELETE /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n")  # http.server's own refusal, as JSON
    assert status in (405, 501) and isinstance(body, dict) and "error" in body, f"DELETE answered {status}: {body!r:.200}"
    _still_serves(port)


@probe("secret-required")
def secret_required(ws: Path) -> None:
    """A server started with a secret answers its OpenAI routes only to the secret as the API key: none, another key,
    or the secret without `Bearer` are 401s with OpenAI's authentication_error (GET and POST); the real `openai`
    client with api_key = the secret is answered."""
    import openai

    port = _server(ws)
    for auth in ({"Authorization": None}, {"Authorization": "Bearer sk-not-the-secret"}, {"Authorization": SECRET}):
        _refused(_post(port, "/v1/chat/completions", CHAT, headers=auth), 401, needle="EMAPG_ROLLOUT_SECRET")
    status, body, _ = _request(port, "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-x\r\n")
    assert status == 401 and body["error"]["type"] == "authentication_error", f"{status} {body!r:.200}"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=SECRET, max_retries=0, timeout=30)
    assert client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=2).choices
    _still_serves(port)


@probe("requests-dripped-and-connections-held")
def requests_dripped(ws: Path) -> None:
    """A client dripping its request one byte every 0.3 s is dropped at --timeout (2 s), not when it stops; 8 idle
    connections take every slot (--max-connections 8): the 9th gets a 503 at once (from the accept loop, without a
    thread: OpenAI's error body `{"error": {"message": "busy: ...", "type", "code"}}` on /v1/..., which an `openai`
    client raises as APIStatusError 503; it was the server's own `{"error": "busy: ..."}`), and once they are dropped
    at their 2 s the server answers again."""
    port = _server(ws)
    with _connect(port, 10) as s:
        t0, closed = time.monotonic(), None
        for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Drip: " + b"a" * 40:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed = time.monotonic() - t0
                break
            if select.select([s], [], [], 0.3)[0] and s.recv(1) == b"":
                closed = time.monotonic() - t0
                break
        assert closed is not None and closed < 5, f"the dripping client was not dropped at 2 s ({closed})"
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
    try:
        time.sleep(0.3)
        status, body, seconds = _request(port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n")
        _refused((status, body, seconds), 503, needle="busy", within_s=2)
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    _still_serves(port)


@probe("client-leaves-a-long-generation")
def client_leaves(ws: Path) -> None:
    """Ten clients each ask for 64 new tokens of 16 sequences and leave at once: their generations are cancelled at
    the next decode step (nobody waits for them), so a request sent after them is answered within seconds, not after
    all ten have been sampled."""
    port = _server(ws)
    body = json.dumps({"model": "m", "prompt": [[5, 6]] * 4, "n": 4, "max_tokens": 64}).encode()
    for _ in range(10):
        with _connect(port, 10) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    t0 = time.monotonic()
    # right after the ten sends their handlers may still hold the server's 8 connection slots (a handler learns that
    # its client left at its next step): 503 "busy ... retry later", which the openai client retries by itself; the
    # probe retries the same way, and the answer must still come within the 20 s
    while True:
        status, reply, _ = _post(port, "/v1/completions", {"model": "m", "prompt": [[5]], "max_tokens": 1})
        if status != 503 or time.monotonic() - t0 > 20:
            break
        time.sleep(0.25)
    assert status == 200, f"HTTP {status}: {str(reply)[:200]}"
    assert time.monotonic() - t0 < 20, f"answered after {time.monotonic() - t0:.1f} s"
    _still_serves(port)


@probe("agent-endpoint-foreign-key")
def agent_endpoint_foreign_key(ws: Path) -> None:
    """Another local process found the trainer's agent endpoint and calls it without an episode's key, or with a key
    it guessed: 401 (OpenAI's authentication error), nothing sampled."""
    from emapg_cli.agents.agent import AgentRunner, AgentSettings
    from emapg_cli.models.tiny import build_byte_tokenizer

    (ws / "agent.py").write_text("def agent(client, example):\n    return 1.0\n")
    runner = AgentRunner(build_byte_tokenizer(), AgentSettings(ref=f"{ws / 'agent.py'}:agent"), 256)
    try:
        port = int(runner._endpoint().rsplit(":", 1)[1].split("/")[0])
        _refused(_post(port, "/v1/chat/completions", CHAT, headers={"Authorization": None}), 401)
        _refused(_post(port, "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer emapg-episode-guess"}), 401)
        _refused(_post(port, "/v1/completions", {"model": "m", "prompt": "x"}, headers={"Authorization": "Basic eDp5"}), 401)
    finally:
        runner.close()
