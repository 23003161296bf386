"""User environments (rollout.env=FILE.py:Class, docs/environments.md): the loop on a scripted engine (exact tokens,
masks, log-probs, seeds, counts), its one-line errors, the config keys, and the CLI: the doc's example trains and
is graded by `emapg eval` through the same factory (with the class's reward, and without it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from emapg_cli.agents.environments import generate, make_environment
from emapg_cli.agents.runner import env_metrics
from emapg_cli.config.loading import load_config
from emapg_cli.data.schema import Example
from emapg_cli.engines.base import Completion, SamplingParams, derive_seed
from emapg_cli.errors import UserError
from emapg_cli.models.tiny import build_byte_tokenizer
from train_helpers import LAUNCHER, run, tiny_overrides, train_cmd, write_dataset

DOC = Path(__file__).resolve().parents[1] / "docs" / "environments.md"


def doc_example() -> str:
    """The first python block after "## A complete example" in docs/environments.md (the tests run the doc itself)."""
    text = DOC.read_text(encoding="utf-8").split("## A complete example", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()  # one token per byte


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class Scripted:
    """Replies to each row with the next scripted turn of the episode whose prompt's first byte is its key."""

    def __init__(self, tok, scripts: dict[int, list[str]], cut_at=frozenset()):
        self.tok, self.scripts, self.cut_at = tok, scripts, cut_at
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []
        self.turn: dict[int, int] = {}

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for p in prompts:
            t = self.turn.get(p[0], 0)
            self.turn[p[0]] = t + 1
            ids = enc(self.tok, self.scripts[p[0]][t])
            out.append([Completion(ids, "", "length" if (p[0], t) in self.cut_at else "stop", [-0.5 * (t + 1)] * len(ids))])
        return out


