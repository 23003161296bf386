"""Code runs only when the user says so: reward plugins and user environments (issue 20, "Config files run code",
"Plugins checked where it matters"). A plugin named on this command line runs; one named in a config file, a preset
file or a run's saved config.yaml runs only with --trust-code; nothing is imported while a config validates; builtins
and the standard library are refused; a plugin's values are real numbers finite in float32, and one that fails on
more than reward.max_failure_rate of a step's calls stops the run with one line."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from . import probe
from .common import emapg, ok, one_line_error, snapshot

#: A reward file that leaves a marker file next to itself when it is imported (i.e. when its code runs).
MARKER_PLUGIN = '''from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("the plugin ran")


def score(response, example):
    return 1.0
'''

MARKER_ENV = '''from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("the environment ran")


class Env:
    max_turns = 2

    def __init__(self, example):
        pass

    def step(self, text):
        return None
'''

#: Bench and responses for `emapg eval --responses` (grading only: no model).
BENCH = "".join(json.dumps({"id": str(i), "question": f"{i}+{i}", "answers": [str(2 * i)]}) + "\n" for i in range(4))
RESPONSES = "".join(json.dumps({"id": str(i), "responses": ["a", "b"]}) + "\n" for i in range(4))


def _files(ws: Path, **files: str) -> None:
    for name, text in files.items():
        (ws / name).write_text(text)


def _marker_gone(ws: Path) -> None:
    assert not (ws / "IMPORTED").exists(), "the plugin's code ran (its marker file exists)"


@probe("config-show-does-not-import-reward")
def config_show_does_not_import_reward(ws: Path) -> None:
    """A config file names a reward plugin that writes a marker file when imported; `emapg config show --config
    cfg.yaml` prints the config and must not run the plugin (no marker)."""
    _files(ws, **{"plug.py": MARKER_PLUGIN, "cfg.yaml": "rollout:\n  reward: plug.py:score\n"})
    r = ok(emapg(ws, "config", "show", "--config", "cfg.yaml"))
    assert "plug.py:score" in r.out, r.show()
    _marker_gone(ws)


@probe("dry-run-does-not-import-reward")
def dry_run_does_not_import_reward(ws: Path) -> None:
    """`emapg train --preset toy --set rollout.reward=plug.py:score --dry-run`: the plan is printed, the plugin does
    not run (a dry run only reads the file)."""
    _files(ws, **{"plug.py": MARKER_PLUGIN})
    ok(emapg(ws, "train", "--preset", "toy", "--set", "rollout.reward=plug.py:score", "--dry-run"))
    _marker_gone(ws)


@probe("config-show-does-not-import-env")
def config_show_does_not_import_env(ws: Path) -> None:
    """A config file names a user environment (rollout.env=env.py:Env) whose file writes a marker when imported;
    `config show` and `train --dry-run` must not import it."""
    _files(ws, **{"env.py": MARKER_ENV,
                  "cfg.yaml": "rollout:\n  env: env.py:Env\n  max_new_tokens: 16\ndata:\n  max_prompt_tokens: 64\n"})
    ok(emapg(ws, "config", "show", "--config", "cfg.yaml"))
    ok(emapg(ws, "train", "--preset", "toy", "--config", "cfg.yaml", "--dry-run"))
    _marker_gone(ws)


@probe("config-show-sys-exit-at-import")
def config_show_sys_exit_at_import(ws: Path) -> None:
    """A plugin calls sys.exit(7) at import: `config show` never imports it (exit 0), and a run that names it on its
    command line stops with one line saying so (exit 2, not 7)."""
    _files(ws, **{"plug.py": "import sys\nsys.exit(7)\n\ndef score(response, example):\n    return 1.0\n"})
    ok(emapg(ws, "config", "show", "--set", "rollout.reward=plug.py:score"))
    r = emapg(ws, "train", "--preset", "toy", "--set", "rollout.reward=plug.py:score", "--set", "model.path=missing-model",
              "--out", "run")
    one_line_error(r, "plug.py", "sys.exit(7)")
    assert not (ws / "run").exists(), "the run folder was created"


@probe("eval-sys-exit-at-import")
def eval_sys_exit_at_import(ws: Path) -> None:
    """`emapg eval --reward plug.py:score` where plug.py raises SystemExit(7) at import: one line, exit 2."""
    _files(ws, **{"plug.py": "raise SystemExit(7)\ndef score(response, example):\n    return 1.0\n",
                  "bench.jsonl": BENCH, "resp.jsonl": RESPONSES})
    one_line_error(emapg(ws, "eval", "--bench", "bench.jsonl", "--responses", "resp.jsonl", "--reward", "plug.py:score",
                         "--out", "ev"), "sys.exit(7)")


@probe("train-config-file-plugin-needs-trust")
def train_config_file_plugin_needs_trust(ws: Path) -> None:
    """`emapg train --config cfg.yaml` where cfg.yaml names a reward plugin: refused without --trust-code (one line
    naming the file and the flag), the plugin does not run and nothing is written."""
    _files(ws, **{"plug.py": MARKER_PLUGIN, "cfg.yaml": "rollout:\n  reward: plug.py:score\n"})
    before = snapshot(ws)
    r = emapg(ws, "train", "--preset", "toy", "--config", "cfg.yaml", "--out", "run")
    one_line_error(r, "plug.py", "--trust-code")
    _marker_gone(ws)
    assert snapshot(ws) == before, "the workspace changed"


@probe("train-config-file-env-needs-trust")
def train_config_file_env_needs_trust(ws: Path) -> None:
    """`emapg train --config cfg.yaml` where cfg.yaml names a user environment file: refused without --trust-code."""
    _files(ws, **{"env.py": MARKER_ENV,
                  "cfg.yaml": "rollout:\n  env: env.py:Env\n  max_new_tokens: 16\ndata:\n  max_prompt_tokens: 64\n"})
    one_line_error(emapg(ws, "train", "--preset", "toy", "--config", "cfg.yaml", "--out", "run"), "env.py", "--trust-code")
    _marker_gone(ws)


@probe("trust-code-lets-config-file-plugin-run")
def trust_code_lets_config_file_plugin_run(ws: Path) -> None:
    """With --trust-code the config file's plugin is imported when the run starts (the marker appears; the run then
    stops at the missing model with one line)."""
    _files(ws, **{"plug.py": MARKER_PLUGIN, "cfg.yaml": "rollout:\n  reward: plug.py:score\nmodel:\n  path: missing-model\n"})
    one_line_error(emapg(ws, "train", "--preset", "toy", "--config", "cfg.yaml", "--trust-code", "--out", "run"))
    assert (ws / "IMPORTED").exists(), "--trust-code did not let the plugin run"


@probe("resume-edited-config-needs-trust")
def resume_edited_config_needs_trust(ws: Path) -> None:
    """A run's saved config.yaml was edited to name a reward plugin; `emapg train --resume run` refuses without
    --trust-code (one line naming the file), and the plugin does not run."""
    _files(ws, **{"plug.py": MARKER_PLUGIN})
    run = ws / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"rollout:\n  reward: {ws / 'plug.py'}:score\n")
    r = emapg(ws, "train", "--resume", "run")
    one_line_error(r, "plug.py", "--trust-code")
    _marker_gone(ws)


@probe("ablate-config-file-plugin-needs-trust")
def ablate_config_file_plugin_needs_trust(ws: Path) -> None:
    """`emapg ablate --preset toy --config cfg.yaml --grid kl.coef=0,0.1 --dry-run` where cfg.yaml names a plugin:
    refused without --trust-code; with it, each printed `train` line carries --trust-code."""
    _files(ws, **{"plug.py": MARKER_PLUGIN, "cfg.yaml": "rollout:\n  reward: plug.py:score\n"})
    argv = ("ablate", "--preset", "toy", "--config", "cfg.yaml", "--grid", "kl.coef=0,0.1", "--dry-run", "--out", "sw")
    one_line_error(emapg(ws, *argv), "plug.py", "--trust-code")
    r = ok(emapg(ws, *argv, "--trust-code"))
    assert r.out.count("--trust-code") == 2, r.show()
    _marker_gone(ws)


def _refused(ws: Path, ref: str, *needles: str, train: bool = False) -> None:
    one_line_error(emapg(ws, "config", "show", "--set", f"rollout.reward={ref}"), *needles)
    if train:
        one_line_error(emapg(ws, "train", "--preset", "toy", "--set", f"rollout.reward={ref}", "--dry-run"), *needles)


@probe("builtins-exec-refused")
def builtins_exec_refused(ws: Path) -> None:
    """rollout.reward=builtins:exec (it would execute the model's output) is refused with one line."""
    _refused(ws, "builtins:exec", "standard library", train=True)


@probe("builtins-eval-refused")
def builtins_eval_refused(ws: Path) -> None:
    """rollout.reward=builtins:eval is refused with one line."""
    _refused(ws, "builtins:eval", "standard library")


@probe("pty-spawn-refused")
def pty_spawn_refused(ws: Path) -> None:
    """rollout.reward=pty:spawn is refused with one line."""
    _refused(ws, "pty:spawn", "standard library")


@probe("os-system-subprocess-run-refused")
def os_system_subprocess_run_refused(ws: Path) -> None:
    """rollout.reward=os:system, subprocess:run, os.path:join are refused (standard library) with one line."""
    for ref in ("os:system", "subprocess:run", "os.path:join"):
        _refused(ws, ref, "standard library")


@probe("stdlib-file-path-refused")
def stdlib_file_path_refused(ws: Path) -> None:
    """The standard library's own file as a plugin file (…/subprocess.py:run) is refused too."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "subprocess.py"
    _refused(ws, f"{path}:run", "standard library")


@probe("eval-builtins-exec-refused")
def eval_builtins_exec_refused(ws: Path) -> None:
    """`emapg eval --reward builtins:exec` is refused with one line; nothing is written."""
    _files(ws, **{"bench.jsonl": BENCH, "resp.jsonl": RESPONSES})
    before = snapshot(ws)
    one_line_error(emapg(ws, "eval", "--bench", "bench.jsonl", "--responses", "resp.jsonl", "--reward", "builtins:exec",
                         "--out", "ev"), "standard library")
    assert snapshot(ws) == before, "the workspace changed"


@probe("env-stdlib-module-refused")
def env_stdlib_module_refused(ws: Path) -> None:
    """rollout.env=subprocess:Popen (a standard-library class) is refused with one line."""
    one_line_error(emapg(ws, "config", "show", "--set", "rollout.env=subprocess:Popen"), "standard library")


@probe("reward-class-refused")
def reward_class_refused(ws: Path) -> None:
    """A reward that is a class (`class score`) is refused when the config validates, without importing the file."""
    _files(ws, **{"plug.py": MARKER_PLUGIN.replace("def score(response, example):\n    return 1.0", "class score:\n    pass")})
    _refused(ws, "plug.py:score", "is a class")
    _marker_gone(ws)


@probe("reward-reexported-stdlib-function-refused")
def reward_reexported_stdlib_function_refused(ws: Path) -> None:
    """A file that re-exports a standard-library function (`from subprocess import run as score`) passes the static
    check, but the run refuses it when it imports the file (one line, exit 2), before anything is written."""
    _files(ws, **{"plug.py": "from subprocess import run as score\n", "bench.jsonl": BENCH, "resp.jsonl": RESPONSES})
    one_line_error(emapg(ws, "eval", "--bench", "bench.jsonl", "--responses", "resp.jsonl", "--reward", "plug.py:score",
                         "--out", "ev"), "standard library")
    assert not (ws / "ev").exists()


def _eval_plugin(ws: Path, body: str, *extra: str):
    _files(ws, **{"plug.py": f"def score(response, example):\n{body}\n", "bench.jsonl": BENCH, "resp.jsonl": RESPONSES})
    return emapg(ws, "eval", "--bench", "bench.jsonl", "--responses", "resp.jsonl", "--reward", "plug.py:score",
                 "--grader-workers", "1", *extra, "--out", "ev")


@probe("reward-string-refused")
def reward_string_refused(ws: Path) -> None:
    """A plugin returning the string "1.0" does not score 1.0: every call fails, one line naming it, exit 2."""
    one_line_error(_eval_plugin(ws, "    return '1.0'"), "str", "not a number")


@probe("reward-1e39-refused")
def reward_1e39_refused(ws: Path) -> None:
    """A plugin returning 1e39 (finite in float64, inf in float32) fails every call: one line, exit 2."""
    one_line_error(_eval_plugin(ws, "    return 1e39"), "float32")


@probe("reward-none-nan-raise-refused", slow=True)
def reward_none_nan_raise_refused(ws: Path) -> None:
    """Plugins failing on every call (return None, return NaN, raise) stop `emapg eval` with one line naming the
    failure (exit 2), not a score of 0."""
    for body, needle in (("    return None", "NoneType"), ("    return float('nan')", "float32"),
                         ("    raise KeyError('answers')", "KeyError")):
        one_line_error(_eval_plugin(ws, body), needle)


@probe("reward-hang-refused", slow=True)
def reward_hang_refused(ws: Path) -> None:
    """A plugin that hangs past --grader-timeout on 6 of the 8 calls of a batch (75% > 50%): one line saying it timed
    out (exit 2), not a partial score with exit 0."""
    body = "    import time\n    if example['id'] != '3':\n        time.sleep(60)\n    return 1.0"
    one_line_error(_eval_plugin(ws, body, "--grader-timeout", "0.5"), "timed out")


# -------------------------------------------------------------------------- training (a tiny model, 1 step)

def _tiny_train(ws: Path, body: str, *extra: str):
    from emapg_cli.models.tiny import save_tiny

    model = save_tiny(ws / "model", arch="qwen2")
    data = "".join(json.dumps({"id": f"q{i}", "question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(4))
    _files(ws, **{"plug.py": f"def score(response, example):\n{body}\n", "train.jsonl": data})
    sets = {"model.path": model, "data.train": "train.jsonl", "data.eval": "null", "rollout.reward": "plug.py:score",
            "rollout.prompts_per_step": 4, "rollout.n": 3, "rollout.max_new_tokens": 2, "reward.truncated": "grade",
            "train.steps": 1, "train.mini_batch_prompts": 2, "train.micro_batch_size": 6, "kl.coef": 0}
    argv = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    return emapg(ws, "train", *argv, *extra, "--out", "run", timeout=300)


@probe("train-plugin-failing-every-call-stops", slow=True)
def train_plugin_failing_every_call_stops(ws: Path) -> None:
    """A plugin that raises on every call: the run stops at step 1 with one line naming the first exception
    (exit 2), instead of training at reward 0 and exiting 0."""
    line = one_line_error(_tiny_train(ws, "    raise ValueError('no answers key')"), "plug.py", "ValueError: no answers key")
    assert "max_failure_rate" in line, line


@probe("train-plugin-25pct-failing-warns", slow=True)
def train_plugin_25pct_failing_warns(ws: Path) -> None:
    """A plugin failing on the 3 calls of one prompt of 4 (25% < reward.max_failure_rate 0.5) trains on: a warning on
    stderr counting the failures and naming the first, reward/errors = 3 and reward/failure_rate = 0.25 logged."""
    r = ok(_tiny_train(ws, "    if example['id'] == 'q0':\n        raise RuntimeError('flaky')\n    return 1.0"))
    assert "warning: step 1: reward plugin" in r.err and "3 of 12 calls" in r.err and "RuntimeError: flaky" in r.err, r.show()
    rows = [json.loads(x) for x in (ws / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(x for x in rows if x.get("step") == 1)
    assert step["reward/errors"] == 3.0 and step["reward/failure_rate"] == 0.25, step


@probe("bench-step-preset-plugin-needs-trust")
def bench_step_preset_plugin_needs_trust(ws: Path) -> None:
    """`emapg bench step --preset ./x.yaml` where x.yaml names a reward plugin: the steps would import it, so it is
    refused without --trust-code (one line naming the preset file and the flag); the plugin does not run."""
    _files(ws, **{"plug.py": MARKER_PLUGIN, "x.yaml": "name: x\nrollout:\n  reward: plug.py:score\n"})
    one_line_error(emapg(ws, "bench", "step", "--preset", "./x.yaml", "--steps", "1", "--warmup", "0"),
                   "x.yaml", "--trust-code", "rollout.reward")
    _marker_gone(ws)


@probe("train-config-remote-code-needs-trust")
def train_config_remote_code_needs_trust(ws: Path) -> None:
    """`emapg train --config cfg.yaml` where cfg.yaml sets model.trust_remote_code: true (the model's repository
    would run its own Python code): refused without --trust-code, one line naming the key and the file, nothing
    written. Given on the command line (`--set model.trust_remote_code=true`) it is the user's own choice: the run
    goes on (here to the missing model's error)."""
    _files(ws, **{"cfg.yaml": "model:\n  trust_remote_code: true\n"})
    r = emapg(ws, "train", "--preset", "toy", "--config", "cfg.yaml", "--set", "model.path=missing-model", "--out", "run")
    one_line_error(r, "model.trust_remote_code", "cfg.yaml", "--trust-code")
    assert not (ws / "run").exists(), "the run folder was created"
    r = emapg(ws, "train", "--preset", "toy", "--set", "model.trust_remote_code=true", "--set", "model.path=missing-model",
              "--out", "run")
    assert "--trust-code" not in r.err and "missing-model" in r.err, r.show()
    r = emapg(ws, "train", "--preset", "toy", "--config", "cfg.yaml", "--trust-code", "--set", "model.path=missing-model",
              "--out", "run")
    assert "--trust-code" not in r.err and "missing-model" in r.err, r.show()


@probe("bench-step-preset-remote-code-needs-trust")
def bench_step_preset_remote_code_needs_trust(ws: Path) -> None:
    """`emapg bench step --preset ./x.yaml` where x.yaml sets model.trust_remote_code: true: one line, exit 2."""
    _files(ws, **{"x.yaml": "name: x\nmodel:\n  trust_remote_code: true\n"})
    one_line_error(emapg(ws, "bench", "step", "--preset", "./x.yaml", "--steps", "1", "--warmup", "0"),
                   "model.trust_remote_code", "x.yaml")
