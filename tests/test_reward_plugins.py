"""Reward plugins (`rollout.reward = path/to/file.py:fn` or `module:fn`) and the truncation rules,
through the real `emapg train` and `emapg ablate` on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from emapg_cli.config import load_config
from emapg_cli.data.schema import Example
from emapg_cli.errors import UserError
from emapg_cli.rewards import get_reward
from train_helpers import env, tiny_overrides, write_dataset

PLUGIN = '''
def score(response, example):
    """1.0 for every response, except that the item with id q1 raises (scored 0 and counted)."""
    if example["id"] == "q1":
        raise ValueError("no score for q1")
    return 1.0


def slow(response, example):
    import time
    time.sleep(60)
    return 1.0


def nan(response, example):
    return float("nan")
'''


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(PLUGIN)
    return path


def emapg(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "emapg_cli", *args], capture_output=True, text=True, timeout=timeout, env=env())


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_plugin_in_the_pool_counts_raises_timeouts_and_non_numbers(plugin, monkeypatch):
    from emapg_cli.rewards import plugin as plugin_mod

    monkeypatch.setattr(plugin_mod, "PLUGIN_TIMEOUT", 1.0)
    exs = [Example(id=i, question="q", answers=["1"]) for i in ("q0", "q1", "q2")]
    reward = get_reward(f"{plugin}:score")
    try:
        assert reward(["a", "b", "c"], exs) == [1.0, 0.0, 1.0] and reward.errors == 1
    finally:
        reward.close()
    for fn in ("slow", "nan"):
        reward = get_reward(f"{plugin}:{fn}")
        try:
            assert reward(["a"], exs[:1]) == [0.0] and reward.errors == 1, fn
        finally:
            reward.close()


RLIMIT = """import resource


def cap(response, example):
    return resource.getrlimit(resource.RLIMIT_AS)[0] / 2**20  # this worker's address-space cap in MiB
"""


def test_plugin_workers_have_a_memory_cap_of_their_own(tmp_path):
    """Issue 32: a plugin's workers had no cap (the maths graders have 1 GiB). Now reward.plugin_memory_mib (default
    2048) caps each worker's address space: the plugin reads its own RLIMIT_AS."""
    from emapg_cli.rewards.plugin import PLUGIN_MEMORY_MIB

    (tmp_path / "rl.py").write_text(RLIMIT)
    ex = [Example(id="q0", question="q", answers=["1"])]
    for mib, expected in ((None, PLUGIN_MEMORY_MIB), (700, 700)):
        reward = get_reward(f"{tmp_path / 'rl.py'}:cap", workers=1, memory_mib=mib)
        try:
            assert reward(["a"], ex) == [expected] and reward.errors == 0
        finally:
            reward.close()
    assert PLUGIN_MEMORY_MIB == 2048 and load_config().reward.plugin_memory_mib == 2048


def test_plugin_whose_import_hangs_or_needs_more_memory_is_one_line(tmp_path, monkeypatch):
    """Issue 32: a plugin that sleeps at import hung `eval` silently. The import has a deadline (IMPORT_TIMEOUT_S, 0.5 s
    here; 60 s in use); a plugin that forks at import leaves no copy running emapg's code; a plugin whose import
    needs more than the workers' cap stops the grading in one line naming reward.plugin_memory_mib."""
    import os
    import time

    from emapg_cli.rewards import plugin as plugin_mod

    monkeypatch.setattr(plugin_mod, "IMPORT_TIMEOUT_S", 0.5)
    (tmp_path / "sleepy.py").write_text("import time\ntime.sleep(30)\n\ndef score(response, example):\n    return 1.0\n")
    t0 = time.monotonic()
    with pytest.raises(UserError, match="sleepy.py did not finish importing within 0.5 s"):
        plugin_mod.load_plugin(f"{tmp_path / 'sleepy.py'}:score")
    assert time.monotonic() - t0 < 5
    monkeypatch.setattr(plugin_mod, "IMPORT_TIMEOUT_S", 60.0)
    (tmp_path / "forky.py").write_text(f"import os\nif os.fork() == 0:\n    open({str(tmp_path / 'child')!r}, 'w').close()"
                                       "\n\ndef score(response, example):\n    return 1.0\n")
    pid = os.getpid()
    assert plugin_mod.load_plugin(f"{tmp_path / 'forky.py'}:score")("a", {}) == 1.0
    assert os.getpid() == pid  # this is the test process: the forked copy exited when its import returned
    (tmp_path / "big.py").write_text("BLOCK = bytearray(600 << 20)\n\ndef score(response, example):\n    return 1.0\n")
    reward = get_reward(f"{tmp_path / 'big.py'}:score", workers=1, memory_mib=256)  # imported here: no cap in this process
    try:
        with pytest.raises(UserError, match=r"its worker processes cannot start \(.*MemoryError.*reward.plugin_memory_mib = 256 MiB"):
            reward(["a"], [Example(id="q0", question="q", answers=["1"])])
    finally:
        reward.close()


