"""Agents on an OpenAI client (docs/agents.md): the wire format, the real `openai` client against the rollout server's
/v1 routes, an agent episode's hand-built trajectory token for token, the bad-agent cases, the endpoint's refusals,
the lockstep rounds' reproducibility, and `emapg train` / `emapg eval --agent` end to end on the tiny model."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from emapg_cli.engines.base import Completion, EngineBase, SamplingParams
from emapg_cli.serve.openai_wire import OpenAIError, parse_chat, parse_completion, parse_tool_calls
from emapg_cli.errors import UserError

openai = pytest.importorskip("openai")  # the dev extra installs it

QUESTION = {"id": "q1", "question": "2+3", "answers": ["5"], "source": "t", "meta": {}}


# ---------------------------------------------------------------------------------------------- the wire format
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"), ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"logit_bias": {"1": 3}}, "logit_bias"),
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": True}, "n"), ({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop"), ({"bogus": 1}, "bogus"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"continue_final_message": True}, "continue_final_message"), ({"model": ""}, "model"),
])
def test_chat_requests_refused_with_the_field_named(extra, param):
    with pytest.raises(OpenAIError) as e:
        parse_chat({**CHAT, **extra})
    assert e.value.status == 400 and e.value.param == param and "\n" not in str(e.value)


def test_chat_and_completion_requests_read():
    req = parse_chat({**CHAT, "n": 2, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3, "stop": "x", "seed": -5,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                   {"role": "assistant", "content": None, "tool_calls": [
                                       {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                                   {"role": "tool", "content": "2", "tool_call_id": "c1"}],
                      "user": "u", "stream": False, "parallel_tool_calls": True})
    assert (req.n, req.max_tokens, req.top_logprobs, req.stop, req.seed) == (2, 7, 3, ("x",), -5)
    assert req.messages[0]["content"] == "ab" and req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    req = parse_completion({"model": "m", "prompt": [[1, 2], [3]], "logprobs": 2, "best_of": 1})
    assert req.prompts == [[1, 2], [3]] and req.logprobs and req.top_logprobs == 2
    for bad in ({"prompt": []}, {"prompt": [[-1]]}, {"prompt": "a", "echo": True}, {"prompt": "a", "suffix": "z"},
                {"prompt": "a", "best_of": 2}, {"prompt": "a", "logprobs": 6}):
        with pytest.raises(OpenAIError):
            parse_completion({"model": "m", **bad})


def test_tool_calls_parsed_from_hermes_blocks():
    content, calls = parse_tool_calls('Let me add.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert content == "Let me add." and calls[0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("plain") == ("plain", [])


# ---------------------------------------------------------------------------------------------- rollout serve --openai
@pytest.fixture(scope="module")
def rollouts(tiny_qwen2):
    """The `RolloutService` of the tiny model (one per module: the servers of these tests share it)."""
    from emapg_cli.serve.rollout_service import RolloutService, load_served

    return RolloutService(load_served("hf", str(tiny_qwen2)))


@contextlib.contextmanager
def serving(rollouts, tiny_qwen2, limits=None, secret=None, **api):
    """`emapg rollout serve --openai` in a thread of this process: its OpenAI base url. `limits`: the server's
    (`ServerLimits`), `api`: rollout_openai's keywords (request_limits, timeout_s)."""
    from emapg_cli.serve.openai_service import rollout_openai
    from emapg_cli.serve.rollout_server import ServerLimits, make_server

    server = make_server(rollouts, "127.0.0.1", 0, limits or ServerLimits(), secret,
                         openai=rollout_openai(rollouts, str(tiny_qwen2), **api))
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def served(rollouts, tiny_qwen2):
    """A rollout server with --openai on the tiny model (loopback, no secret): (base url, its hf module)."""
    with serving(rollouts, tiny_qwen2) as url:
        yield url, rollouts.served.module


