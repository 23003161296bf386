"""User code is contained (issue 32, item 12; issue 40, item 2; docs/reliability.md "User code is contained"): a
reward plugin, an environment or an agent that forks cannot break the grading pool or leave an orphan holding emapg's stdout (`emapg eval ... |
tee log` returns), a plugin that hangs at import is one line, an environment's `invalid` property is bounded by
rollout.env_timeout_s like its methods, and reward plugin workers run under their own memory cap."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import probe
from .common import Result, base_env, emapg, ok, one_line_error
from .one_line import BENCH

RESPONSES = "".join(json.dumps({"id": str(i), "responses": ["a"]}) + "\n" for i in range(3))

#: Forks twice per call: one copy returns into the caller's code (in a pool worker it would answer on the worker's
#: pipes; in `emapg eval` it is a second copy of the evaluation), one stays behind holding the inherited stdout.
FORKING = '''import os
import time


def _fork():
    if os.fork() == 0:
        pass
    if os.fork() == 0:
        time.sleep(600)


def score(response, example):
    _fork()
    return 1.0


class Env:
    max_turns = 2

    def __init__(self, example):
        pass

    def step(self, text):
        _fork()
        return None
'''


def _through_a_pipe(ws: Path, *argv: str, timeout: float = 120) -> tuple[Result, float]:
    """`emapg ARGV | ...`: run it with stdout and stderr on pipes, in a session of its own, and read both to their
    end (EOF: every process holding them has exited) within `timeout`; whatever is left in the session afterwards
    is killed. Returns the result and the seconds from exit to EOF."""
    p = subprocess.Popen([sys.executable, "-m", "emapg_cli", *argv], cwd=ws, env=base_env(ws), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = p.poll()
        raise AssertionError(f"`emapg {' '.join(argv)[:120]}` {'exited' if code is not None else 'ran'} but its output "
                             f"pipe was still open after {timeout:.0f} s (a forked copy holds it)")
    finally:
        for _ in range(50):  # the session: the command and anything it left (killed here either way)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.1)
    return Result(p.returncode, out, err), time.monotonic() - t0


@probe("reward_plugin_that_forks")
def reward_plugin_that_forks(ws: Path) -> None:
    """`emapg eval --reward fork.py:score` whose score() forks a copy that returns (in the grading pool's worker: it
    answered on the worker's pipes, a traceback flood, then an error blaming the plugin) and one that sleeps: the
    evaluation grades every response (score 1.0, mean 100%), exit 0, no traceback, and its output pipe closes."""
    (ws / "b.jsonl").write_text(BENCH)
    (ws / "r.jsonl").write_text(RESPONSES)
    (ws / "fork.py").write_text(FORKING)
    r, _ = _through_a_pipe(ws, "eval", "--bench", "b.jsonl", "--responses", "r.jsonl", "--reward", "fork.py:score",
                           "--grader-workers", "1", "--out", "o", timeout=90)
    ok(r)
    assert re.search(r"fork\.py:score:? +100\.0%", r.out), f"not every response was graded 1.0: {r.show()}"


def _tiny_model(ws: Path) -> Path:
    """A tiny local model (byte tokenizer, random weights) in `ws`, built once."""
    if (ws / "tiny" / "config.json").is_file():
        return ws / "tiny"
    code = "import sys; from emapg_cli.models.tiny import save_tiny; save_tiny(sys.argv[1], hidden=16, layers=1, heads=2, kv_heads=1)"
    subprocess.run([sys.executable, "-c", code, str(ws / "tiny")], check=True, cwd=ws, timeout=120, capture_output=True,
                   env=base_env(ws))
    return ws / "tiny"


def _eval_env(ws: Path, env: str, *extra: str) -> tuple[str, ...]:
    return ("eval", "--bench", "b.jsonl", "--model", str(_tiny_model(ws)), "--backend", "hf", "--env", env, "--n", "2",
            "--max-tokens", "4", "--set", "rollout.max_new_tokens=4", "--set", "data.max_prompt_tokens=64", *extra, "--out", "o")


@probe("environment_that_forks_in_step")
def environment_that_forks_in_step(ws: Path) -> None:
    """`emapg eval --env fork.py:Env | tee log` whose step() forks a copy that returns (a second `emapg eval` running
    on from there) and one that sleeps 600 s: the evaluation ends (exit 0) and its output pipes close within a
    minute of it; no forked copy is left (before: 2 per call, holding stdout for 10 minutes)."""
    (ws / "b.jsonl").write_text(BENCH)
    (ws / "fork.py").write_text(FORKING)
    r, _ = _through_a_pipe(ws, *_eval_env(ws, "fork.py:Env"), timeout=240)
    ok(r)
    assert "results in o" in r.out, r.show()


SLOW_IMPORT = "import time\ntime.sleep(3600)\n\n\ndef score(response, example):\n    return 1.0\n"


@probe("reward_plugin_sleeps_at_import", slow=True)
def reward_plugin_sleeps_at_import(ws: Path) -> None:
    """A reward plugin whose module sleeps for an hour when imported: `emapg eval --reward` says so in one line once
    the import deadline (60 s) passes, exit 2, no output folder (it used to hang silently)."""
    (ws / "b.jsonl").write_text(BENCH)
    (ws / "r.jsonl").write_text(RESPONSES)
    (ws / "slow.py").write_text(SLOW_IMPORT)
    one_line_error(emapg(ws, "eval", "--bench", "b.jsonl", "--responses", "r.jsonl", "--reward", "slow.py:score",
                         "--out", "o", timeout=150), "slow.py", "did not finish importing within 60 s")
    assert not (ws / "o").exists(), "an output folder was left behind"


HOOKS = '''import time


class Sleeps:
    max_turns = 1

    def __init__(self, example):
        pass

    def step(self, text):
        return None

    @property
    def invalid(self):
        time.sleep(600)
        return 0


class Raises(Sleeps):
    @property
    def invalid(self):
        raise RuntimeError("no counter here")

'''


@probe("environment_hooks_bounded")
def environment_hooks_bounded(ws: Path) -> None:
    """A user environment whose `invalid` property sleeps 600 s, or raises: `emapg eval --env` stops within
    rollout.env_timeout_s (2 s here) with one line naming `.invalid` (it used to hang: `invalid` was read outside the
    time limit), or names the exception (it was an internal error), exit 2. (A number whose float() sleeps, and a
    __getattr__ that sleeps: tests/test_environments.py.)"""
    (ws / "b.jsonl").write_text(BENCH)
    (ws / "hooks.py").write_text(HOOKS)
    for cls, needle in (("Sleeps", "did not return within rollout.env_timeout_s = 2 s"), ("Raises", "RuntimeError: no counter here")):
        r = emapg(ws, *_eval_env(ws, f"hooks.py:{cls}", "--set", "rollout.env_timeout_s=2"), timeout=180)
        one_line_error(r, f"hooks.py:{cls}.invalid", needle)


RLIMIT = '''import resource


def cap(response, example):
    """1.0 when this worker's address space is capped at EXPECTED MiB."""
    return float(resource.getrlimit(resource.RLIMIT_AS)[0] == EXPECTED << 20)


def hog(response, example):
    return float(len(bytearray(1 << 30)) > 0)  # 1 GiB
'''


@probe("reward_plugin_memory_cap")
def reward_plugin_memory_cap(ws: Path) -> None:
    """A reward plugin's workers run under an address-space cap of their own: 2048 MiB by default, the value of
    reward.plugin_memory_mib when set (the plugin reads its own RLIMIT_AS: it was unlimited); a plugin that takes
    1 GiB under a 256 MiB cap fails every call with MemoryError, which stops the evaluation in one line."""
    (ws / "b.jsonl").write_text(BENCH)
    (ws / "r.jsonl").write_text(RESPONSES)
    for expected, extra in ((2048, ()), (700, ("--set", "reward.plugin_memory_mib=700"))):
        (ws / f"cap{expected}.py").write_text(RLIMIT.replace("EXPECTED", str(expected)))
        r = ok(emapg(ws, "eval", "--bench", "b.jsonl", "--responses", "r.jsonl", "--reward", f"cap{expected}.py:cap",
                     *extra, "--out", f"o{expected}"))
        assert re.search(rf"cap{expected}\.py:cap:? +100\.0%", r.out), f"the workers are not capped at {expected} MiB: {r.show()}"
    one_line_error(emapg(ws, "eval", "--bench", "b.jsonl", "--responses", "r.jsonl", "--reward", "cap2048.py:hog",
                         "--set", "reward.plugin_memory_mib=256", "--out", "hog"), "MemoryError")


MISBEHAVING_AGENT = '''import os
import time


def agent(client, example):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example["question"]}])
    if example["id"] == "0":
        sum(range(10 ** 12))  # spins in C, holding the GIL
    if example["id"] == "1":
        os._exit(0)
    if os.fork() == 0:  # a copy that returns into whatever called the agent
        pass
    if os.fork() == 0:  # and one that stays, holding the inherited stdout
        time.sleep(600)
    return 1.0