def test_plugin_references_are_checked_at_config_time(plugin, tmp_path):
    cfg = load_config("toy", overrides=[f"rollout.reward={plugin}:score"])
    assert cfg.rollout.reward == f"{plugin.resolve()}:score"
    for ref, msg in ((f"{tmp_path}/none.py:score", "reward plugin file not found"),
                     (f"{plugin}:missing", "no function 'missing'"),
                     ("json:dumps", "standard library"),
                     ("builtins:exec", "standard library"),
                     ("no_such_module_xyz:fn", "not found")):
        with pytest.raises(UserError, match=msg):
            load_config("toy", overrides=[f"rollout.reward={ref}"])
    r = emapg("train", "--preset", "toy", "--set", f"rollout.reward={plugin}:missing", "--dry-run")
    assert r.returncode == 2 and "no function 'missing'" in r.stderr


def test_validation_reads_the_source_and_never_imports_it(tmp_path):
    """check_ref parses the file: a top-level def/class/assignment counts, a class or a def with a signature that
    cannot take (response, example) is refused, and the file's code never runs (it would raise)."""
    from emapg_cli.rewards.plugin import check_ref, static_class_int

    path = tmp_path / "p.py"
    path.write_text("raise SystemExit(7)\n"
                    "def two(response, example): pass\n"
                    "def three(a, b, c): pass\n"  # 3 required positionals: fn(response, example) cannot bind
                    "def star(*args): pass\n"
                    "class K:\n    max_turns = 3\n"
                    "alias = two\n")
    assert check_ref(f"{path}:two") == f"{path.resolve()}:two"
    assert check_ref(f"{path}:star") and check_ref(f"{path}:alias")  # an alias is checked when the run imports it
    for name, msg in (("three", "must accept"), ("K", "is a class"), ("nope", "no function 'nope'")):
        with pytest.raises(UserError, match=msg):
            check_ref(f"{path}:{name}")
    assert check_ref(f"{path}:K", "rollout.env", "class")
    with pytest.raises(UserError, match="is a function"):
        check_ref(f"{path}:two", "rollout.env", "class")
    assert static_class_int(f"{path}:K", "max_turns") == 3 and static_class_int(f"{path}:two", "max_turns") is None


@pytest.mark.parametrize("value, ok", [
    (1, 1.0), (True, 1.0), (0.5, 0.5), (3.4028234663852886e38, 3.4028234663852886e38),
    ("1.0", None), (None, None), (float("nan"), None), (float("inf"), None), (1e39, None), (-1e39, None), ([1.0], None), (10 ** 400, None),
])
def test_reward_values_are_real_numbers_finite_in_float32(value, ok):
    import numpy as np

    from emapg_cli.rewards.plugin import reward_value

    if ok is None:
        with pytest.raises((TypeError, ValueError)):
            reward_value(value)
    else:
        assert reward_value(value) == ok
    assert reward_value(np.float32(2)) == 2.0 and reward_value(np.int64(3)) == 3.0