def test_real_client_chat_with_logprobs_equal_the_trainers(served, tiny_qwen2, one_torch_thread):
    """models.list; chat with n=2, logprobs, top_logprobs=3: the token ids decode to the content and their log-probs
    are the trainer's own (log softmax of a forward pass over prompt + completion) to 1e-5."""
    from emapg_cli.models.loading import load_tokenizer
    from emapg_cli.models.prompts import render_prompt

    url, module = served
    tok = load_tokenizer(str(tiny_qwen2))
    client = openai.OpenAI(base_url=url, api_key="any", max_retries=0)
    assert [m.id for m in client.models.list()] == [str(tiny_qwen2)]
    r = client.chat.completions.create(model=str(tiny_qwen2), messages=[{"role": "user", "content": "2+3"}], n=2, logprobs=True,
                                       top_logprobs=3, max_tokens=8, seed=11)
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt == render_prompt(tok, "2+3")  # the trainer's own rendering of the question
    assert len(r.choices) == 2 and r.model_extra["weights_version"] == -1
    for c in r.choices:
        ids = c.model_extra["token_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == c.message.content
        with torch.no_grad():
            logits = module(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()  # [C, V]
        own = torch.log_softmax(logits, -1)  # [C, V]: temperature 1
        engine = torch.tensor([e.logprob for e in c.logprobs.content])
        torch.testing.assert_close(engine, own.gather(-1, torch.tensor(ids)[:, None])[:, 0], atol=1e-5, rtol=0)
        for i, e in enumerate(c.logprobs.content):
            top = [t.logprob for t in e.top_logprobs]
            assert len(top) == 3 and top == sorted(top, reverse=True)
            torch.testing.assert_close(torch.tensor(top), own[i].topk(3).values, atol=1e-5, rtol=0)
    again = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "2+3"}], n=2, max_tokens=8, seed=11)
    assert [c.model_extra["token_ids"] for c in again.choices] == [c.model_extra["token_ids"] for c in r.choices]  # seeded


def test_real_client_completions_and_errors(served, one_torch_thread):
    url, _ = served
    client = openai.OpenAI(base_url=url, api_key="any", max_retries=0)
    r = client.completions.create(model="x", prompt=["ab", [5, 6, 7]], n=2, max_tokens=3, logprobs=2, seed=1)
    assert len(r.choices) == 4 and r.choices[3].model_extra["prompt_token_ids"] == [5, 6, 7]
    assert len(r.choices[0].logprobs.token_logprobs) == len(r.choices[0].model_extra["token_ids"])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}], presence_penalty=1)
    assert e.value.body["param"] == "presence_penalty" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}], max_tokens=1020)
    with pytest.raises(openai.NotFoundError):
        client.post("/embeddings", body={}, cast_to=dict)


HI = [{"role": "user", "content": "hi"}]


def test_openai_routes_need_the_servers_secret(rollouts, tiny_qwen2):
    """A server started with a secret (required off loopback) answers its OpenAI routes only to a client whose api_key
    is the secret: another key is a 401 with OpenAI's error body (authentication_error), on GET /v1/models too. On
    loopback without a secret any key is accepted (the `served` tests send "any")."""
    secret = "a-secret-of-24-characters"
    with serving(rollouts, tiny_qwen2, secret=secret) as url:
        for key in ("any", "a-secret-of-24-character"):
            client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as e:
                client.chat.completions.create(model="m", messages=HI, max_tokens=2)
            assert e.value.body["type"] == "authentication_error" and "EMAPG_ROLLOUT_SECRET" in e.value.body["message"]
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        ok = openai.OpenAI(base_url=url, api_key=secret, max_retries=0)
        assert len(ok.chat.completions.create(model="m", messages=HI, max_tokens=2, seed=1).choices) == 1


