"""Issue 40, item 2: an agent (`rollout.agent=FILE.py:fn`) runs in a process of its own, never in the trainer's.

Each case runs one step of two episodes in a fresh interpreter (before the fix, an agent that spins froze the trainer
for good and `os._exit(0)` ended it with exit 0): example "bad" misbehaves after one model call, example "ok" makes
one call and returns 1.0. After a first step of two good episodes (which starts the two agent processes), the step
must come back with the bad episode failed (one line, scored 0) and the good one intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("openai")

DRIVER = r'''
import json, os, sys, time
from emapg_cli.agents import endpoint
from emapg_cli.agents.agent import AgentRunner, AgentSettings
from emapg_cli.engines.base import Completion, SamplingParams
from emapg_cli.models.tiny import build_byte_tokenizer

ref, timeout, marker = sys.argv[1], float(sys.argv[2]), sys.argv[3]
close = endpoint.EpisodeBackend.close


def marked_close(self, session):  # emapg's own code at the end of an episode: which process runs it
    with open(marker, "a") as f:
        f.write(f"{os.getpid()}\n")
    close(self, session)


endpoint.EpisodeBackend.close = marked_close
tok = build_byte_tokenizer()


class Engine:
    def generate(self, prompts, params, cancelled=None):
        return [[Completion([tok.eos_token_id], "", "stop", [-0.5])] * params.n for _ in prompts]


def step(ids):
    rows = [{"id": i, "question": "q", "answers": ["a"], "source": "t", "meta": {}} for i in ids]
    return [e for group in runner.generate(Engine(), [[1], [1]], SamplingParams(n=1, max_new_tokens=4, seed=3), rows)
            for e in group]


runner = AgentRunner(tok, AgentSettings(ref=ref, timeout_s=timeout), 256)
assert [e.error for e in step(("ok", "ok"))] == ["", ""]  # the agent processes are up: not timed below
t0 = time.monotonic()
eps = step(("bad", "ok"))
print(json.dumps({"seconds": time.monotonic() - t0, "errors": [e.error for e in eps],
                  "rewards": [e.env_reward for e in eps], "pid": os.getpid()}))
runner.close()
'''

AGENT = '''import os


def agent(client, example):
    client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": "q"}}])
    if example["id"] == "bad":
        {bad}
    return 1.0
'''

#: What the bad episode does after its call, the timeout it runs under, and its error line.
CASES = {
    "spins": ("sum(range(10**12))", 8.0, "did not return within rollout.agent_timeout_s = 8 s"),
    "exits": ("os._exit(0)", 30.0, "ended its process without returning (the worker exited with code 0)"),
    "forks": ("os.fork()", 30.0, ""),  # both copies return 1.0: the child must not come back into emapg's code
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_agent_that_spins_exits_or_forks_cannot_take_the_trainer(tmp_path, case):
    bad, timeout, error = CASES[case]
    (tmp_path / "agent.py").write_text(AGENT.format(bad=bad))
    marker = tmp_path / "closed"
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", DRIVER, f"{tmp_path / 'agent.py'}:agent", str(timeout), str(marker)],
                           capture_output=True, text=True, timeout=90, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the step did not return in 90 s ({case}: the agent holds the trainer)")
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and lines, f"the trainer ended with exit {p.returncode} and no result: {p.stderr[-800:]}"
    out = json.loads(lines[-1])
    # the step returns once the bad episode's process is killed at its deadline, 8 s after its start (its process was
    # up already); + 3 s for the kill and a loaded machine
    assert out["seconds"] < timeout + 3 and time.monotonic() - t0 < 90, out
    assert out["errors"] == [error, ""] and out["rewards"] == [0.0 if error else 1.0, 1.0], out
    # emapg's end-of-episode code ran for each of the 4 episodes (for one given up on, again once its process is
    # killed), and only in the trainer: never in a copy forked by an agent
    pids = Path(marker).read_text().split()
    assert set(pids) == {str(out["pid"])} and len(pids) >= 4, pids


@pytest.mark.parametrize("top", ["import os\nos._exit(0)\n", "import sys\nsys.exit(7)\n", "raise RuntimeError('boom')\n"])
def test_an_agent_file_whose_top_level_exits_is_one_line_and_emapg_goes_on(tmp_path, top):
    """The agent file is imported once before any episode to fail early, in an agent process of its own: its top-level
    `os._exit(0)` ended emapg's process with exit 0 when that import ran in it (bounded only by a thread). Now
    AgentRunner raises one UserError naming rollout.agent, and the calling process lives on."""
    (tmp_path / "a.py").write_text(top + "\n\ndef agent(client, example):\n    return 1.0\n")
    code = ("from emapg_cli.agents.agent import AgentRunner, AgentSettings\n"
            "from emapg_cli.errors import UserError\nfrom emapg_cli.models.tiny import build_byte_tokenizer\n"
            "try:\n    AgentRunner(build_byte_tokenizer(), AgentSettings(ref='a.py:agent', timeout_s=5.0), 256)\n"
            "except UserError as e:\n    print('ONE LINE:', e)\nprint('ALIVE')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ALIVE" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
    line = next(x for x in r.stdout.splitlines() if x.startswith("ONE LINE:"))
    assert "rollout.agent" in line and "\n" not in line
