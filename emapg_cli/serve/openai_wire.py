"""OpenAI's wire format for the policy (docs/agents.md): requests checked field by field, replies built. Pure: no I/O.

`emapg rollout serve --openai` and the trainer's in-process agent endpoint answer

  GET  /v1/models            -> {"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]}
  POST /v1/chat/completions  {"model", "messages", "n", "max_tokens" | "max_completion_tokens", "temperature", "top_p",
                              "seed", "stop", "logprobs", "top_logprobs", "tools", "tool_choice", ...}
  POST /v1/completions       {"model", "prompt": str | [str] | [int] | [[int]], "n", "max_tokens", "temperature",
                              "top_p", "seed", "stop", "logprobs": int, ...}

as OpenAI's API does, plus vLLM's extensions: each reply carries `prompt_token_ids` (chat; per choice for
completions) and per choice `token_ids`, and `weights_version` (the policy version that sampled it). vLLM's request
extensions `add_generation_prompt`, `continue_final_message`, `include_stop_str_in_output`, `chat_template_kwargs`
and `return_token_ids` are accepted. A request that asks for what this policy cannot do faithfully (streaming,
penalties, logit biases, a response format, echo, suffix, best_of > n, tool_choice other than auto/none) is refused
with OpenAI's error body `{"error": {"message", "type", "param", "code"}}` and a 4xx status (`OpenAIError`); so is an
unknown key. Harmless keys (`user`, `store`, `metadata`, `service_tier`, `parallel_tool_calls`, `stream: false`)
are accepted and ignored.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Optional, Sequence

#: Roles a chat message may have (OpenAI's; `developer` is rendered as the template renders it).
ROLES = ("system", "developer", "user", "assistant", "tool")
#: Keys accepted and ignored (they change nothing about sampling).
IGNORED = ("user", "store", "metadata", "service_tier", "parallel_tool_calls", "return_token_ids", "stream_options")
#: Keys of both endpoints that change sampling or the reply.
COMMON = ("model", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "stream", "frequency_penalty",
          "presence_penalty", "logit_bias", "include_stop_str_in_output", *IGNORED)
CHAT_KEYS = frozenset((*COMMON, "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
                       "add_generation_prompt", "continue_final_message", "chat_template_kwargs"))
COMPLETION_KEYS = frozenset((*COMMON, "prompt", "echo", "suffix", "best_of"))
#: OpenAI's caps: stop strings per request, top log-probs per token (chat; completions: 5).
MAX_STOP, MAX_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 4, 20, 5
#: The deepest nesting of lists and objects in a chat request's messages and tools (tool-call arguments decoded).
MAX_DEPTH = 64
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class OpenAIError(Exception):
    """A refused request: HTTP `status` with OpenAI's error body (`error_body`)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code


def error_body(e: OpenAIError) -> dict[str, Any]:
    return {"error": {"message": str(e), "type": e.type, "param": e.param, "code": e.code}}


#: OpenAI's error type of an HTTP status (any other 4xx: invalid_request_error; 5xx: server_error).
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 409: "conflict_error",
               429: "rate_limit_error"}


def error_json(code: int, message: str) -> dict[str, Any]:
    """OpenAI's error body of a refusal that only has a status and a line (the HTTP server's own: a body too large,
    a missing secret, a busy server, a deadline passed)."""
    default = "server_error" if code >= 499 else "invalid_request_error"
    return error_body(OpenAIError(code, message, ERROR_TYPES.get(code, default)))


@dataclass(frozen=True)
class WireLimits:
    """What one request may ask in OpenAI's format (the sampling it asks is bounded by serve/request_limits.py; the
    server adds size, connections and deadlines)."""

    max_n: int = 16  # choices per request
    max_prompts: int = 64  # /v1/completions: prompts per request
    max_messages: int = 1024  # chat: messages per request
    max_chars: int = 4 << 20  # characters of all messages / prompts together (the tokenizer's work)