def test_openai_requests_keep_the_servers_request_limits(rollouts, tiny_qwen2):
    """The server's --max-new-tokens 8, --max-sequences 4 and --max-body-bytes 4096 bound the OpenAI routes as they
    bound /generate: max_tokens 9 and 5 completions of one prompt are 413s, a stop string of 300 characters a 400
    (request_limits' 256), a 5,000-character message a 413 before its body is read; each in OpenAI's error body. A
    request that names no max_tokens gets at most the 8 the server allows."""
    from emapg_cli.serve.request_limits import RequestLimits
    from emapg_cli.serve.rollout_server import ServerLimits

    with serving(rollouts, tiny_qwen2, ServerLimits(max_body_bytes=4096),
                 request_limits=RequestLimits(max_new_tokens=8, max_sequences=4)) as url:
        client = openai.OpenAI(base_url=url, api_key="any", max_retries=0)
        for kwargs, status, words in (({"max_tokens": 9}, 413, "--max-new-tokens"), ({"n": 5}, 413, "--max-sequences"),
                                      ({"stop": ["x" * 300]}, 400, "256 characters"),
                                      ({"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "at most 4096")):
            with pytest.raises(openai.APIStatusError) as e:
                client.chat.completions.create(**{"model": "m", "messages": HI, **kwargs})
            assert e.value.status_code == status and words in e.value.body["message"], (kwargs, e.value.body)
            assert e.value.body["type"] == "invalid_request_error"
        r = client.completions.create(model="m", prompt=[[5, 6]], n=4, seed=2)
        assert len(r.choices) == 4 and all(len(c.model_extra["token_ids"]) <= 8 for c in r.choices)


class Blocking:
    """A stand-in for an engine's generate that runs until its `cancelled` hook says stop (at most 10 s), polling it
    every 10 ms as the decode loop polls it each step; `stopped` holds when it saw the hook, `running` while it runs."""

    def __init__(self):
        self.stopped, self.running = [], False

    def __call__(self, prompts, params, cancelled=None):
        from emapg_cli.engines.base import Cancelled

        self.running, end = True, time.monotonic() + 10
        try:
            while time.monotonic() < end:
                if cancelled is not None and cancelled():
                    self.stopped.append(time.monotonic())
                    raise Cancelled("the generation was cancelled")
                time.sleep(0.01)
            return [[Completion([5], "x", "length", [-1.0]) for _ in range(params.n)] for _ in prompts]
        finally:
            self.running = False


def test_openai_request_deadline_counts_from_arrival_and_a_client_that_left_cancels(rollouts, tiny_qwen2, monkeypatch):
    """A request with a 1 s deadline that waits 0.6 s for the generation lock (another request holds it) is stopped
    1 s after it arrived (504, server_error), not 1 s after its generation started (1.6 s); a client that sends its
    request and leaves has its generation cancelled at once (well before its 30 s deadline), and the lock is free."""
    engine = Blocking()
    monkeypatch.setattr(rollouts.served.engine, "generate", engine)
    with serving(rollouts, tiny_qwen2, timeout_s=1.0) as url:
        client = openai.OpenAI(base_url=url, api_key="any", max_retries=0)
        holder = threading.Thread(target=lambda: (rollouts.cond.acquire(), time.sleep(0.6), rollouts.cond.release()))
        holder.start()
        time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="m", messages=HI, max_tokens=4)
        assert e.value.status_code == 504 and e.value.body["type"] == "server_error"
        assert time.monotonic() - t0 < 1.4 and engine.stopped, time.monotonic() - t0  # 1 s from arrival (+ polling)
        holder.join()
    with serving(rollouts, tiny_qwen2, timeout_s=30.0) as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        body = json.dumps({"model": "m", "messages": HI, "max_tokens": 4}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.3)  # the generation has started
            left = time.monotonic()
        end = time.monotonic() + 5
        while engine.running and time.monotonic() < end:
            time.sleep(0.02)
        assert len(engine.stopped) == 2 and engine.stopped[1] - left < 1.0, engine.stopped
        assert rollouts.cond.acquire(timeout=1)
        rollouts.cond.release()


# ---------------------------------------------------------------------------------------------- agent episodes
class Scripted(EngineBase):
    """An engine that answers each prompt, in call order, with the next scripted text (+ EOS), log-prob -0.5 per token."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.prompts = tok, list(texts), []

    def generate(self, prompts, params, cancelled=None):
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            text = self.texts.pop(0)  # a (text, False) pair: no EOS (the turn ended on a stop string)
            text, eos = text if isinstance(text, tuple) else (text, True)
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] * eos
            out.append([Completion(ids, self.tok.decode(ids, skip_special_tokens=True), "stop", [-0.5] * len(ids))
                        for _ in range(params.n)])
        return out

    def load_weights(self, model):
        pass

    def full_vocab_logprobs(self, params):
        return True


_FILES = iter(range(1 << 30))


def agent_file(tmp_path: Path, body: str, name: str = "agent") -> str:
    """`body` saved as a new file (a file is imported once per process), referenced as FILE.py:name."""
    path = tmp_path / f"agent_{next(_FILES)}.py"
    path.write_text(body)
    return f"{path}:{name}"


def run_agent(tok, ref, engine, n=1, examples=(QUESTION,), **settings):
    from emapg_cli.agents.agent import AgentRunner, AgentSettings
    from emapg_cli.models.prompts import render_prompt

    runner = AgentRunner(tok, AgentSettings(ref=ref, **{"timeout_s": 20, **settings}), 512)
    try:
        return runner.generate(engine, [render_prompt(tok, e["question"]) for e in examples],
                               SamplingParams(n=n, max_new_tokens=16, seed=3), list(examples))
    finally:
        runner.close()


@pytest.fixture(scope="module")
def tok(tiny_qwen2):
    from emapg_cli.models.loading import load_tokenizer

    return load_tokenizer(str(tiny_qwen2))


THREE_CALLS = '''
def agent(client, example):
    msgs = [{"role": "user", "content": example["question"]}]
    first = client.chat.completions.create(model="policy", messages=msgs).choices[0].message.content
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "<result>5</result>"}]
    second = client.chat.completions.create(model="policy", messages=msgs).choices[0].message.content
    fresh = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}])
    return {"reward": float(second == "5"), "turns": 3}
'''


def test_multi_call_trajectory_equals_the_hand_built_one(tmp_path, tok):
    """Call 2 extends call 1 (one trajectory, the template's tokens and the tool result masked); call 3 does not (a
    sequence of its own, one prefix break). Every id, mask and log-prob is the hand-built one."""
    engine = Scripted(tok, ["12", "5", "zz"])
    (ep,), = run_agent(tok, agent_file(tmp_path, THREE_CALLS), engine)
    eos = tok.eos_token_id
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    p1 = enc("<|im_start|>user\n2+3<|im_end|>\n<|im_start|>assistant\n")  # the tiny model's ChatML template
    a1, a2 = enc("12") + [eos], enc("5") + [eos]  # what the engine sampled (EOS = <|im_end|>)
    between = enc("\n<|im_start|>user\n<result>5</result><|im_end|>\n<|im_start|>assistant\n")  # template + tool result
    p3, a3 = enc("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"), enc("zz") + [eos]
    assert engine.prompts == [p1, p1 + a1 + between, p3]  # call 2's prompt reuses call 1's ids, then the rest
    (s1, s2) = ep.segments
    assert s1.prompt == p1 and s1.episode.token_ids == a1 + between + a2
    assert s1.episode.policy_mask == [True] * len(a1) + [False] * len(between) + [True] * len(a2)
    assert s1.episode.logprobs == [-0.5] * len(a1) + [0.0] * len(between) + [-0.5] * len(a2)
    assert s2.prompt == p3 and s2.episode.token_ids == a3 and s2.episode.policy_mask == [True] * len(a3)
    assert (ep.requests, ep.prefix_breaks, ep.env_reward, ep.counters, ep.error) == (3, 1, 1.0, {"turns": 3.0}, "")

    from emapg_cli.train.rollout import padded_batch

    batch, _ = padded_batch([p1], [ep], 1, False, tok.pad_token_id, "cpu")
    assert batch.episode.tolist() == [0, 0] and batch.keep.tolist() == [True, True]
    row0 = batch.input_ids[0, batch.attention_mask[0].bool()].tolist()
    assert row0 == p1 + a1 + between + a2 and batch.loss_mask[0, :len(s1.episode.token_ids)].tolist() == s1.episode.policy_mask
    adv = batch.with_advantages(torch.tensor([0.7])).advantages
    assert adv.tolist() == pytest.approx([0.7, 0.7])  # both sequences carry the episode's advantage
    assert batch.rows_of(torch.tensor([0])).tolist() == [0, 1]


SIBLINGS = '''
def agent(client, example):
    r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}], n=2)
    return 1.0
'''


def test_n_choices_are_sibling_sequences_not_breaks(tmp_path, tok):
    (ep,), = run_agent(tok, agent_file(tmp_path, SIBLINGS), Scripted(tok, ["ab"]))
    assert len(ep.segments) == 2 and ep.prefix_breaks == 0 and ep.requests == 1


@pytest.mark.parametrize("body, error", [
    ("def agent(client, example):\n    raise ValueError('boom')\n", "raised ValueError: boom"),
    ("def agent(client, example):\n    return 1.0\n", "made no model call"),
    (THREE_CALLS.replace('"turns": 3', '"calls": 3'), "the metric 'calls', a name the runner logs itself"),
    (THREE_CALLS.replace('return {"reward": float(second == "5"), "turns": 3}', 'return "1.0"'), "returned str '1.0', not a number"),
    (THREE_CALLS.replace('return {"reward": float(second == "5"), "turns": 3}', 'return {"score": 1}'), "without 'reward'"),
    (THREE_CALLS.replace('return {"reward": float(second == "5"), "turns": 3}', 'return float("nan")'), "not finite"),
    ("import sys\ndef agent(client, example):\n    sys.exit(3)\n", "called sys.exit(3)"),
])
def test_bad_agents_score_zero_with_one_line(tmp_path, tok, body, error):
    (ep,), = run_agent(tok, agent_file(tmp_path, body), Scripted(tok, ["12", "5", "zz"]))
    assert error in ep.error and "\n" not in ep.error and ep.env_reward == 0.0 and ep.outcome == "error"


def test_caps_and_timeout(tmp_path, tok):
    """A call past rollout.agent_max_calls is refused (400, code episode_limit) and the agent that does not catch it
    fails; a caught refusal is the agent's business; an episode past its time is given up on."""
    (ep,), = run_agent(tok, agent_file(tmp_path, THREE_CALLS), Scripted(tok, ["12", "5"]), max_calls=2)
    assert "BadRequestError" in ep.error and "rollout.agent_max_calls" in ep.error and len(ep.segments) == 1
    caught = THREE_CALLS.replace('    fresh = client', '    import openai\n    try:\n        client').replace(
        '[{"role": "user", "content": "again"}])', '[{"role": "user", "content": "again"}])\n    except openai.BadRequestError:\n        pass')
    (ep,), = run_agent(tok, agent_file(tmp_path, caught, "agent"), Scripted(tok, ["12", "5"]), max_calls=2)
    assert ep.error == "" and ep.env_reward == 1.0
    slow = "import time\ndef agent(client, example):\n    time.sleep(30)\n    return 1.0\n"
    (ep,), = run_agent(tok, agent_file(tmp_path, slow, "agent"), Scripted(tok, []), timeout_s=0.5)
    assert ep.error == "did not return within rollout.agent_timeout_s = 0.5 s"


def test_a_round_no_one_waits_for_is_cancelled_before_the_step_returns(tmp_path, tok):
    """Both episodes of a step wait on one round whose engine call runs long (10 s); past rollout.agent_timeout_s
    (2 s) they are given up on, and the round's engine call, which no episode waits for anymore, is cancelled (its
    hook polled as the decode loop polls it): the step returns at once with no engine call still running (a running
    one would sample while the trainer updates the weights). Timed from the round's start: each episode's clock
    starts once its agent process is up, which takes a second or more on a loaded machine."""
    engine, began = Blocking(), []

    class Engine(Scripted):
        def generate(self, prompts, params, cancelled=None):
            began.append(time.monotonic())
            return engine(prompts, params, cancelled)

    calls = "def agent(client, example):\n    client.chat.completions.create(model='p', messages=[{'role': 'user', 'content': 'q'}])\n"
    eps, = run_agent(tok, agent_file(tmp_path, calls), Engine(tok, []), n=2, timeout_s=2)
    returned = time.monotonic()
    assert not engine.running and len(engine.stopped) == 1 and len(began) == 1
    # the round began once both episodes had called, within their 2 s: it stops by their deadline (+ polls and a loaded
    # machine's slack: 3 s), not at the engine's own 10 s, and the step returns within 1 s of the stop
    assert engine.stopped[0] - began[0] < 3 and returned - engine.stopped[0] < 1
    assert [e.error for e in eps] == ["did not return within rollout.agent_timeout_s = 2 s"] * 2


def test_a_cancelled_call_leaves_its_round_before_it_runs():
    """Episode 0 calls while episode 1 is still busy (no round yet); its client leaves: the call is withdrawn
    (`Cancelled`). Episode 0 calls again, then episode 1: their round holds those two calls, not the withdrawn one."""
    from emapg_cli.agents.rounds import Rounds
    from emapg_cli.engines.base import Cancelled

    seen = []

    class Engine:
        def generate(self, prompts, params, cancelled=None):
            seen.append(prompts)
            return [[Completion([1], "a", "stop", [-1.0])] * params.n for _ in prompts]

    rounds = Rounds(Engine(), seed=0, slots=2, width=2, start=lambda slot: None)
    rounds.begin()
    gone, errors = threading.Event(), []

    def call() -> None:
        try:
            rounds.generate(0, [[7]], SamplingParams(), 0, cancelled=gone.is_set)
        except Cancelled as e:
            errors.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.2)
    gone.set()  # the client of episode 0's call left
    thread.join(5)
    assert not thread.is_alive() and len(errors) == 1
    again = threading.Thread(target=rounds.generate, args=(0, [[8]], SamplingParams(), 0))
    again.start()
    assert rounds.generate(1, [[9]], SamplingParams(), 0)[0][0].token_ids == [1] and seen == [[[8], [9]]]
    again.join(5)


def test_failure_rate_stops_above_the_limit(tmp_path, tok, capsys):
    from emapg_cli.agents.agent import AgentEpisode, agent_metrics

    eps = [AgentEpisode(token_ids=[], text="", finish_reason="stop", requests=2, seconds=1.0, error=e) for e in ("", "", "x", "")]
    out = agent_metrics(eps, 0.5, "a.py:f", "of this step")
    assert out["agent/errors"] == 1.0 and out["agent/calls"] == 2.0 and "warning: rollout.agent a.py:f failed on 1 of 4" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"failed on 1 of 4 episodes of this step \(25% > reward.max_failure_rate 0.2\); first failure: x"):
        agent_metrics(eps, 0.2, "a.py:f", "of this step")