def write_env(tmp_path: Path, body: str, name: str = "my_env.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


ECHO = '''
class Echo:
    """Observes "<n>" after each turn (n = turns so far); ends when the turn says "done"."""
    stop = ["!"]
    max_turns = 3

    def __init__(self, example):
        self.turns, self.invalid = 0, 0

    def step(self, text):
        self.turns += 1
        if "done" in text:
            return None
        if "?" in text:
            self.invalid += 1
        return f"<{self.turns}>"

    def metrics(self):
        return {"seen": self.turns}
'''


def examples(n: int) -> list[Example]:
    return [Example(id=f"q{i}", question="1+1", answers=["2"]) for i in range(n)]


def test_episode_tokens_masks_logprobs_and_seeds(tmp_path, tok):
    env = make_environment(f"{write_env(tmp_path, ECHO)}:Echo", tok, max_context_tokens=100, timeout_s=5)
    engine = Scripted(tok, {65: ["ab", "done"], 66: ["x?", "yz", "w"]})
    params = SamplingParams(n=1, max_new_tokens=4, seed=7, stop=("#",))
    (a,), (b,) = generate(env.bind(engine), [[65], [66]], params, examples(2))
    # A: turn "ab" (mask 1, lp -0.5), observation "<1>" (mask 0, lp 0), turn "done" (lp -1.0): step returned None
    assert a.token_ids == enc(tok, "ab") + enc(tok, "<1>") + enc(tok, "done")
    assert a.policy_mask == [True] * 2 + [False] * 3 + [True] * 4
    assert a.logprobs == [-0.5] * 2 + [0.0] * 3 + [-1.0] * 4
    assert (a.text, a.outcome, a.turns, a.calls, a.invalid, a.counters) == ("abdone", "done", 2, 1, 0, {"seen": 2.0})
    # B: three turns (max_turns 3); the last step's observation "<3>" is not appended; one invalid turn ("?")
    assert b.token_ids == enc(tok, "x?<1>yz<2>w")
    assert b.policy_mask == [True] * 2 + [False] * 3 + [True] * 2 + [False] * 3 + [True]
    assert (b.outcome, b.turns, b.calls, b.invalid, b.obs_tokens) == ("turns", 3, 2, 1, 6)
    assert b.env_reward is None  # Echo has no reward: rollout.reward grades the text
    # one engine call per turn for the active episodes, each turn's seed derived from (seed, turn), stop = class + rollout
    assert [len(p) for p, _ in engine.calls] == [2, 2, 1]
    assert [c[1].seed for c in engine.calls] == [derive_seed(7, t) for t in range(3)]
    assert engine.calls[0][1].stop == ("!", "#") and engine.calls[0][1].n == 1
    assert engine.calls[1][0][1] == [66] + enc(tok, "x?<1>")  # the context: prompt + trajectory so far
    # env/* over the two episodes: turns (2 + 3) / 2, calls (1 + 2) / 2, invalid 1 / 5 turns, counters' mean (2 + 3) / 2
    m = env_metrics([a, b])
    assert (m["env/turns"], m["env/calls"], m["env/invalid_rate"], m["env/seen"]) == (2.5, 1.5, 0.2, 2.5)
    assert m["env/obs_tokens_frac"] == 9 / 20  # observations 3 + 6 of 9 + 11 tokens


def test_context_limit_cuts_and_ends(tmp_path, tok):
    env = make_environment(f"{write_env(tmp_path, ECHO)}:Echo", tok, max_context_tokens=8, timeout_s=5)
    engine = Scripted(tok, {65: ["abc", "de", "f"]})
    (ep,), = generate(env.bind(engine), [[65]], SamplingParams(max_new_tokens=3), examples(1))
    # prompt 1 + turn 3 = 4; room for the observation "<1>": 8 - 4 = 4 -> kept whole (3); next turn needs
    # 1 + 6 + 3 = 10 > 8 tokens: the episode ends on the context limit
    assert ep.token_ids == enc(tok, "abc<1>") and (ep.outcome, ep.turns, ep.obs_cut) == ("context", 1, 0)
    env = make_environment(f"{write_env(tmp_path, ECHO)}:Echo", tok, max_context_tokens=9, timeout_s=5)
    (ep,), = generate(env.bind(Scripted(tok, {65: ["abc", "d"]})), [[65]], SamplingParams(max_new_tokens=1), examples(1))
    # turn 2 starts (1 + 6 + 1 = 8 <= 9); its observation "<2>" gets the 9 - 8 = 1 token left
    assert ep.token_ids == enc(tok, "abc<1>d<") and ep.obs_cut == 1


def test_reward_from_the_environment_replaces_rollout_reward(tmp_path, tok):
    from emapg_cli.train.rollout import score

    path = write_env(tmp_path, "class R:\n    max_turns = 1\n    def __init__(self, ex): self.ex = ex\n"
                               "    def step(self, text): return None\n"
                               "    def reward(self, text): return len(text) + (self.ex['id'] == 'q1')\n")
    env = make_environment(f"{path}:R", tok, timeout_s=5)
    assert env.has_reward
    groups = generate(env.bind(Scripted(tok, {65: ["abc"], 66: ["abcdef"]}, cut_at={(66, 0)})), [[65], [66]],
                      SamplingParams(max_new_tokens=6), examples(2))
    eps = [g[0] for g in groups]
    assert [e.env_reward for e in eps] == [3.0, 7.0]  # len("abc"); len("abcdef") + 1 (example q1)

    def never(responses, exs):
        raise AssertionError("rollout.reward must not be called")

    # truncation still applies: q1's turn hit the cap (finish "length") and reward.truncated=zero scores it 0
    rewards, errors = score(never, eps, examples(2), shaping={"truncated": "zero"})
    assert (rewards, errors) == ([3.0, 0.0], 0)


INIT = "    def __init__(self, ex): pass\n"


@pytest.mark.parametrize("body,method,words", [
    (INIT + "    def step(self, text): raise ValueError('bad turn')\n", "step", "raised ValueError: bad turn"),
    (INIT + "    def step(self, text):\n        import time\n        time.sleep(30)\n", "step",
     "did not return within rollout.env_timeout_s = 0.3 s"),
    (INIT + "    def step(self, text): return 3\n", "step", "returned int 3; expected a str"),
    (INIT + "    def step(self, text): return None\n    def reward(self, text): return 'high'\n", "reward",
     "returned str 'high'; expected a number finite in float32"),
    (INIT + "    def step(self, text): return None\n    def reward(self, text): return 1e39\n", "reward",
     "returned float '1e+39'; expected a number finite in float32"),  # finite in float64, inf in float32
    ("    def __init__(self, ex): raise KeyError('answers')\n    def step(self, text): return None\n", "__init__", "raised KeyError"),
    # issue 32: `invalid` (a property) and the attribute lookups are user code too, under the same time limit
    (INIT + "    def step(self, text): return None\n    @property\n    def invalid(self):\n        import time\n"
     "        time.sleep(30)\n", "invalid", "did not return within rollout.env_timeout_s = 0.3 s"),
    (INIT + "    def step(self, text): return None\n    @property\n    def invalid(self): raise RuntimeError('no counter')\n",
     "invalid", "raised RuntimeError: no counter"),
    (INIT + "    def step(self, text): return None\n    @property\n    def invalid(self): return Slow()\n"
     "class Slow(float):\n    def __float__(self):\n        import time\n        time.sleep(30)\n        return 0.0\n",
     "invalid", "did not return within rollout.env_timeout_s = 0.3 s"),
    (INIT + "    def step(self, text): return None\n    def __getattr__(self, name):\n        import time\n        time.sleep(30)\n",
     "invalid", "did not return within rollout.env_timeout_s = 0.3 s"),
], ids=["raises", "hangs", "returns-int", "reward-str", "reward-1e39", "init-raises", "invalid-hangs", "invalid-raises",
        "invalid-float-hangs", "getattr-hangs"])
def test_user_errors_name_file_and_method(tmp_path, tok, body, method, words):
    path = write_env(tmp_path, "class Bad:\n" + body)
    env = make_environment(f"{path}:Bad", tok, timeout_s=0.3)
    with pytest.raises(UserError) as e:
        generate(env.bind(Scripted(tok, {65: ["a"]})), [[65]], SamplingParams(), examples(1))
    line = str(e.value)
    assert "\n" not in line and f"rollout.env {path}:Bad.{method} " in line and words in line, line


def test_config_keys():
    path_free = load_config(overrides=["search.enabled=true", "rollout.max_new_tokens=10"])
    assert (path_free.rollout.env, path_free.search.max_turns) == ("search", 4)  # search.enabled=true is rollout.env=search
    assert load_config(overrides=["rollout.env=search", "rollout.max_new_tokens=10"]).search.enabled
    with pytest.raises(UserError, match="search.max_turns"):
        load_config(overrides=["rollout.max_turns=4"])
    with pytest.raises(UserError, match="contradicts search.enabled=false"):
        load_config(overrides=["rollout.env=search", "search.enabled=false", "rollout.max_new_tokens=10"])
    with pytest.raises(UserError, match="unknown environment 'nope'"):
        load_config(overrides=["rollout.env=nope"])


def test_config_contradiction_and_context(tmp_path):
    path = write_env(tmp_path, ECHO)
    with pytest.raises(UserError, match="contradicts rollout.env="):
        load_config(overrides=["search.enabled=true", f"rollout.env={path}:Echo", "rollout.max_new_tokens=10"])
    with pytest.raises(UserError, match=r"rollout.max_context_tokens \(4096\) must hold"):
        load_config(overrides=[f"rollout.env={path}:Echo"])  # 1024 prompt + 8192 per turn
    with pytest.raises(UserError, match="no class 'Nope'"):
        load_config(overrides=[f"rollout.env={path}:Nope"])
    cfg = load_config(overrides=[f"rollout.env={path}:Echo", "rollout.max_new_tokens=10"])
    assert cfg.rollout.env == f"{path.resolve()}:Echo" and not cfg.search.enabled


@pytest.mark.slow  # trains and evaluates, ~35 s; test_episode_tokens_* runs the doc's class fast (CI budget)
def test_doc_example_trains_and_is_graded_by_eval(tiny_qwen2, tmp_path):
    """The doc's Retry trains through the CLI (2 steps, env/* metrics logged), then `emapg eval --env` grades
    it with its own reward, and a subclass without one by --reward, through the same factory."""
    env_file = write_env(tmp_path, doc_example() + "\n\nclass NoReward(Retry):\n    reward = None\n"
                         "\n\nclass Quarter(Retry):\n    def reward(self, text):\n        return 0.25\n", "retry_env.py")
    data = write_dataset(tmp_path / "train.jsonl", n=8)
    out = tmp_path / "run"
    proc = run(train_cmd(*tiny_overrides(tiny_qwen2, data, steps=2, **{"rollout.env": f"{env_file}:Retry",
                                                                         "train.save_every": 0}), "--out", str(out)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if r.get("step") == 1][0]
    for key in ("env/turns", "env/calls", "env/invalid_rate", "env/tries", "env/solved", "reward/mean"):
        assert key in step, (key, sorted(step))
    assert 1 <= step["env/turns"] <= 3  # Retry.max_turns

    def evaluate(cls: str, reward: str) -> dict:
        dest = tmp_path / f"eval-{cls}"
        p = run(["python", LAUNCHER, "eval", "--bench", str(data), "--model", str(out / "final" / "policy"), "--backend", "hf",
                 "--env", f"{env_file}:{cls}", "--n", "2", "--limit", "3", "--max-tokens", "6", "--reward", reward,
                 "--truncated", "grade", "--out", str(dest)])
        assert p.returncode == 0, p.stderr[-3000:]
        return {"summary": json.loads((dest / "summary.json").read_text()),
                "rows": [json.loads(x) for x in (dest / "results.jsonl").read_text().splitlines()]}

    own = evaluate("Retry", "math")
    assert own["summary"]["env"]["name"] == f"{env_file}:Retry" and own["summary"]["mean_score"] is not None
    for row in own["rows"]:
        assert len(row["episodes"]) == 2 and "env_rewards" not in row
        for score, ep in zip(row["scores"], row["episodes"]):
            # Retry's reward: 1 / tries when solved, else 0
            assert score == 0.0 or any(abs(score - 1 / k) < 1e-12 for k in (1, 2, 3)), score
            assert 1 <= ep["turns"] <= 3
    # the class's reward grades, not --reward: the label says so, and there are no answers to vote on
    assert own["summary"]["reward"] == f"{env_file}:Retry.reward" and own["summary"]["maj@n"] is None
    quarter = evaluate("Quarter", "math")  # 0.25 for every episode: partial credit, never a full score
    assert all(row["scores"] == [0.25, 0.25] for row in quarter["rows"])
    assert quarter["summary"]["mean_score"] == 0.25 and quarter["summary"]["avg@n"] == 0.0
    plain = evaluate("NoReward", "test_digit")
    assert plain["summary"]["reward"] == "test_digit"
    for row in plain["rows"]:  # graded by --reward (test_digit: 1 when the response has a digit)
        assert row["scores"] == [float(any(ch.isdigit() for ch in r)) for r in row["responses"]]


def test_env_that_raises_stops_training_with_one_line(tiny_qwen2, tmp_path):
    path = write_env(tmp_path, "class Boom:\n    def __init__(self, ex): pass\n"
                               "    def step(self, text): raise ValueError('no tool here')\n", "boom_env.py")
    data = write_dataset(tmp_path / "train.jsonl", n=8)
    out = tmp_path / "run"
    proc = run(train_cmd(*tiny_overrides(tiny_qwen2, data, steps=1, **{"rollout.env": f"{path}:Boom"}), "--out", str(out)))
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"boom_env.py:Boom.step raised ValueError: no tool here" in last, last
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
