"""Issue 40, item 3: what the OpenAI routes (`rollout serve --openai`, the trainer's agent endpoint) refuse or serve.

A client's own chat template (its Jinja ran in the server, unbounded) and tool-call arguments nested 900 deep (a 500
RecursionError from the size check) are 400s with one line; `--host ::1` listens (IPv6); the accept loop's 503 at
`--max-connections` is OpenAI's error body on the /v1 routes and the server's own `{"error": "..."}` elsewhere."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from emapg_cli.serve.openai_wire import OpenAIError, parse_chat

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _refused(body: dict) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        parse_chat(body)
    assert e.value.status == 400 and "\n" not in str(e.value)
    return e.value


def test_a_clients_own_chat_template_is_refused():
    for template in ("{{ 'x' * 500000000 }}", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"):
        e = _refused({**CHAT, "chat_template_kwargs": {"chat_template": template}})
        assert e.param == "chat_template_kwargs" and "chat template is refused" in str(e)
    # a template variable is still the client's to set
    assert parse_chat({**CHAT, "chat_template_kwargs": {"enable_thinking": False}}).template_kwargs == {"enable_thinking": False}


def _with_arguments(arguments) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "x"}]}


@pytest.mark.parametrize("as_text", [True, False])
def test_tool_call_arguments_nested_900_deep_are_a_400(as_text):
    text = "[" * 900 + "]" * 900
    e = _refused(_with_arguments(text if as_text else json.loads(text)))
    # messages (1) > a message (2) > its tool_calls (3) > a call (4) > its function (5) > 900 nested lists: 905
    assert e.param == "messages" and "905 deep: at most 64" in str(e)  # openai_wire.MAX_DEPTH
    # 59 nested lists: 5 + 59 = 64, the most a request may nest
    req = parse_chat(_with_arguments("[" * 59 + "]" * 59))
    assert req.messages[0]["tool_calls"][0]["function"]["arguments"] == json.loads("[" * 59 + "]" * 59)
    _refused(_with_arguments("[" * 60 + "]" * 60))  # 65


def _get(family: int, address: tuple, path: str) -> tuple[int, dict]:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(address)
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


class _Models:
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}


def test_the_openai_endpoint_listens_on_ipv6_loopback():
    from emapg_cli.serve.openai_http import start_server

    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server, url = start_server(_Models(), "::1", 0)
    try:
        port = server.server_address[1]
        assert url == f"http://[::1]:{port}/v1"  # an IPv6 address in a URL is bracketed
        status, body = _get(socket.AF_INET6, ("::1", port), "/v1/models")
        assert status == 200 and body["data"][0]["id"] == "m"
    finally:
        server.shutdown()
        server.server_close()


def test_the_busy_503_is_openais_error_body_on_the_v1_routes():
    """--max-connections 1, one connection held: the accept loop answers the next ones 503 before any handler reads
    them; on /v1/... with OpenAI's error body (what an OpenAI client parses), elsewhere with the server's own."""
    from emapg_cli.serve.rollout_server import RolloutServer, ServerLimits

    server = RolloutServer(("127.0.0.1", 0), None, ServerLimits(max_connections=1, timeout_s=10), openai=object())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    held = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        time.sleep(0.3)  # the held connection has its slot (a handler waits for its request)
        status, body = _get(socket.AF_INET, ("127.0.0.1", port), "/v1/models")
        assert status == 503 and set(body["error"]) >= {"message", "type", "code"}, body
        assert body["error"]["message"].startswith("busy: 1 connections") and body["error"]["type"] == "server_error"
        status, body = _get(socket.AF_INET, ("127.0.0.1", port), "/health")
        assert status == 503 and body["error"].startswith("busy: 1 connections"), body
    finally:
        held.close()
        server.shutdown()
        server.server_close()