def test_endpoint_refuses_what_the_run_does_not_sample(tmp_path, tok):
    body = '''
import openai
def agent(client, example):
    out = []
    for kw in ({"temperature": 0.5}, {"max_tokens": 17}, {"max_tokens": 600}, {"top_p": 0.9}):
        try:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}], **kw)
        except openai.BadRequestError as e:
            out.append(e.body["param"])
    bad = openai.OpenAI(base_url=client.base_url, api_key="stolen", max_retries=0)
    try:
        bad.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
    except openai.AuthenticationError:
        out.append("key")
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}], temperature=1.0)
    return {"reward": float(out == ["temperature", "max_tokens", "max_tokens", "top_p", "key"])}
'''
    (ep,), = run_agent(tok, agent_file(tmp_path, body), Scripted(tok, ["a"]))
    assert ep.error == "" and ep.env_reward == 1.0 and ep.requests == 1


def test_concurrent_episodes_are_reproducible(tmp_path, tiny_qwen2, tok, one_torch_thread):
    """Three prompts x n=3 episodes of a two-call agent, at most 4 running at once: run twice, the same samples."""
    from emapg_cli.engines.hf import HFEngine
    from emapg_cli.models.loading import load_causal_lm

    engine = HFEngine(load_causal_lm(str(tiny_qwen2), "float32"), tok)
    two = THREE_CALLS.replace('    fresh = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}])\n', "")
    exs = [dict(QUESTION, id=str(i), question=f"{i}+{i}") for i in range(3)]
    ref = agent_file(tmp_path, two)
    runs = [run_agent(tok, ref, engine, n=3, examples=exs, workers=4) for _ in range(2)]
    ids = [[[s.episode.token_ids for s in e.segments] for g in r for e in g] for r in runs]
    assert ids[0] == ids[1] and all(e.requests == 2 and not e.error for g in runs[0] for e in g)
    assert len({tuple(x[0]) for x in ids[0]}) > 1  # the episodes are sampled apart (own rows, seeds per round)


