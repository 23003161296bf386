"""docs/agents.md's OpenEnv recipe, checked: an OpenEnv environment server (openenv-core) on loopback, and an agent
that plays its episodes through OpenEnv's generic client with the policy behind emapg's agent endpoint.

openenv-core is not in emapg's `dev` extra (it pulls FastAPI, Gradio, MCP): this test is skipped without it. To
run it: a virtual environment with emapg's dev extra and `pip install openenv-core==0.3.0`, then
`pytest tests/test_agents_openenv.py`."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("openenv.core")
uvicorn = pytest.importorskip("uvicorn")

AGENT = '''
from openenv.core import GenericEnvClient


def play(client, example):
    """One OpenEnv episode: reset gives the question, the policy answers through `client`, step grades it."""
    with GenericEnvClient(base_url=example["meta"]["env_url"]).sync() as env:
        first = env.reset(question=example["question"], answer=example["answers"][0])
        messages = [{"role": "user", "content": first.observation["prompt"]}]
        text = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        result = env.step({"answer": text})
        return {"reward": float(result.reward or 0.0), "done": float(result.done)}
'''


def _server():
    """An OpenEnv environment (exact-match arithmetic) served by openenv-core's FastAPI app on 127.0.0.1."""
    from openenv.core.env_server import Action, Environment, Observation, State
    from openenv.core.env_server.http_server import create_fastapi_app

    class Answer(Action):
        answer: str = ""

    class Seen(Observation):
        prompt: str = ""

    class Arith(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state, self._answer = State(), ""

        def reset(self, seed=None, episode_id=None, question="", answer="", **kw):
            self._answer = answer
            return Seen(prompt=question)

        def step(self, action, timeout_s=None, **kw):
            return Seen(prompt="", done=True, reward=float(action.answer.strip() == self._answer))

        @property
        def state(self):
            return self._state

    app = create_fastapi_app(Arith, Answer, Seen, max_concurrent_envs=64)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(200):
        if server.started:
            return server, f"http://127.0.0.1:{port}"
        time.sleep(0.05)
    raise AssertionError("the OpenEnv server did not start")


def test_openenv_client_agent(tmp_path, tiny_qwen2, one_torch_thread):
    from emapg_cli.agents.agent import AgentRunner, AgentSettings
    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.engines.hf import HFEngine
    from emapg_cli.models.loading import load_causal_lm, load_tokenizer
    from emapg_cli.models.prompts import render_prompt

    server, url = _server()
    (tmp_path / "play.py").write_text(AGENT)
    tok = load_tokenizer(str(tiny_qwen2))
    engine = HFEngine(load_causal_lm(str(tiny_qwen2), "float32"), tok)
    examples = [{"id": str(i), "question": f"{i}+{i}", "answers": [str(2 * i)], "source": "t", "meta": {"env_url": url}}
                for i in range(2)]
    runner = AgentRunner(tok, AgentSettings(ref=f"{tmp_path / 'play.py'}:play", timeout_s=60), 256)
    try:
        groups = runner.generate(engine, [render_prompt(tok, e["question"]) for e in examples],
                                 SamplingParams(n=2, max_new_tokens=4, seed=0), examples)
    finally:
        runner.close()
        server.should_exit = True
    episodes = [e for g in groups for e in g]
    assert all(e.error == "" and e.requests == 1 and e.counters == {"done": 1.0} for e in episodes), [e.error for e in episodes]
    assert all(e.env_reward in (0.0, 1.0) and len(e.segments) == 1 for e in episodes)
