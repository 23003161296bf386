"""OpenAI's wire format for the policy (issue 36): `emapg rollout serve --openai` and the trainer's agent endpoint
against hostile clients.

One real `emapg rollout serve --openai` on a tiny model (built locally) serves every probe of this module, on
127.0.0.1 port 0; each probe talks to it with raw sockets or the real `openai` client and ends by checking that it
still answers. Every refusal must be OpenAI's error body (`{"error": {"message", "type", ...}}`) with a 4xx status,
quickly, without a traceback; every count and wait is bounded.
"""

from __future__ import annotations

import atexit
import json
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from . import probe
from .common import base_env
from .server import _connect, _read_reply

_CACHE: dict[str, object] = {}


def _server(ws: Path) -> int:
    """The port of the module's one `emapg rollout serve --openai` (started on first use, killed at exit)."""
    if "port" not in _CACHE:
        from emapg_cli.models.tiny import save_tiny

        root = Path(tempfile.mkdtemp(prefix="emapg-openai-probes-"))
        atexit.register(shutil.rmtree, root, True)
        model = save_tiny(root / "model", arch="qwen2")
        proc = subprocess.Popen([sys.executable, "-m", "emapg_cli", "rollout", "serve", "--model", str(model), "--port", "0",
                                 "--threads", "1", "--openai"], cwd=root, env=base_env(ws), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        atexit.register(proc.kill)
        line, end = "", time.monotonic() + 120
        while time.monotonic() < end and "ready" not in line:
            if proc.poll() is not None:
                raise AssertionError(f"`rollout serve --openai` exited {proc.returncode}: {proc.stderr.read()[-300:]!r}")
            if select.select([proc.stdout], [], [], 0.5)[0]:
                line = proc.stdout.readline()
        m = re.search(r"OpenAI API at http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, f"the server did not say where its OpenAI API is: {line!r}"
        _CACHE["port"], _CACHE["proc"] = int(m.group(1)), proc
    proc = _CACHE["proc"]
    assert proc.poll() is None, f"the server exited ({proc.returncode})"  # type: ignore[union-attr]
    return int(_CACHE["port"])  # type: ignore[arg-type]


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
    h = {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items() if v is not None)
    return _request(port, head, body)


def _refused(reply, *codes: int, param: Optional[str] = None, within_s: float = 10.0) -> None:
    status, body, seconds = reply
    assert status in codes, f"expected HTTP {'/'.join(map(str, codes))}, got {status}: {str(body)[:200]}"
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str), \
        f"refusal without OpenAI's error body: {body!r:.200}"
    assert "Traceback" not in err["message"] and "\n" not in err["message"], f"not one line: {err['message']!r:.200}"
    if param is not None:
        assert err.get("param") == param, f"param {err.get('param')!r}, expected {param!r}: {err['message']!r:.200}"
    assert seconds < within_s, f"the refusal took {seconds:.1f} s"


def _still_serves(port: int) -> None:
    status, body, _ = _request(port, "GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    assert status == 200 and body.get("object") == "list", f"/v1/models no longer answers: {status} {body!r:.200}"


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@probe("body-declared-huge")
def body_declared_huge(ws: Path) -> None:
    """A client declared a 1 TB body: 413 at once, nothing read, the server keeps serving."""
    port = _server(ws)
    _refused(_post(port, "/v1/chat/completions", raw=b"{}", headers={"Content-Length": str(10**12)}), 413)
    _still_serves(port)


@probe("body-without-length")
def body_without_length(ws: Path) -> None:
    """A chunked body (no Content-Length): 411, OpenAI's error body."""
    port = _server(ws)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
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
    """n of a billion, max_tokens past the context, prompts x n x max_tokens past the budget, top_logprobs 10^6,
    streaming, penalties: each refused with the field named, before anything is sampled."""
    port = _server(ws)
    for extra, param, code in (({"n": 10**9}, "n", 400), ({"max_tokens": 10**9}, "max_tokens", 400),
                               ({"logprobs": True, "top_logprobs": 10**6}, "top_logprobs", 400),
                               ({"stream": True}, "stream", 400), ({"frequency_penalty": 2}, "frequency_penalty", 400),
                               ({"logit_bias": {"5": 100}}, "logit_bias", 400), ({"tool_choice": "required"}, "tool_choice", 400)):
        _refused(_post(port, "/v1/chat/completions", {**CHAT, **extra}), code, param=param)
    many = {"model": "m", "prompt": [[5, 6]] * 64, "n": 16, "max_tokens": 100}  # 102,400 tokens to sample
    _refused(_post(port, "/v1/completions", many), 413, param="max_tokens")
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


@probe("unknown-routes-and-methods")
def unknown_routes(ws: Path) -> None:
    """Routes OpenAI has and this server does not (embeddings, responses): JSON 404; a path with a query is the route;
    a DELETE is refused with a JSON body."""
    port = _server(ws)
    _refused(_post(port, "/v1/embeddings", {"model": "m", "input": "x"}), 404)
    _refused(_post(port, "/v1/responses", {"model": "m", "input": "x"}), 404)
    status, body, _ = _request(port, "GET /v1/models?limit=1 HTTP/1.1\r\nHost: x\r\n")
    assert status == 200, f"GET /v1/models?limit=1: {status}"
    status, body, _ = _request(port, "DELETE /v1/models HTTP/1.1\r\nHost: x\r\n")  # http.server's own refusal, as JSON
    assert status in (405, 501) and isinstance(body, dict) and "error" in body, f"DELETE answered {status}: {body!r:.200}"
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
        _refused(_post(port, "/v1/chat/completions", CHAT), 401)
        _refused(_post(port, "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer emapg-episode-guess"}), 401)
        _refused(_post(port, "/v1/completions", {"model": "m", "prompt": "x"}, headers={"Authorization": "Basic eDp5"}), 401)
    finally:
        runner.close()
