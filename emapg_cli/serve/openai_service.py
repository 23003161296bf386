"""The policy behind OpenAI's wire format, without its HTTP: render, tokenize, check, sample through a backend, reply.

`OpenAIService` answers the three routes of serve/openai_wire.py for one tokenizer and one `Backend`:

* the rollout server's (`emapg rollout serve --openai`, `RolloutBackend` below): any caller, every request sampled on
  its own under the server's generation lock, a request's `seed` honoured (none: a fresh random one);
* the trainer's agent endpoint (agents/agent.py): each caller is one episode (its API key), whose sampling settings,
  caps and seeds are the run's, and whose calls are recorded for training.

A chat request is rendered with the model's own chat template (`tokenizer.apply_chat_template`, with the request's
`tools`, `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`) and tokenized without added
special tokens (the template writes them), as the trainer renders its prompts (models/prompts.py); a completion's
string prompt is tokenized with them (vLLM's rule), a token-id prompt is taken as it is. A backend may tokenize a
session's text itself (`Backend.tokenize`: the agent endpoint reuses an episode's earlier ids, docs/agents.md).

What a request may make the engine sample is checked by serve/request_limits.py, as every route of the rollout
server that generates is (the server's `--max-new-tokens`, `--max-sequences`, `--max-request-tokens`: 413 above),
after the per-caller checks of `Policy` (the context's room, the per-call cap: 400). A request's `Caller` carries its
arrival, from which its deadline counts, and whether its client has left, which stops its generation.

`top_logprobs` needs the model's full distribution at each sampled position, which the `Engine` interface does not
return: it is computed by a `scorer` (`module_scorer`, one forward pass of the served module over prompt +
completion, softmax(logits / T), T = 1 when greedy as the engines record it); a backend without one refuses it.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Protocol, Sequence

from emapg_cli.engines.base import Completion, SamplingParams
from emapg_cli.serve.openai_wire import (Choice, OpenAIError, Request, WireLimits, chat_reply, completion_reply,
                                           models_reply, own_turns, parse_chat, parse_completion, remember_turns)
from emapg_cli.serve.request_limits import RequestLimits, check_generation


@dataclass(frozen=True)
class Caller:
    """Who sent a request and when: its API key (None: none), its arrival (time.monotonic(); its deadline counts from
    here) and `left()`, whether its client has closed the connection (its generation is then cancelled)."""

    api_key: Optional[str] = None
    arrival: float = field(default_factory=time.monotonic)
    left: Callable[[], bool] = lambda: False


@dataclass(frozen=True)
class Policy:
    """What one caller's requests get: defaults for what they leave out, and what they may not change.

    `fixed`: temperature and top_p are the run's (training samples the distribution the trainer's passes assume): a
    request may leave them out or repeat them, another value is refused. `max_tokens`: the per-call cap (None: the
    context's room); `max_context`: prompt + completion; `stop`: added to every request's stop strings."""

    temperature: float = 1.0
    top_p: float = 1.0
    fixed: bool = False
    max_tokens: Optional[int] = None
    max_context: int = 4096
    stop: tuple[str, ...] = ()


class Backend(Protocol):
    """Where an `OpenAIService` samples: sessions (callers), their policy, tokenization and generation."""

    def session(self, api_key: Optional[str]) -> Any:
        """The caller's session for its API key (None: a backend without sessions); `OpenAIError` (401) refuses it."""

    def policy(self, session: Any) -> Policy:
        ...

    def memory(self, session: Any) -> Optional[dict]:
        """Where the service keeps a session's own tool-calling turns (`openai_wire.own_turns`); None: it does not."""

    def tokenize(self, session: Any, text: str, special: bool) -> list[int]:
        """`text`'s token ids (`special`: add the tokenizer's BOS/EOS as a plain `tokenizer(text)` does)."""

    def generate(self, session: Any, prompts: list[list[int]], params: SamplingParams, seed: Optional[int],
                 texts: Sequence[Optional[str]], caller: Caller) -> tuple[list[list[Completion]], Optional[int]]:
        """(`params.n` completions per prompt, the weights version that sampled them); `seed` is the request's
        (None: not given), `texts` each prompt's text as the caller sent or the template rendered it (None: ids).
        Within the backend's deadline from `caller.arrival`, cancelled once `caller.left()` (`Refused` 504 / 499)."""


class OpenAIService:
    """The routes of serve/openai_wire.py over `backend` (see the module's docstring)."""

    def __init__(self, tokenizer, model_id: str, backend: Backend, limits: WireLimits = WireLimits(),
                 scorer: Optional[Callable] = None, request_limits: RequestLimits = RequestLimits()):
        from emapg_cli.models.prompts import max_chars_per_token

        self.tokenizer, self.model_id, self.backend, self.limits, self.scorer = tokenizer, model_id, backend, limits, scorer
        self.request_limits = request_limits
        self.created = int(time.time())
        self.chars_per_token = max_chars_per_token(tokenizer)
        self.vocab = len(tokenizer)

    def models(self) -> dict[str, Any]:
        return models_reply(self.model_id, self.created)

    # ------------------------------------------------------------------ routes
    def chat(self, body: Any, caller: Caller) -> dict[str, Any]:
        session = self.backend.session(caller.api_key)  # a caller the backend refuses learns nothing else
        req = parse_chat(body, self.limits)
        policy = self.backend.policy(session)
        memory = self.backend.memory(session)
        if memory:  # its own tool-calling turns, rendered as the model wrote them
            req.messages = own_turns(req.messages, memory)
        text = self._render(req, policy)
        ids = self.backend.tokenize(session, text, False)
        choices, version = self._sample(req, session, policy, [ids], [text], caller)
        reply = chat_reply(req, self.model_id, ids, choices, version)
        if memory is not None:
            remember_turns(memory, reply, [c.text for c in choices])
        return reply

    def completions(self, body: Any, caller: Caller) -> dict[str, Any]:
        session = self.backend.session(caller.api_key)
        req = parse_completion(body, self.limits)
        policy = self.backend.policy(session)
        prompts, texts = [], []
        for p in req.prompts:
            if isinstance(p, str):
                self._fits_chars(p, policy)
                prompts.append(self.backend.tokenize(session, p, True))
                texts.append(p)
            else:
                if any(t >= self.vocab for t in p):
                    raise OpenAIError(400, f"prompt holds token ids outside the vocabulary [0, {self.vocab})", param="prompt")
                prompts.append(list(p))
                texts.append(None)
        choices, version = self._sample(req, session, policy, prompts, texts, caller)
        return completion_reply(req, self.model_id, choices, version)

    # ------------------------------------------------------------------ pieces
    def _fits_chars(self, text: str, policy: Policy) -> None:
        """A text too long to fit the context in any tokenization is refused before it is tokenized."""
        if len(text) > policy.max_context * self.chars_per_token:
            raise OpenAIError(400, f"the prompt has {len(text)} characters: more than the {policy.max_context}-token "
                                   "context can hold", param="messages", code="context_length_exceeded")

    def _render(self, req: Request, policy: Policy) -> str:
        """The chat prompt's text through the model's chat template; a template error is a 400."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, "the model's tokenizer has no chat template: use /v1/completions", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tokenize=False, **req.template_kwargs)
        except Exception as e:  # jinja's TemplateError, transformers' ValueError: the template refused these messages
            msg = " ".join(str(e).split())[:200] or type(e).__name__
            raise OpenAIError(400, f"the chat template cannot render these messages: {msg}", param="messages") from None
        if not isinstance(text, str):
            raise OpenAIError(400, "the chat template did not render a string", param="messages")
        self._fits_chars(text, policy)
        return text

    def _params(self, req: Request, policy: Policy, prompts: list[list[int]]) -> SamplingParams:
        """The request's sampling within `policy` (400 on what it may not ask) and the request limits (400/413)."""
        for key, asked, own in (("temperature", req.temperature, policy.temperature), ("top_p", req.top_p, policy.top_p)):
            if policy.fixed and asked is not None and asked != own:
                raise OpenAIError(400, f"{key} {asked:g}: this endpoint samples the policy at {key} {own:g} (the run's); "
                                       "leave it out", param=key)
        longest = max(len(p) for p in prompts)
        room = policy.max_context - longest
        if room < 1:
            raise OpenAIError(400, f"This model's maximum context length is {policy.max_context} tokens. However, your "
                                   f"prompt has {longest} tokens.", param="messages", code="context_length_exceeded")
        cap = policy.max_tokens
        if req.max_tokens is not None:
            if cap is not None and req.max_tokens > cap:
                raise OpenAIError(400, f"max_tokens {req.max_tokens} is more than this endpoint's {cap} per call",
                                  param="max_tokens")
            if req.max_tokens > room:
                raise OpenAIError(400, f"This model's maximum context length is {policy.max_context} tokens. However, you "
                                       f"requested {longest + req.max_tokens} tokens ({longest} in the prompt, "
                                       f"{req.max_tokens} in the completion).", param="max_tokens", code="context_length_exceeded")
            max_tokens = req.max_tokens
        else:  # as much as fits: the context's room, the per-call cap and the request limits (what they leave per prompt)
            limits = self.request_limits
            share = (limits.max_request_tokens // req.n - sum(map(len, prompts))) // len(prompts)
            max_tokens = max(1, min(room, cap or room, limits.max_new_tokens, share))
        temperature = policy.temperature if req.temperature is None else req.temperature
        top_p = policy.top_p if req.top_p is None else req.top_p
        stop = tuple(dict.fromkeys((*req.stop, *policy.stop)))
        params = SamplingParams(n=req.n, max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop)
        check_generation(prompts, params, self.request_limits)  # `Refused` 400/413, as the rollout server's /generate
        return params

    def _sample(self, req: Request, session: Any, policy: Policy, prompts: list[list[int]],
                texts: list[Optional[str]], caller: Caller) -> tuple[list[Choice], Optional[int]]:
        params = self._params(req, policy, prompts)
        if req.top_logprobs and self.scorer is None:
            raise OpenAIError(400, "top_logprobs is not available from this engine (the hf engine computes them)",
                              param="top_logprobs")
        rows, version = self.backend.generate(session, prompts, params, req.seed, texts, caller)
        choices = []
        for prompt, row in zip(prompts, rows):
            tops = self.scorer(prompt, [c.token_ids for c in row], params.temperature, req.top_logprobs) \
                if req.top_logprobs else [None] * len(row)
            for c, top in zip(row, tops):
                choices.append(self._choice(req, prompt, c, top))
        return choices, version

    def _choice(self, req: Request, prompt: list[int], c: Completion, top: Optional[list]) -> Choice:
        dec = self.tokenizer.decode
        text = dec(c.token_ids, skip_special_tokens=True) if req.include_stop_str else c.text
        tokens = [dec([t]) for t in c.token_ids] if req.logprobs else []
        top_text = [[(dec([t]), lp) for t, lp in row] for row in top] if top is not None else None
        return Choice(token_ids=list(c.token_ids), text=text, finish_reason=c.finish_reason, logprobs=c.logprobs,
                      tokens=tokens, top=top_text, prompt_ids=prompt)


def module_scorer(module: Any, context: Optional[Callable[[Any], Any]] = None) -> Callable:
    """top_logprobs of `module` (a transformers causal LM): for one prompt and its completions, per completion a list
    per token of its k most likely (token id, log-prob) under softmax(logits / T) (T = 1 when greedy, as the engines
    record log-probs). One forward pass per completion, no gradient; `context(module)` is entered around it."""
    import contextlib

    import torch

    def score(prompt: list[int], completions: list[list[int]], temperature: float, k: int) -> list[list[list[tuple[int, float]]]]:
        out = []
        device = next(module.parameters()).device
        with (context(module) if context else contextlib.nullcontext()), torch.inference_mode():
            for ids in completions:
                if not ids:
                    out.append([])
                    continue
                full = torch.tensor([prompt + ids], dtype=torch.long, device=device)  # [1, P + C]
                logits = module(input_ids=full).logits[0, len(prompt) - 1:-1].float()  # [C, V]
                logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)  # [C, V]
                values, index = logp.topk(min(k, logp.shape[-1]), -1)  # [C, k]
                out.append([list(zip(i.tolist(), v.tolist())) for i, v in zip(index, values)])
        return out

    return score


class RolloutBackend:
    """`emapg rollout serve --openai`: every request sampled on its own by the server's engine (under its lock, from
    the weights it holds now), any API key accepted (the server's secret, when it has one, is checked before), sampling
    as the request asks (OpenAI's defaults otherwise); each request within `timeout_s` of its arrival, waiting for the
    lock included, and cancelled once its client left (the decode loop's `cancelled` hook)."""

    def __init__(self, service: Any, tokenizer, max_context: int, timeout_s: float = 600.0):
        self.service, self.tokenizer, self.timeout_s = service, tokenizer, timeout_s
        self._policy = Policy(max_context=max_context)

    def session(self, api_key: Optional[str]) -> None:
        return None

    def policy(self, session: Any) -> Policy:
        return self._policy

    def memory(self, session: Any) -> None:
        return None

    def tokenize(self, session: Any, text: str, special: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special)["input_ids"]

    def generate(self, session, prompts, params, seed, texts, caller):
        params = replace(params, seed=secrets.randbits(62) if seed is None else seed % (1 << 63))
        rows, version, _ = self.service.generate(prompts, params, None, self.timeout_s, caller.arrival,
                                                 cancelled=caller.left, anyone=True)
        return rows, version


def rollout_openai(service: Any, model_path: str, max_model_len: Optional[int] = None, trust_remote_code: bool = False,
                   request_limits: RequestLimits = RequestLimits(), timeout_s: float = 600.0) -> OpenAIService:
    """The `OpenAIService` of `emapg rollout serve --openai` over a `RolloutService`: the served model's tokenizer
    and chat template, its context (`--max-model-len`, else the config's `max_position_embeddings`), the server's
    request limits, each request's `timeout_s` from its arrival, and top_logprobs from the hf engine's module (scored
    under the server's generation lock)."""
    import contextlib

    from transformers import AutoConfig

    from emapg_cli.models.loading import load_tokenizer, model_ref

    tokenizer = load_tokenizer(model_path, trust_remote_code)
    config = AutoConfig.from_pretrained(model_ref(model_path), trust_remote_code=trust_remote_code)
    context = max_model_len or int(getattr(config, "max_position_embeddings", None) or 4096)

    @contextlib.contextmanager
    def locked(module):
        with service.cond:  # no weights are applied while a scoring pass runs
            yield

    module = service.served.module
    return OpenAIService(tokenizer, model_path, RolloutBackend(service, tokenizer, context, timeout_s),
                         scorer=module_scorer(module, locked) if module is not None else None, request_limits=request_limits)