@dataclass
class Request:
    """A checked request of either endpoint; None: the field was not given (the endpoint's default applies)."""

    kind: str  # "chat" | "completion"
    model: str
    n: int = 1
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    include_stop_str: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat: as the chat template reads them
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: str = "auto"
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompts: list[Any] = field(default_factory=list)  # completions: each a str or a list of token ids


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def _int(body: dict, key: str, lo: int, hi: int) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"{key} must be an integer from {lo} to {hi}, got {json.dumps(v)[:40]}", key)
    return v


def _float(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi or (lo_open and v == lo):
        side = "(" if lo_open else "["
        raise _bad(f"{key} must be a number in {side}{lo:g}, {hi:g}], got {json.dumps(v)[:40]}", key)
    return float(v)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{key} must be true or false, got {json.dumps(v)[:40]}", key)
    return v


def _refuse_unfaithful(body: dict) -> None:
    """Parameters that would sample from another distribution than the policy's, or a reply this server does not send."""
    if body.get("stream"):
        raise _bad("stream is not supported: send the request with stream false (or omit it)", "stream")
    for key in ("frequency_penalty", "presence_penalty"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != 0):
            raise _bad(f"{key} must be 0 or omitted: the policy is sampled as it is", key)
    if body.get("logit_bias") not in (None, {}):
        raise _bad("logit_bias is not supported: the policy is sampled as it is", "logit_bias")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise _bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    return tuple(stops)


def _common(body: Any, keys: frozenset, kind: str, limits: WireLimits) -> Request:
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    unknown = sorted(set(body) - keys)
    if unknown:
        raise _bad(f"unrecognized request argument supplied: {unknown[0][:40]}", unknown[0][:40])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model must be a non-empty string (GET /v1/models lists the one served)", "model")
    _refuse_unfaithful(body)
    max_tokens = _int(body, "max_tokens", 1, 1 << 30)
    if kind == "chat":
        mct = _int(body, "max_completion_tokens", 1, 1 << 30)
        if mct is not None and max_tokens is not None and mct != max_tokens:
            raise _bad("max_tokens and max_completion_tokens differ: give one of them", "max_completion_tokens")
        max_tokens = mct if mct is not None else max_tokens
    seed = _int(body, "seed", -(1 << 63), (1 << 64) - 1)
    return Request(kind=kind, model=model, n=_int(body, "n", 1, limits.max_n) or 1, max_tokens=max_tokens,
                   temperature=_float(body, "temperature", 0.0, 2.0), top_p=_float(body, "top_p", 0.0, 1.0, lo_open=True),
                   seed=seed, stop=_stop(body), include_stop_str=_bool(body, "include_stop_str_in_output"))


def _text_content(content: Any, where: str) -> Optional[str]:
    """A message's content as one string: a string, None, or a list of text parts (joined); other parts refused."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}.content must be a string, a list of text parts or null", "messages")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls, arguments decoded from their JSON string (what chat templates render)."""
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.tool_calls: each needs a function with a name", "messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            args = _args(args) if args.strip() else {}  # not JSON: rendered as the text it is
        out.append({"id": str(call.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _messages(value: Any, limits: WireLimits) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list", "messages")
    if len(value) > limits.max_messages:
        raise _bad(f"{len(value)} messages: at most {limits.max_messages}", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"{where} needs a role ({', '.join(ROLES)})", "messages")
        msg: dict[str, Any] = {"role": m["role"], "content": _text_content(m.get("content"), where)}
        if m.get("tool_calls") is not None and m["role"] == "assistant":
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        elif msg["content"] is None:
            raise _bad(f"{where}.content is required", "messages")
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _size(obj: Any) -> tuple[int, int]:
    """(characters of the strings in `obj`, its depth of nested lists and dicts), to bound the template's and the
    tokenizer's work before they run; without recursion (a body may nest as deep as the JSON parser allows)."""
    chars, depth, stack = 0, 0, [(obj, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, str):
            chars += len(x)
        elif isinstance(x, (dict, list)):
            depth = max(depth, d + 1)
            stack += [(v, d + 1) for v in ([*x.keys(), *x.values()] if isinstance(x, dict) else x)]
    return chars, depth


def parse_chat(body: Any, limits: WireLimits = WireLimits()) -> Request:
    """A `POST /v1/chat/completions` body as a `Request`; `OpenAIError` (400) naming the first bad field."""
    req = _common(body, CHAT_KEYS, "chat", limits)
    req.messages = _messages(body.get("messages"), limits)
    req.logprobs = _bool(body, "logprobs")
    req.top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if req.top_logprobs and not req.logprobs:
        raise _bad("top_logprobs needs logprobs true", "top_logprobs")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools):
            raise _bad('tools must be a list of {"type": "function", "function": {...}}', "tools")
        req.tools = tools or None
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise _bad("tool_choice must be auto or none: the policy decides itself whether to call a tool", "tool_choice")
    req.tool_choice = choice or "auto"
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _bad('response_format must be {"type": "text"} or omitted: the policy is sampled as it is', "response_format")
    req.add_generation_prompt = _bool(body, "add_generation_prompt", True)
    req.continue_final_message = _bool(body, "continue_final_message")
    if req.continue_final_message and (req.add_generation_prompt or req.messages[-1]["role"] != "assistant"):
        raise _bad("continue_final_message needs add_generation_prompt false and an assistant message last",
                   "continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or not all(
                isinstance(k, str) and (isinstance(v, (str, bool, int)) or (isinstance(v, float) and math.isfinite(v)))
                for k, v in kwargs.items()):
            raise _bad("chat_template_kwargs must map names to strings, numbers or booleans", "chat_template_kwargs")
        if "chat_template" in kwargs:  # its Jinja would run here, unbounded: the model's own template is the contract
            raise _bad("chat_template_kwargs.chat_template: a client's own chat template is refused; requests are "
                       "rendered with the model's", "chat_template_kwargs")
        req.template_kwargs = dict(kwargs)
    (chars, depth), (tool_chars, tool_depth) = _size(req.messages), _size(tools)
    if max(depth, tool_depth) > MAX_DEPTH:
        raise _bad(f"messages or tools nest lists and objects {max(depth, tool_depth)} deep: at most {MAX_DEPTH}",
                   "tools" if tool_depth > MAX_DEPTH else "messages")
    if chars + tool_chars > limits.max_chars:
        raise OpenAIError(413, f"messages and tools of more than {limits.max_chars} characters", param="messages")
    return req


def parse_completion(body: Any, limits: WireLimits = WireLimits()) -> Request:
    """A `POST /v1/completions` body as a `Request`; `OpenAIError` (400) naming the first bad field."""
    req = _common(body, COMPLETION_KEYS, "completion", limits)
    if _bool(body, "echo"):
        raise _bad("echo is not supported", "echo")
    if body.get("suffix") not in (None, ""):
        raise _bad("suffix is not supported", "suffix")
    best_of = _int(body, "best_of", 1, limits.max_n)
    if best_of is not None and best_of != req.n:
        raise _bad("best_of must equal n (or be omitted): every sample is returned", "best_of")
    k = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)  # completions: the number of top log-probs
    req.logprobs, req.top_logprobs = k is not None, k or 0
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _ids(prompt):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise _bad("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids", "prompt")
    if len(prompts) > limits.max_prompts:
        raise _bad(f"{len(prompts)} prompts: at most {limits.max_prompts} per request", "prompt")
    if sum(len(p) for p in prompts) > limits.max_chars:
        raise OpenAIError(413, f"prompts of more than {limits.max_chars} characters (or token ids)", param="prompt")
    req.prompts = prompts
    return req


def _ids(x: Any) -> bool:  # a non-empty list of token ids
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)


def parse_tool_calls(text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
    """(content, tool calls) of a completion in the Hermes format most tool-calling chat templates use (Qwen2.5,
    Hermes, ...): each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` becomes an OpenAI tool call and the
    text outside them the content (None when empty). A block that is not such JSON leaves the whole text as content."""
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except (ValueError, RecursionError):
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    content = _TOOL_CALL.sub("", text).strip()
    return content or None, calls


def _args(value: Any) -> Any:
    """Tool-call arguments compared as data: a JSON string decoded (else kept as it is)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def _calls_key(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], _args(c["function"].get("arguments"))) for c in calls]


def remember_turns(memory: dict, reply: dict[str, Any], raw: Sequence[str]) -> None:
    """After a chat reply: each choice that called tools, by its calls' ids -> (content, calls, the text the model
    wrote), so that `own_turns` can give that text back to the template."""
    for choice, text in zip(reply["choices"], raw):
        calls = choice["message"].get("tool_calls")
        if calls:
            memory[tuple(c["id"] for c in calls)] = (choice["message"]["content"] or "", _calls_key(calls), text)


def own_turns(messages: list[dict[str, Any]], memory: dict) -> list[dict[str, Any]]:
    """`messages` with each assistant turn that this endpoint sampled (its tool calls' ids, content and calls as they
    were returned) given back as the text the model wrote: the template then renders what was sampled, not its own
    JSON of the calls, and the next prompt extends the previous one (docs/agents.md)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        known = memory.get(tuple(c["id"] for c in calls)) if calls else None
        if known is not None and known[0] == (m.get("content") or "") and known[1] == _calls_key(calls):
            m = {"role": "assistant", "content": known[2]}
        out.append(m)
    return out


@dataclass
class Choice:
    """One sampled choice as the endpoint returns it: ids, text, reason, the engine's log-probs, each token's text
    and, when asked, the top log-probs [(token text, log-prob), ...] per token."""

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: Optional[list[float]]
    tokens: list[str]
    top: Optional[list[list[tuple[str, float]]]] = None
    prompt_ids: list[int] = field(default_factory=list)


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def _chat_logprobs(c: Choice) -> Optional[dict[str, Any]]:
    if c.logprobs is None:
        return None
    content = [{**_entry(tok, lp), "top_logprobs": [_entry(t, v) for t, v in c.top[i]] if c.top is not None else []}
               for i, (tok, lp) in enumerate(zip(c.tokens, c.logprobs))]
    return {"content": content, "refusal": None}


def chat_reply(req: Request, model_id: str, prompt_ids: list[int], choices: Sequence[Choice], version: Optional[int]) -> dict[str, Any]:
    """The `chat.completion` object (with vLLM's `prompt_token_ids` and each choice's `token_ids`)."""
    out = []
    for i, c in enumerate(choices):
        content, calls = parse_tool_calls(c.text) if req.tools and req.tool_choice != "none" else (c.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        reason = c.finish_reason
        if calls:
            message["tool_calls"], reason = calls, "tool_calls" if reason == "stop" else reason
        out.append({"index": i, "message": message, "finish_reason": reason,
                    "logprobs": _chat_logprobs(c) if req.logprobs else None, "token_ids": list(c.token_ids)})
    return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": model_id, "choices": out, "usage": _usage(len(prompt_ids), choices), "system_fingerprint": None,
            "prompt_token_ids": list(prompt_ids), "weights_version": version}


def completion_reply(req: Request, model_id: str, choices: Sequence[Choice], version: Optional[int]) -> dict[str, Any]:
    """The `text_completion` object: prompt-major choices (choice i*n + j is sample j of prompt i), each with its
    `prompt_token_ids` and `token_ids`."""
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if req.logprobs and c.logprobs is not None:
            offsets = list(accumulate(map(len, c.tokens), initial=0))[:-1]  # where each token's text starts
            logprobs = {"tokens": list(c.tokens), "token_logprobs": list(c.logprobs), "text_offset": offsets,
                        "top_logprobs": [dict(row) for row in c.top] if c.top is not None else None}
        out.append({"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": logprobs,
                    "prompt_token_ids": list(c.prompt_ids), "token_ids": list(c.token_ids)})
    prompt_tokens = sum(len(c.prompt_ids) for c in choices[::max(req.n, 1)])
    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": model_id, "choices": out, "usage": _usage(prompt_tokens, choices), "system_fingerprint": None,
            "weights_version": version}


def _usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def models_reply(model_id: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "emapg"}]}