'''


@probe("agent_that_spins_exits_or_forks")
def agent_that_spins_exits_or_forks(ws: Path) -> None:
    """`emapg eval --agent a.py:agent | tee log` (n=2) whose agent spins in C on question 0 (it froze the evaluation
    for good: agents ran as threads in emapg's process, holding its GIL), calls os._exit(0) on question 1 (emapg ended
    with exit 0, no results, no line) and forks on question 2 (a copy that returns ran emapg's own code on; one sleeps 600 s): the evaluation ends
    within a minute, exit 0 (reward.max_failure_rate 0.9), one warning line counting the 4 failed episodes, the forked
    episodes scored 1.0, and its output pipes close."""
    (ws / "b.jsonl").write_text(BENCH)
    (ws / "a.py").write_text(MISBEHAVING_AGENT)
    t0 = time.monotonic()
    r, _ = _through_a_pipe(ws, "eval", "--bench", "b.jsonl", "--model", str(_tiny_model(ws)), "--backend", "hf", "--agent",
                           "a.py:agent", "--n", "2", "--max-tokens", "4", "--set", "rollout.agent_timeout_s=5", "--set",
                           "reward.max_failure_rate=0.9", "--set", "rollout.max_new_tokens=4", "--set", "data.max_prompt_tokens=64",
                           "--out", "o", timeout=240)
    ok(r)
    assert time.monotonic() - t0 < 120, f"the evaluation took {time.monotonic() - t0:.0f} s"
    warnings = [x for x in r.err.splitlines() if "failed on" in x]
    assert len(warnings) == 1 and "failed on 4 of 6 episodes" in warnings[0], r.show()
    assert "did not return within rollout.agent_timeout_s = 5 s" in warnings[0], r.show()