def test_load_plugin_refuses_what_is_not_a_python_function_of_ours(tmp_path):
    from emapg_cli.rewards.plugin import load_plugin

    path = tmp_path / "q.py"
    path.write_text("import sys\nfrom subprocess import run\nexit_ = sys.exit\nlam = lambda response, example: 1.0\n")
    assert load_plugin(f"{path.resolve()}:lam")("r", {}) == 1.0
    for name, msg in (("run", "standard library"), ("exit_", "not a Python function")):
        with pytest.raises(UserError, match=msg):
            load_plugin(f"{path.resolve()}:{name}")
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.exit(7)\ndef score(response, example): return 1\n")
    with pytest.raises(UserError, match=r"sys.exit\(7\)"):
        load_plugin(f"{bad.resolve()}:score")


def test_trust_rule():
    from emapg_cli.config.trust import named_refs, require_trust

    refs = {"rollout.reward": "/x/p.py:score"}
    require_trust(refs, named_refs(["rollout.reward=/x/p.py:score"]), False)  # named on this command line
    require_trust(refs, {}, True)  # --trust-code
    require_trust({}, {}, False)  # no plugin
    with pytest.raises(UserError, match=r"/x/p.py.*--trust-code"):
        require_trust(refs, named_refs(["rollout.reward=/x/p.py:score", "rollout.reward=math"]), False)  # last wins
    with pytest.raises(UserError, match="--trust-code"):
        require_trust(refs, named_refs(["rollout.reward=/x/other.py:score"]), False)