# ---------------------------------------------------------------------------------------------- the CLI
TWO_CALLS = '''
def two_calls(client, example):
    """Two chat calls; 1 when the second answer holds a digit (random tiny models do, now and then)."""
    msgs = [{"role": "user", "content": example["question"]}]
    r = client.chat.completions.create(model="policy", messages=msgs)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Sure?"}]
    r = client.chat.completions.create(model="policy", messages=msgs)
    return {"reward": float(any(ch.isdigit() for ch in r.choices[0].message.content)), "chars": len(r.choices[0].message.content)}
'''


def agent_opts(tiny, data, ref, steps=2, **extra):
    from train_helpers import tiny_overrides

    return tiny_overrides(tiny, data, steps=steps, **{"rollout.agent": ref, "rollout.max_context_tokens": 256,
                                                      "data.max_prompt_tokens": 64, **extra})


def test_two_call_agent_trains_and_eval_grades_with_it(tiny_llama, tmp_path):
    """`emapg train --set rollout.agent=...`: agent/calls = 2 at every step, the agent's own metric logged; and
    `emapg eval --agent` grades the model with the same code (run beside it)."""
    from train_helpers import run_many, train_cmd, write_dataset

    data = write_dataset(tmp_path / "d.jsonl")
    ref = agent_file(tmp_path, TWO_CALLS, "two_calls")
    out = tmp_path / "run"
    evaluate = [sys.executable, "-m", "emapg_cli", "eval", "--bench", str(data), "--model", str(tiny_llama), "--backend", "hf",
                "--agent", ref, "--n", "2", "--max-tokens", "6", "--max-context-tokens", "256", "--limit", "3",
                "--out", str(tmp_path / "ev")]
    p, e = run_many([train_cmd(*agent_opts(tiny_llama, data, ref), "--out", str(out)), evaluate])  # side by side
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "agent/calls" in r]
    assert [r["agent/calls"] for r in steps] == [2.0, 2.0] and all(r["agent/errors"] == 0 for r in steps)
    assert all("agent/chars" in r and "agent/prefix_breaks" in r for r in steps)
    assert e.returncode == 0, e.stderr[-2000:]
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert summary["env"]["calls"] == 2.0 and summary["reward"] == f"rollout.agent {ref}"


# episodes run in processes of their own (agents/agent.py): they count themselves in a file, one byte each (O_APPEND)
BREAKS_AT_STEP_2 = TWO_CALLS.replace(
    '    msgs = [{"role": "user", "content": example["question"]}]',
    '    with open(__file__ + ".episodes", "a") as f:\n        f.write("x")\n'
    '    if os.path.getsize(__file__ + ".episodes") > 20:  # the 4 episodes of the evaluation at step 0 and step 1\'s 16 work, then the tool is gone\n'
    '        raise RuntimeError("no tools here")\n    msgs = [{"role": "user", "content": example["question"]}]') + "\n\nimport os\n"


def test_failing_agent_stops_training_with_one_line(tiny_llama, tmp_path):
    """An agent that raises in every episode of step 2: exit 2 with one line naming the first failure, before step
    2's update; step 1's checkpoint and metrics are kept (resume once fixed)."""
    from train_helpers import run, train_cmd, write_dataset

    data = write_dataset(tmp_path / "d.jsonl")
    ref = agent_file(tmp_path, BREAKS_AT_STEP_2, "two_calls")
    out = tmp_path / "run"
    p = run(train_cmd(*agent_opts(tiny_llama, data, ref, steps=2), "--out", str(out)))
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [x for x in p.stderr.strip().splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "failed on 16 of 16 episodes of this step (100% > reward.max_failure_rate 0.5); first failure: raised " \
           "RuntimeError: no tools here" in lines[0], lines[0]
    assert (out / "checkpoints" / "step_1" / "state.json").is_file() and not (out / "checkpoints" / "step_2").exists()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and rows[-1]["agent/calls"] == 2.0


def test_agent_config_errors_are_one_line(tiny_llama, tmp_path):
    from conftest import run_cli

    fn = agent_file(tmp_path, "def agent(response):\n    return 1\n")
    for value, words in ((fn, "must accept (client, example)"), (f"{tmp_path}/nope.py:f", "file not found"),
                         (agent_file(tmp_path, "class agent:\n    pass\n", "agent"), "is a class; an agent is a function fn(client, example)")):
        p = run_cli("train", "--preset", "toy", "--set", f"rollout.agent={value}", "--dry-run")
        assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = run_cli("train", "--preset", "toy-tools", "--set", f"rollout.agent={agent_file(tmp_path, TWO_CALLS, 'two_calls')}",
                "--dry-run")
    assert p.returncode == 2 and "contradicts rollout.env=calc" in p.stderr


MARKING = TWO_CALLS.replace('''    msgs = [{"role": "user", "content": example["question"]}]''', '''    import os

    if os.environ.get("AGENT_MARK"):  # the test kills the run while an episode is in its calls
        with open(os.environ["AGENT_MARK"], "a") as f:
            f.write("call\\n")
    msgs = [{"role": "user", "content": example["question"]}]''')


@pytest.mark.slow
def test_sigkill_during_an_agent_step_then_resume_is_bit_identical(tiny_llama, tmp_path):
    """A run killed (SIGKILL) while its agents are in step 2's calls, resumed from its step-1 checkpoint, ends with the
    same policy and anchor weights, bit for bit, and the same metrics as an uninterrupted run."""
    import os
    import signal
    import subprocess
    import time

    from train_helpers import env, load_weights, run, train_cmd, write_dataset

    data = write_dataset(tmp_path / "d.jsonl")
    opts = agent_opts(tiny_llama, data, agent_file(tmp_path, MARKING, "two_calls"), steps=3)
    a, b, mark = tmp_path / "a", tmp_path / "b", tmp_path / "mark"
    reference = subprocess.Popen(train_cmd(*opts, "--out", str(a)), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    victim = subprocess.Popen(train_cmd(*opts, "--out", str(b)), env={**env(), "AGENT_MARK": str(mark)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (b / "checkpoints" / "step_1" / "state.json").exists():
        assert victim.poll() is None and time.time() < deadline
        time.sleep(0.01)
    seen = mark.stat().st_size
    while mark.stat().st_size == seen:  # an episode of step 2 has made a call
        assert victim.poll() is None and time.time() < deadline
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert reference.wait(timeout=300) == 0, reference.stderr.read()[-2000:]
    assert not (b / "checkpoints" / "step_2").exists(), "killed too late: step 2 was checkpointed"
    resumed = run(train_cmd("--resume", str(b), "--trust-code"), timeout=300)  # the agent comes from config.yaml
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for part in ("policy", "anchor"):
        wa, wb = load_weights(a / "final" / part), load_weights(b / "final" / part)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), part
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "agent/episode_s"))}  # noqa: E731
                          for r in rows]
    rows = {p: [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()] for p in (a, b)}
    assert strip(rows[a])[-1] == strip(rows[b])[-1]
    assert os.path.exists(mark)