def test_dry_run_says_the_run_will_need_trust_code(plugin, tmp_path):
    """A --config file naming a reward plugin: the real run refuses it without --trust-code (exit 2), so the dry-run
    (which runs no plugin code) says so in one line; named by --set, or with --trust-code, it says nothing."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"rollout:\n  reward: {plugin}:score\n")
    base = ("train", "--preset", "toy", "--config", str(cfg), "--dry-run")
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda extra: emapg(*base, *extra), ((), ("--trust-code",), ("--set", f"rollout.reward={plugin}:score"))))
    warned, trusted, named = runs
    assert warned.returncode == 0, warned.stderr[-2000:]
    lines = [line for line in warned.stdout.splitlines() if "--trust-code" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: the run will need --trust-code"), warned.stdout[-2000:]
    assert f"{plugin.resolve()}:score" in lines[0] and f"--config {cfg}" in lines[0]
    for r in (trusted, named):
        assert r.returncode == 0 and "--trust-code" not in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_train_cli_logs_the_plugin_reward_and_the_truncation_rules(plugin, tiny_qwen2, tmp_path):
    data = write_dataset(tmp_path / "train.jsonl", n=4)  # 4 prompts per step: every step holds q1
    common = dict(**{"rollout.reward": f"{plugin}:score", "rollout.max_new_tokens": 1, "train.steps": 2, "data.eval": "null"})
    grade = ["train", *tiny_overrides(tiny_qwen2, data, **common, **{"reward.truncated": "grade"}), "--out", str(tmp_path / "a")]
    zero = ["train", *tiny_overrides(tiny_qwen2, data, **common, **{"reward.truncated": "zero", "train.mask_truncated": "true"}),
            "--out", str(tmp_path / "b")]
    with ThreadPoolExecutor(2) as pool:  # two independent runs at once (two cores)
        r, r_zero = pool.map(lambda args: emapg(*args), (grade, zero))
    # reward.truncated=grade: 16 responses, the 4 of q1 raise -> reward/mean = 12 / 16, reward/errors = 4
    assert r.returncode == 0, r.stderr[-2000:]
    row = metrics(tmp_path / "a")[1]
    assert (row["reward/mean"], row["reward/errors"]) == (0.75, 4.0)
    # one token per response: every response hits the cap (no EOS drawn with this seed) ...
    assert row["rollout/truncated_frac"] == 1.0
    # ... so under reward.truncated=zero every reward is 0, and mask_truncated leaves no token in the loss
    assert r_zero.returncode == 0, r_zero.stderr[-2000:]
    row = metrics(tmp_path / "b")[1]
    assert (row["reward/mean"], row["rollout/truncated_frac"], row["loss/pg"], row["entropy"]) == (0.0, 1.0, 0.0, 0.0)


@pytest.mark.slow  # a sweep of real trainings, ~25 s (CI budget)
def test_ablate_runs_the_plugin_in_each_run(plugin, tiny_qwen2, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative plugin path, as a user would type it
    data = write_dataset(tmp_path / "train.jsonl", n=4)
    out = tmp_path / "sweep"
    opts = tiny_overrides(tiny_qwen2, data, **{"rollout.reward": "my_reward.py:score", "train.steps": 1, "data.eval": "null",
                                               "train.save_every": 0})
    r = emapg("ablate", "--preset", "toy", "--grid", "reward.truncated=zero,grade", *opts, "--jobs", "1", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for mode in ("zero", "grade"):
        row = metrics(out / "runs" / f"reward.truncated={mode}" / "seed0")[1]
        assert row["reward/errors"] == 4.0 and 0.0 <= row["reward/mean"] <= 0.75


def test_step_failure_rate_stops_above_max_failure_rate_and_warns_below(capsys):
    """reward_failures counts the step's calls since start_count(): 6 of 10 failed (60% > 0.5) stops the run naming
    the first failure; 5 of 10 (50%, not above 0.5) warns once on stderr and logs reward/failure_rate 0.5."""
    from types import SimpleNamespace

    from emapg_cli.rewards.registry import SafeReward
    from emapg_cli.train.rollout import reward_failures

    def fn(responses, examples):  # raises for every response "bad": SafeReward scores it 0 and counts it
        if any(r == "bad" for r in responses):
            raise ValueError(f"bad response {len(responses)}")
        return [1.0] * len(responses)

    cfg = SimpleNamespace(
        rollout=SimpleNamespace(reward="p.py:score"), reward=SimpleNamespace(max_failure_rate=0.5))
    reward = SafeReward("p.py:score", fn)
    counted = reward.start_count()
    reward(["ok"] * 4 + ["bad"] * 6, [{}] * 10)
    with pytest.raises(UserError, match=r"failed on 6 of 10 calls.*first failure: ValueError: bad response 1"):
        reward_failures(reward, counted, cfg, 3)
    counted = reward.start_count()
    reward(["ok"] * 5 + ["bad"] * 5, [{}] * 10)
    assert reward_failures(reward, counted, cfg, 4) == {"reward/failure_rate": 0.5}
    assert "warning: step 4: reward plugin p.py:score failed on 5 of 10 calls (50%" in capsys.readouterr().err
    cfg.rollout.reward = "math"  # a registered reward: not a plugin, not counted here
    assert reward_failures(reward, reward.start_count(), cfg, 5) == {}


def test_a_steps_timeouts_are_logged_for_rewards_scoring_in_workers():
    """reward/timeouts: the calls a pooled reward (a plugin's, reasoning-gym's) cut at its time limit since the step's
    start_count(), for a registered reward too (issue 40: a hung scorer scores 0 and is counted); none for a reward
    without workers. Here the pool's count goes 2 -> 5 during the step: 3 timeouts logged."""
    from types import SimpleNamespace

    from emapg_cli.rewards.registry import SafeReward
    from emapg_cli.train.rollout import reward_failures

    class Pooled:
        timeouts = 2

        def __call__(self, responses, examples):
            Pooled.timeouts += 3  # three of this batch's calls ran past the limit (scored 0 by the pool)
            return [0.0] * len(responses)

    cfg = SimpleNamespace(rollout=SimpleNamespace(reward="reasoning-gym"), reward=SimpleNamespace(max_failure_rate=0.5))
    reward = SafeReward("reasoning-gym", Pooled())
    counted = reward.start_count()
    reward(["a"] * 4, [{}] * 4)
    assert reward_failures(reward, counted, cfg, 1) == {"reward/timeouts": 3.0}
    plain = SafeReward("math", lambda r, e: [1.0] * len(r))
    assert reward_failures(plain, plain.start_count(), cfg, 1) == {}