# ---------------------------------------------------------------------------------------------- docs/agents.md
def doc_block(name: str) -> str:
    """The ```python block of docs/agents.md whose first line is `# name`."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "agents.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", text, re.DOTALL):
        if block.startswith(f"# {name}\n"):
            return block
    raise AssertionError(f"docs/agents.md has no block {name}")


def test_doc_self_check_agent(tmp_path, tok):
    engine = Scripted(tok, ["\\boxed{4}", "\\boxed{5}"])
    (ep,), = run_agent(tok, agent_file(tmp_path, doc_block("self_check.py"), "self_check"), engine)
    assert (ep.error, ep.env_reward, ep.counters, ep.requests, ep.prefix_breaks, len(ep.segments)) == ("", 1.0, {"changed": 1.0}, 2, 0, 1)


#: A Qwen2.5-style chat template with tools (Hermes <tool_call> blocks), for the doc's tool-calling agent.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_doc_tool_agents(tmp_path, tok):
    """OpenAI's tool-call format (a template with tools): the call comes back as tool_calls, its result goes back as a
    tool message; JSON in text (a template without): the same adder, parsed by the agent."""
    import copy

    tools_tok = copy.deepcopy(tok)
    tools_tok.chat_template = TOOLS_TEMPLATE
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    (ep,), = run_agent(tools_tok, agent_file(tmp_path, doc_block("add_tool.py"), "add_tool"), Scripted(tools_tok, [call, "5"]))
    assert (ep.error, ep.env_reward, ep.requests) == ("", 1.0, 2)
    assert ep.prefix_breaks == 0 and len(ep.segments) == 1  # the template wrote the call back as the model did
    # the model wrote the call in another form than the template writes it back: still one trajectory, the endpoint
    # gives the template the text the model wrote for the turn it returned
    other = '<tool_call>{"arguments": {"b": 3, "a": 2}, "name": "add"}</tool_call>'
    engine = Scripted(tools_tok, [other, "5"])
    (ep,), = run_agent(tools_tok, agent_file(tmp_path, doc_block("add_tool.py"), "add_tool"), engine)
    assert (ep.error, ep.env_reward, ep.prefix_breaks, len(ep.segments)) == ("", 1.0, 0, 1)
    assert tools_tok.decode(engine.prompts[1]).count(other) == 1
    (ep,), = run_agent(tok, agent_file(tmp_path, doc_block("add_json.py"), "add_json"),
                       Scripted(tok, ['{"tool": "add", "a": 2, "b": 3}', "5"]))
    assert (ep.error, ep.env_reward, ep.requests, ep.prefix_breaks) == ("", 1.0, 2, 0)


def test_doc_calculator_agent_is_the_calc_environment_token_for_token(tmp_path, tok):
    """The doc's calculator agent gives the calc environment's trajectory: the prompt, the turn that ended at
    </calc> (no EOS), `<result>5</result>` masked (tokenized as the environment tokenizes observations), the answer."""
    from emapg_cli.models.prompts import render_prompt

    engine = Scripted(tok, [("<calc>2+3</calc>", False), "\\boxed{5}"])
    (ep,), = run_agent(tok, agent_file(tmp_path, doc_block("calc_agent.py"), "calculator"), engine)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turn1, obs, turn2 = enc("<calc>2+3</calc>"), enc("<result>5</result>"), enc("\\boxed{5}") + [tok.eos_token_id]
    (seg,) = ep.segments
    assert seg.prompt == render_prompt(tok, "2+3") and seg.episode.token_ids == turn1 + obs + turn2
    assert seg.episode.policy_mask == [True] * len(turn1) + [False] * len(obs) + [True] * len(turn2)
    assert (ep.error, ep.env_reward, ep.counters, ep.prefix_breaks) == ("", 1.0, {"tool_calls": 1.0}, 0)
