"""The malformed-input corpus of the fault-injection suite (tests/test_fuzz_cli.py).

Every case is one `emapg` command line that must fail as bad input: exit code 2, one line on
stderr, no traceback, and the workspace (inputs and prior outputs) unchanged. A case runs in a
fresh copy of the workspace that `build_workspace` makes: valid inputs (a bench, responses, a
config), prior outputs of every command (each with its `.emapg.json` marker), a foreign folder,
a plain file, and a prepared dataset in `home/` (the EMAPG_HOME of the run). Paths in a case's
argv are relative to the workspace (the working directory of the run).

Cases come from hand-written lists (one per command: malformed files, wrong types, out-of-range
values, unknown keys, bad paths, unicode oddities, Rich markup, huge values) and from generators:
a type-wrong value for every config key (through --set, a --config file, a --grid axis), and a
seeded mutator of JSONL input rows (`generated`, used by the slow randomised test).

`owner`: a case known to fail because of another part of issue 9 (marked xfail(strict=False) with
that reason, so it turns green, and can be flipped to a plain case, once that part is merged).

Run `python tests/fuzz_corpus.py` to print the number of cases per command.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

COMMANDS = ("prepare", "train", "eval", "ablate", "kl-check", "config", "retriever", "rollout", "bench")
FileContent = Union[str, bytes]


@dataclass(frozen=True)
class Case:
    command: str  # one of COMMANDS (the first word of argv, `config` for `config show`)
    name: str
    argv: tuple[str, ...]
    files: tuple[tuple[str, FileContent], ...] = ()  # written into the workspace before the run
    owner: Optional[str] = None  # another helper's defect: xfail(strict=False, reason=owner)

    @property
    def id(self) -> str:
        return f"{self.command}:{self.name}"


def case(command: str, name: str, *argv: str, files: Optional[dict[str, FileContent]] = None, owner: Optional[str] = None) -> Case:
    files = dict(files or {})
    for rel in [r for r in files if r.endswith(".emapg.json")]:  # an emapg output folder holds its lock file
        files.setdefault(rel.replace(".emapg.json", ".emapg.lock"), "")
    return Case(command, name, tuple(argv), tuple(files.items()), owner)


# ----------------------------------------------------------------------------------- the workspace

BENCH_ROWS = [{"id": str(i), "question": f"What is {i}+{i}?", "answers": [str(2 * i)], "source": "fuzz", "meta": {}}
              for i in range(5)]
RESPONSE_ROWS = [{"id": r["id"], "responses": [f"\\boxed{{{r['answers'][0]}}}", "\\boxed{0}"]} for r in BENCH_ROWS]


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def marker(command: str) -> str:
    return json.dumps({"command": command, "config_sha256": "0" * 64, "emapg_version": "0.1.0"}) + "\n"


def build_workspace(root: Path) -> Path:
    """The template every case starts from (see the module doc)."""
    from emapg_cli.config import Config
    from emapg_cli.config.loading import to_yaml

    files: dict[str, FileContent] = {
        "bench.jsonl": jsonl(BENCH_ROWS),
        "resp.jsonl": jsonl(RESPONSE_ROWS),
        "good.yaml": "name: fuzz\ntrain:\n  steps: 2\n",
        "afile": "a plain file\n",
        "foreign/notes.txt": "someone else's folder\n",
        "trainrun/.emapg.json": marker("train"),
        "trainrun/config.yaml": to_yaml(Config(name="fuzzrun")),
        "trainrun/metrics.jsonl": '{"step": 0}\n',
        "trainrun/checkpoints/step_1/state.json": '{"step": 1}\n',
        "evalrun/.emapg.json": marker("eval"),
        "evalrun/run.json": json.dumps({"bench": "bench.jsonl", "model": None, "n": 32}) + "\n",
        "evalrun/results.jsonl": jsonl([{"id": "0", "responses": ["\\boxed{0}"], "extracted": ["0"], "correct": [True]}]),
        "evalrun/summary.json": "{}\n",
        "ablaterun/.emapg.json": marker("ablate"),
        "ablaterun/study.yaml": "name: fuzz\npreset: toy\nseeds: 1\n",
        "home/data/ds1/.emapg.json": marker("prepare"),
        "home/data/ds1/data.jsonl": jsonl(BENCH_ROWS),
        "home/data/ds1/manifest.json": json.dumps({"name": "ds1", "rows": 5}) + "\n",
    }
    for rel in [r for r in files if r.endswith("/.emapg.json")]:  # every emapg output folder holds its lock file
        files[rel.replace(".emapg.json", ".emapg.lock")] = ""
    for rel, content in files.items():
        write(root, rel, content)
    (root / "emptydir").mkdir()
    return root


def write(root: Path, rel: str, content: FileContent) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", errors="surrogatepass")


# ------------------------------------------------------------------------ strings that break things

#: Odd strings used as names, paths and values: Rich markup, unicode oddities, shell-ish text.
ODD_STRINGS = [
    "[/]", "[/bold]", "[bold red]x", "x[/]y", "[link=file:///etc/passwd]x[/link]", "\u202ertl", "\u200b",
    "e\u0301", "\U0001f600", "ﬁ", "..", "-", "--", "a b", "$(touch pwned)", "`id`", "%s%n", "{0}", "\\",
]

BAD_YAML = {
    "tab": "name:\n\t- x\n",
    "unclosed": "train: {steps: 3\n",
    "list": "- a\n- b\n",
    "scalar": "42\n",
    "string": "just text\n",
    "badindent": "train:\n  steps: 3\n   seed: 1\n",
    "anchor_bomb": "a: &a [1, 2]\nb: *a\nname: *a\n",
    "unknown_top": "nonsense: 1\n",
    "unknown_nested": "train:\n  nonsense: 1\n",
    "wrong_section_type": "train: 5\n",
    "wrong_leaf_type": "train:\n  steps: many\n",
    "negative_steps": "train:\n  steps: -3\n",
    "python_tag": "name: !!python/object/apply:os.system ['echo pwned']\n",
    "binary": b"\x00\x01\x02\xff\xfe",
    "huge_int": "train:\n  steps: " + "9" * 400 + "\n",
    "markup_name": "name: '[/bold]'\nmodel:\n  path: '[red]x'\n",
}

#: BAD_YAML entries that are a valid config (a huge step count, a markup name): they fail only when
#: a command uses them, not in `config show`.
VALID_CONFIG_YAML = ("huge_int", "markup_name")

#: BAD_JSONL entries that are an error for `eval` (a strict bench reader) but that `prepare` converts
#: (it drops what it cannot use; "answers": 5 is read as the answer "5").
PREPARE_ACCEPTS = ("answers_number",)

BAD_JSONL = {
    "not_json": "this is not json\n{\"id\": 1}\n",
    "array_row": "[1, 2, 3]\n",
    "number_row": "42\n",
    "string_row": "\"text\"\n",
    "null_row": "null\n",
    "truncated_mid": '{"id": "0", "question": "x", "answ\n{"id": "1", "question": "y", "answers": ["1"]}\n',
    "empty_object": "{}\n",
    "no_question": '{"id": "0", "answers": ["1"]}\n',
    "answers_number": '{"id": "0", "question": "x", "answers": 5, "bad": {}}\n' * 2,
    "deep_nesting": '{"id": "0", "question": ' + "[" * 5000 + "]" * 5000 + "}\n",
}

#: Malformed JSONL the shared reader (emapg_cli.data.schema.read_jsonl) does not yet turn into a
#: one-line error: nesting deeper than the JSON parser's recursion limit.
INPUT_READER_OWNER: dict[str, str] = {}

BAD_RESPONSES = {
    "not_json": "garbage\n",
    "array_row": "[1]\n",
    "no_id": '{"responses": ["a"]}\n',
    "responses_string": '{"id": "0", "responses": "\\\\boxed{0}"}\n',
    "responses_numbers": '{"id": "0", "responses": [1, 2]}\n',
    "responses_dict": '{"id": "0", "responses": {"a": 1}}\n',
    "unknown_id": '{"id": "nope", "responses": ["x"]}\n',
    "empty_file": "",
    "only_blank": "\n\n\n",
    "truncated": '{"id": "0", "respon',
}


# ---------------------------------------------------------------------------------------- config

def _bad_values(key: str, default) -> list[str]:
    """`--set` values of the wrong type for `key` (typed by its default); never valid by construction."""
    if isinstance(default, bool):
        return ["maybe", "[1, 2]"]
    if isinstance(default, int):
        return ["many", "[1]", "1.5x"]
    if isinstance(default, float):
        return ["fast", "{a: 1}", "[0.1]"]
    if isinstance(default, (list, tuple)):
        return ["{a: 1}", "nope"] if key != "rollout.stop" else ["{a: 1}", "[[1, 2]]"]
    # str and Optional[...] keys: a mapping and a list are never a str, a path or an int
    return ["{a: 1}", "[1, [2]]"]


def config_keys() -> list[tuple[str, object]]:
    from emapg_cli.cli.config_cmd import iter_keys
    from emapg_cli.config import Config

    return [(k, default) for k, _, default in iter_keys(Config)]


def config_cases() -> list[Case]:
    cases = []
    for key, default in config_keys():
        for i, value in enumerate(_bad_values(key, default)[:2]):
            cases.append(case("config", f"set-{key}-{i}", "config", "show", "--set", f"{key}={value}"))
    cases += [
        case("config", "set-no-equals", "config", "show", "--set", "kl.k"),
        case("config", "set-empty-key", "config", "show", "--set", "=3"),
        case("config", "set-unknown-key", "config", "show", "--set", "nonsense=1"),
        case("config", "set-unknown-nested", "config", "show", "--set", "kl.nonsense=1"),
        case("config", "set-too-deep", "config", "show", "--set", "kl.k.x=1"),
        case("config", "set-section", "config", "show", "--set", "kl=3"),
        case("config", "set-markup-key", "config", "show", "--set", "[/bold]=1"),
        case("config", "set-huge-k", "config", "show", "--set", "kl.k=" + "9" * 5000),
        case("config", "set-negative-steps", "config", "show", "--set", "train.steps=-1"),
        case("config", "set-zero-n", "config", "show", "--set", "rollout.n=0"),
        case("config", "set-temperature-neg", "config", "show", "--set", "rollout.temperature=-1"),
        case("config", "set-decay-2", "config", "show", "--set", "ema.decay=2"),
        case("config", "set-betas-2-3", "config", "show", "--set", "optim.betas=[2,3]"),
        case("config", "set-lr-inf", "config", "show", "--set", "optim.lr=.inf"),
        case("config", "set-eps-inf", "config", "show", "--set", "optim.eps=.inf"),
        case("config", "set-coef-nan", "config", "show", "--set", "kl.coef=.nan"),
        case("config", "preset-missing", "config", "show", "--preset", "no-such-preset"),
        case("config", "preset-markup", "config", "show", "--preset", "[/bold]"),
        case("config", "preset-dir", "config", "show", "--preset", "emptydir"),
        case("config", "config-missing", "config", "show", "--config", "missing.yaml"),
        case("config", "config-dir", "config", "show", "--config", "emptydir"),
        case("config", "duplicate-keys", "config", "show", "--config", "dup.yaml", files={"dup.yaml": "name: a\nname: b\n"}),
        case("config", "unknown-subcommand", "config", "frobnicate"),
        case("config", "unknown-option", "config", "show", "--frobnicate"),
    ]
    for name, text in BAD_YAML.items():
        if name in VALID_CONFIG_YAML:
            continue
        cases.append(case("config", f"yaml-{name}", "config", "show", "--config", "bad.yaml", files={"bad.yaml": text}))
        cases.append(case("config", f"preset-yaml-{name}", "config", "show", "--preset", "badpreset.yaml",
                          files={"badpreset.yaml": text}))
    # issue 20 (readers): lora.r bounded at config time
    cases.append(case("config", "set-lora-r-million", "config", "show", "--set", "lora.r=1000000"))
    # issue 23 (LoRA with vLLM): lora.sync is adapter | merged; adapters vLLM loads have rank <= 512
    cases += [
        case("config", "set-lora-sync-bogus", "config", "show", "--set", "lora.sync=bogus"),
        case("config", "set-lora-sync-empty", "config", "show", "--set", "lora.sync="),
        case("config", "set-lora-sync-adapter-rank-over-vllm", "config", "show", "--set", "rollout.engine=vllm",
             "--set", "lora.r=1024", "--set", "lora.sync=adapter"),
        case("train", "lora-sync-bogus", "train", "--config", "good.yaml", "--set", "lora.r=2", "--set", "lora.sync=[merged]",
             "--dry-run"),
    ]
    # issue 21 (adaptive beta): kl.target > 0 and finite, with kl.coef > 0; kl.horizon >= 1 and > responses per step / 5
    cases += [
        case("config", "set-kl-target-zero", "config", "show", "--set", "kl.target=0"),
        case("config", "set-kl-target-negative", "config", "show", "--set", "kl.target=-0.1"),
        case("config", "set-kl-target-inf", "config", "show", "--set", "kl.target=.inf"),
        case("config", "set-kl-target-text", "config", "show", "--set", "kl.target=high"),
        case("config", "set-kl-target-no-coef", "config", "show", "--set", "kl.target=0.1", "--set", "kl.coef=0"),
        case("config", "set-kl-horizon-zero", "config", "show", "--set", "kl.target=0.1", "--set", "kl.horizon=0"),
        case("config", "set-kl-horizon-float", "config", "show", "--set", "kl.horizon=2.5"),
        case("config", "set-kl-horizon-short", "config", "show", "--set", "kl.target=0.1", "--set", "kl.horizon=10"),
    ]
    # issue 22 (distillation as a run): train.objective, which needs kl.coef > 0
    cases += [
        case("config", "set-objective-unknown", "config", "show", "--set", "train.objective=sft"),
        case("config", "set-objective-list", "config", "show", "--set", "train.objective=[distill]"),
        case("config", "set-objective-distill-no-coef", "config", "show", "--set", "train.objective=distill", "--set", "kl.coef=0"),
        case("config", "set-objective-both-no-coef", "config", "show", "--set", "train.objective=rl+distill", "--set", "kl.coef=0"),
        case("config", "set-filter-groups-removed", "config", "show", "--set", "train.filter_groups=true"),
    ]
    # issue 21 (adaptive eta): ema.target_distance, ema.decay_min/max (and the removed ema.decay_schedule)
    cases += [
        case("config", "set-target-distance-zero", "config", "show", "--set", "ema.target_distance=0"),
        case("config", "set-target-distance-nan", "config", "show", "--set", "ema.target_distance=.nan"),
        case("config", "set-decay-min-above-max", "config", "show", "--set", "ema.decay_min=0.9", "--set", "ema.decay_max=0.8"),
        case("config", "set-decay-max-two", "config", "show", "--set", "ema.decay_max=2"),
        case("config", "set-target-frozen-start", "config", "show", "--set", "ema.target_distance=0.01", "--set", "ema.decay=1.0"),
        case("config", "set-target-max-one", "config", "show", "--set", "ema.target_distance=0.01", "--set", "ema.decay_max=1"),
        case("config", "set-schedule-removed", "config", "show", "--set", "ema.decay_schedule=[{steps: 5, decay: 0.9}]"),
    ]
    # issue 22 (a teacher as the anchor): anchor.source / path / dtype, kl.topk_from
    cases += [
        case("config", "set-anchor-source-unknown", "config", "show", "--set", "anchor.source=policy"),
        case("config", "set-anchor-teacher-no-path", "config", "show", "--set", "anchor.source=teacher"),
        case("config", "set-anchor-path-with-ema", "config", "show", "--set", "anchor.path=teacher"),
        case("config", "set-anchor-dtype-with-ema", "config", "show", "--set", "anchor.dtype=bfloat16"),
        # issue 33: the training reward's credit
        case("config", "set-reward-credit-unknown", "config", "show", "--set", "reward.credit=half"),
        case("config", "set-reward-credit-list", "config", "show", "--set", "reward.credit=[solved]"),
        case("config", "set-anchor-dtype-unknown", "config", "show", "--set", "anchor.source=teacher",
             "--set", "anchor.path=teacher", "--set", "anchor.dtype=int8"),
        case("config", "set-anchor-teacher-no-coef", "config", "show", "--set", "anchor.source=teacher",
             "--set", "anchor.path=teacher", "--set", "kl.coef=0"),
        case("config", "set-anchor-teacher-target-distance", "config", "show", "--set", "anchor.source=teacher",
             "--set", "anchor.path=teacher", "--set", "ema.target_distance=0.01"),
        case("config", "set-anchor-teacher-lora", "config", "show", "--set", "anchor.source=teacher",
             "--set", "anchor.path=teacher", "--set", "lora.r=4"),
        case("config", "set-anchor-section", "config", "show", "--set", "anchor=teacher"),
        case("config", "set-topk-from-unknown", "config", "show", "--set", "kl.topk_from=policy"),
        case("config", "set-topk-from-list", "config", "show", "--set", "kl.topk_from=[anchor]"),
        case("config", "set-support-renorm-not-bool", "config", "show", "--set", "kl.support_renorm=maybe"),
        case("config", "set-support-renorm-wrong-estimator", "config", "show", "--set", "kl.support_renorm=false"),
    ]
    return cases


# ------------------------------------------------------------------------------------------- train

#: Broken user environments (rollout.env=FILE.py:Class, emapg eval --env): each must be one line at launch.
BAD_ENVS = {
    "env-not-a-class": "Env = 3\n",
    "env-no-step": "class Env:\n    def __init__(self, example): pass\n",
    "env-max-turns-zero": "class Env:\n    max_turns = 0\n    def __init__(self, example): pass\n    def step(self, text): return None\n",
    "env-max-turns-text": "class Env:\n    max_turns = 'many'\n    def __init__(self, example): pass\n    def step(self, text): return None\n",
    "env-stop-string": "class Env:\n    stop = '</x>'\n    def __init__(self, example): pass\n    def step(self, text): return None\n",
    "env-stop-empty": "class Env:\n    stop = ['']\n    def __init__(self, example): pass\n    def step(self, text): return None\n",
    "env-template-no-question": "class Env:\n    template = 'hi'\n    def __init__(self, example): pass\n    def step(self, text): return None\n",
    "env-syntax-error": "class Env(:\n",
    "env-import-raises": "raise RuntimeError('boom')\n",
}


def env_cases(command: str, *base: str) -> list[Case]:
    """Bad environment references and broken environment classes, through `base` (argv up to the env option)."""
    good = "class Env:\n    def __init__(self, example): pass\n    def step(self, text): return None\n"
    refs = {"unknown": "nosuchenv", "empty": "", "markup": "[/bold]:X", "file-missing": "nofile.py:Env", "dir": "emptydir:Env",
            "no-class": "envfile.py:Absent", "module-missing": "no_such_mod_xyz:Env"}
    broken = {name: ("envfile.py:Env", text) for name, text in BAD_ENVS.items()}
    cases = {**{name: (value, good) for name, value in refs.items()}, **broken}
    opt = ("--set", "rollout.env={}") if command == "train" else ("--env", "{}")
    tail = ("--out", "new")  # train: not --dry-run, which imports nothing (a class is loaded when the run starts)
    return [case(command, f"env-{name}" if not name.startswith("env-") else name, *base, opt[0], opt[1].format(value), *tail,
                 files={"envfile.py": text}) for name, (value, text) in cases.items()]


#: Broken agents (rollout.agent=FILE.py:fn, emapg eval --agent; issue 36): each must be one line at launch.
BAD_AGENTS = {
    "agent-not-a-function": "agent = 3\n",
    "agent-a-class": "class agent:\n    pass\n",
    "agent-one-argument": "def agent(client):\n    return 1.0\n",
    "agent-async": "async def agent(client, example):\n    return 1.0\n",
    "agent-syntax-error": "def agent(:\n",
    "agent-import-raises": "raise RuntimeError('boom')\n",
    "agent-sys-exit-at-import": "import sys\nsys.exit(7)\n",
}


def agent_cases(command: str, *base: str) -> list[Case]:
    """Bad agent references and broken agent files, through `base` (argv up to the agent option)."""
    refs = {"file-missing": "nofile.py:agent", "no-colon": "agentfile.py", "dir": "emptydir:agent", "no-function": "agentfile.py:absent",
            "stdlib": "os:system", "builtin": "builtins:exec", "module-missing": "no_such_mod_xyz:agent", "markup": "[/bold]:x"}
    good = "def agent(client, example):\n    return 1.0\n"
    cases = {**{f"agent-{name}": (value, good) for name, value in refs.items()},
             **{name: ("agentfile.py:agent", text) for name, text in BAD_AGENTS.items()}}
    opt = ("--set", "rollout.agent={}") if command == "train" else ("--agent", "{}")
    return [case(command, name, *base, opt[0], opt[1].format(value), "--out", "new", files={"agentfile.py": text})
            for name, (value, text) in cases.items()]


def train_cases() -> list[Case]:
    keys = config_keys()
    cases = []
    for key, default in keys:  # one type-wrong value per key, through --set and through a --config file
        value = _bad_values(key, default)[-1]
        cases.append(case("train", f"set-{key}", "train", "--set", f"{key}={value}"))
    for key, default in keys[::3]:
        section, _, leaf = key.partition(".")
        value = _bad_values(key, default)[0]
        text = f"{section}:\n  {leaf}: {value}\n" if leaf else f"{section}: {value}\n"
        cases.append(case("train", f"file-{key}", "train", "--config", "bad.yaml", "--dry-run", files={"bad.yaml": text}))
    for name, text in BAD_YAML.items():
        cases.append(case("train", f"yaml-{name}", "train", "--config", "bad.yaml", files={"bad.yaml": text}))
    cases += env_cases("train", "train", "--config", "good.yaml")
    cases += agent_cases("train", "train", "--config", "good.yaml")
    agent = {"agentfile.py": "def agent(client, example):\n    return 1.0\n"}
    cases += [case("train", f"agent-{name}", "train", "--config", "good.yaml", "--set", "rollout.agent=agentfile.py:agent",
                   *sets, "--out", "new", files={**agent, **extra})
              for name, sets, extra in (
                  ("with-env", ("--set", "rollout.env=calc"), {}), ("with-search", ("--set", "search.enabled=true"), {}),
                  ("max-calls-zero", ("--set", "rollout.agent_max_calls=0"), {}),
                  ("max-tokens-zero", ("--set", "rollout.agent_max_tokens=0"), {}),
                  ("timeout-zero", ("--set", "rollout.agent_timeout_s=0"), {}),
                  ("workers-zero", ("--set", "rollout.agent_workers=0"), {}))]
    cases.append(case("train", "agent-in-config-untrusted", "train", "--config", "agentcfg.yaml", "--out", "new",
                      files={**agent, "agentcfg.yaml": "rollout:\n  agent: agentfile.py:agent\n"}))
    cases += [
        case("train", "moved-max-turns", "train", "--config", "good.yaml", "--set", "rollout.max_turns=4", "--dry-run"),
        case("train", "objective-distill-no-coef", "train", "--config", "good.yaml", "--set", "train.objective=distill",
             "--set", "kl.coef=0", "--dry-run"),
        case("train", "env-contradicts-search", "train", "--config", "good.yaml", "--set", "search.enabled=true",
             "--set", "rollout.env=calc", "--dry-run"),
        case("train", "env-timeout-zero", "train", "--config", "good.yaml", "--set", "rollout.env_timeout_s=0", "--dry-run"),
        # issue 32: a time limit past a week (Python's waits overflow near 1e13 s) is refused at config time, by key
        case("train", "env-timeout-huge", "train", "--config", "good.yaml", "--set", "rollout.env_timeout_s=1e13", "--dry-run"),
        case("train", "search-timeout-huge", "train", "--config", "good.yaml", "--set", "search.timeout_s=1e300", "--dry-run"),
        case("train", "search-backoff-huge", "train", "--config", "good.yaml", "--set", "search.backoff_s=1e9", "--dry-run"),
        case("train", "search-retries-backoff-overflow", "train", "--config", "good.yaml", "--set", "search.retries=200", "--dry-run"),
        case("train", "plugin-memory-negative", "train", "--config", "good.yaml", "--set", "reward.plugin_memory_mib=-1", "--dry-run"),
        case("train", "async-no-engine-url", "train", "--config", "good.yaml", "--set", "rollout.max_staleness=1", "--dry-run"),
        case("train", "async-engine-old-logprobs", "train", "--config", "good.yaml", "--set", "rollout.max_staleness=1",
             "--set", "rollout.engine_url=http://127.0.0.1:9", "--set", "train.old_logprobs=engine", "--dry-run"),
        case("train", "async-negative-staleness", "train", "--config", "good.yaml", "--set", "rollout.max_staleness=-1", "--dry-run"),
        # issue 32: what cannot train, refused in one line (train and --dry-run)
        case("train", "float16", "train", "--config", "good.yaml", "--set", "model.dtype=float16"),
        case("train", "float16-dry-run", "train", "--config", "good.yaml", "--set", "model.dtype=float16", "--dry-run"),
        case("train", "teacher-support-raw", "train", "--config", "good.yaml", "--set", "anchor.source=teacher",
             "--set", "anchor.path=emptydir", "--set", "kl.topk_from=anchor", "--set", "kl.estimator=teacher_support_raw", "--dry-run"),
        case("train", "support-renorm-false", "train", "--config", "good.yaml", "--set", "anchor.source=teacher",
             "--set", "anchor.path=emptydir", "--set", "kl.topk_from=anchor", "--set", "kl.estimator=teacher_support",
             "--set", "kl.support_renorm=false", "--dry-run"),
        case("train", "async-vllm-nucleus-no-correction", "train", "--config", "good.yaml", "--set", "rollout.max_staleness=1",
             "--set", "rollout.engine_url=http://127.0.0.1:9", "--set", "rollout.engine=vllm", "--set", "rollout.temperature=0.7",
             "--set", "rollout.top_p=0.9", "--dry-run"),
        case("train", "anchor-teacher-no-path", "train", "--config", "good.yaml", "--set", "anchor.source=teacher", "--dry-run"),
        case("train", "anchor-teacher-lora", "train", "--config", "good.yaml", "--set", "anchor.source=teacher",
             "--set", "anchor.path=emptydir", "--set", "lora.r=2", "--dry-run"),
        case("train", "out-is-file", "train", "--config", "good.yaml", "--out", "afile"),
        case("train", "out-under-file", "train", "--config", "good.yaml", "--out", "afile/run"),
        case("train", "out-foreign", "train", "--config", "good.yaml", "--out", "foreign"),
        # the reproduction: a user's folder with a config.yaml and a metrics.jsonl but no checkpoints
        case("train", "out-foreign-config-metrics", "train", "--config", "good.yaml", "--set", "model.path=emptydir",
             "--out", "mine", files={"mine/config.yaml": "name: mine\n", "mine/metrics.jsonl": '{"step": 7}\n'}),
        case("train", "out-eval-run", "train", "--config", "good.yaml", "--out", "evalrun"),
        case("train", "out-ablate-run", "train", "--config", "good.yaml", "--out", "ablaterun"),
        case("train", "out-existing-run", "train", "--config", "good.yaml", "--out", "trainrun"),
        case("train", "out-markup-no-model", "train", "--config", "good.yaml", "--out", "runs/x[/]"),
        case("train", "out-prepared-dataset", "train", "--config", "good.yaml", "--out", "home/data/ds1"),
        case("train", "no-model", "train", "--config", "good.yaml", "--out", "newrun"),
        case("train", "model-missing", "train", "--config", "good.yaml", "--set", "model.path=missing-model", "--out", "newrun"),
        case("train", "model-is-file", "train", "--config", "good.yaml", "--set", "model.path=afile", "--out", "newrun"),
        case("train", "data-missing", "train", "--config", "good.yaml", "--set", "model.path=emptydir",
             "--set", "data.train=missing.jsonl", "--out", "newrun"),
        case("train", "resume-missing", "train", "--resume", "nowhere"),
        case("train", "resume-file", "train", "--resume", "afile"),
        case("train", "resume-foreign", "train", "--resume", "foreign"),
        case("train", "resume-eval-run", "train", "--resume", "evalrun"),
        case("train", "resume-with-preset", "train", "--resume", "trainrun", "--preset", "toy"),
        case("train", "resume-with-out", "train", "--resume", "trainrun", "--out", "elsewhere"),
        case("train", "resume-bad-set", "train", "--resume", "trainrun", "--set", "optim.betas=[2,3]"),
        case("train", "resume-set-unknown", "train", "--resume", "trainrun", "--set", "nonsense=1"),
        case("train", "resume-add-anchor", "train", "--resume", "noanchor", "--set", "kl.coef=0.01",
             files={"noanchor/.emapg.json": marker("train"), "noanchor/config.yaml": "kl:\n  coef: 0.0\n",
                    "noanchor/checkpoints/step_1/state.json": "{}\n"}),
        case("train", "resume-corrupt-config", "train", "--resume", "badrun",
             files={"badrun/.emapg.json": marker("train"), "badrun/config.yaml": "train: {steps: [\n",
                    "badrun/checkpoints/step_1/state.json": "{}\n"}),
        case("train", "resume-corrupt-marker", "train", "--resume", "badmarker",
             files={"badmarker/.emapg.json": "{not json", "badmarker/config.yaml": "name: x\n"}),
        case("train", "processes-without-dry-run", "train", "--config", "good.yaml", "--processes", "2", "--out", "newrun"),
        case("train", "processes-zero", "train", "--config", "good.yaml", "--dry-run", "--processes", "0"),
        case("train", "preset-missing", "train", "--preset", "no-such-preset"),
        case("train", "preset-and-markup", "train", "--preset", "[bold]x"),
        case("train", "unknown-option", "train", "--frobnicate"),
        case("train", "name-absolute", "train", "--config", "abs.yaml", "--set", "model.path=missing-model",
             files={"abs.yaml": "name: /tmp/elsewhere\n"}),
    ]
    # issue 20, the retriever client: search.url must be http(s) with a host (a file:// URL is never read)
    cases += [case("train", f"search-url-{name}", "train", "--config", "good.yaml", "--set", f"search.url={url}", "--dry-run")
              for name, url in (("not-a-url", "notaurl"), ("file", "file:///etc/passwd"), ("no-host", "http://"))]
    # issue 23, the rollout server: rollout.engine_url must be http(s) with a host; settings of an in-process engine,
    # LoRA and a timeout without a server are refused with it
    cases += [case("train", f"engine-url-{name}", "train", "--config", "good.yaml", *sum((["--set", s] for s in sets), []), "--dry-run")
              for name, sets in (("not-a-url", ["rollout.engine_url=127.0.0.1:8100"]), ("file", ["rollout.engine_url=file:///etc/passwd"]),
                                 ("with-gpu-memory", ["rollout.engine_url=http://127.0.0.1:8100", "rollout.gpu_memory_utilization=0.3"]),
                                 ("with-lora", ["rollout.engine_url=http://127.0.0.1:8100", "lora.r=4"]),
                                 ("timeout-alone", ["rollout.engine_timeout_s=5"]),
                                 ("timeout-zero", ["rollout.engine_url=http://127.0.0.1:8100", "rollout.engine_timeout_s=0"]),
                                 ("backend-alone", ["rollout.engine_weights_backend=http"]),
                                 ("backend-unknown", ["rollout.engine_url=http://127.0.0.1:8100", "rollout.engine_weights_backend=mpi"]),
                                 # issue 32: gloo is no longer a weight backend (http took its place); a timeout past
                                 # a day used to pass the config and overflow a socket timeout in training
                                 ("backend-gloo", ["rollout.engine_url=http://127.0.0.1:8100", "rollout.engine_weights_backend=gloo"]),
                                 ("timeout-huge", ["rollout.engine_url=http://127.0.0.1:8100", "rollout.engine_timeout_s=1e15"]),
                                 ("timeout-inf", ["rollout.engine_url=http://127.0.0.1:8100", "rollout.engine_timeout_s=inf"]))]
    # issue 24: search.url may be a list (every URL checked, not empty); the server's pool/queue/cache options
    cases += [case("train", f"search-url-list-{name}", "train", "--config", "good.yaml", "--set", f"search.url={url}", "--dry-run")
              for name, url in (("empty", "[]"), ("one-file", "[http://127.0.0.1:1/retrieve, file:///etc/passwd]"),
                                ("nested", "[[http://127.0.0.1:1/retrieve]]"), ("number", "[8000]"))]
    cases += [case("retriever", f"serve-{opt[2:]}-{value}", "retriever", "serve", "idx", opt, value)
              for opt, value in (("--workers", "0"), ("--workers", "many"), ("--max-batch", "0"), ("--max-pending", "-1"),
                                 ("--cache-mb", "-1"), ("--timeout", "1e300"))]
    # issue 23, `emapg rollout serve`: a missing model folder or a bad option is one
    # line before any engine loads (no case names a real model, so none starts a server)
    cases += [case("rollout", f"serve-{name}", "rollout", "serve", *argv)
              for name, argv in (("no-model-option", ()), ("model-missing", ("--model", "nomodel")),
                                 ("model-empty", ("--model", "")), ("model-is-a-file", ("--model", "good.yaml")),
                                 ("engine-unknown", ("--model", "nomodel", "--engine", "sglang")),
                                 ("port-too-big", ("--model", "nomodel", "--port", "99999")),
                                 ("port-text", ("--model", "nomodel", "--port", "http")),
                                 ("dtype-unknown", ("--model", "nomodel", "--dtype", "int8")),
                                 ("threads-zero", ("--model", "nomodel", "--threads", "0")),
                                 ("batch-zero", ("--model", "nomodel", "--batch-size", "0")),
                                 ("top-p-zero", ("--model", "nomodel", "--top-p", "0")),
                                 # issue 36: OpenAI's routes on the same server; a flag, not an option with a value
                                 ("openai-model-missing", ("--model", "nomodel", "--openai")),
                                 ("openai-with-value", ("--model", "nomodel", "--openai", "yes")),
                                 # issue 32: the secret, the connection and request limits (checked before any model
                                 # loads or any socket listens: --host 0.0.0.0 without a secret never binds)
                                 ("host-all-no-secret", ("--model", "nomodel", "--host", "0.0.0.0")),
                                 ("host-name-no-secret", ("--model", "nomodel", "--host", "example.org")),
                                 ("secret-short", ("--model", "nomodel", "--secret", "short")),
                                 ("secret-empty", ("--model", "nomodel", "--secret", "")),
                                 ("max-connections-zero", ("--model", "nomodel", "--max-connections", "0")),
                                 ("timeout-zero", ("--model", "nomodel", "--timeout", "0")),
                                 ("timeout-huge", ("--model", "nomodel", "--timeout", "1e15")),
                                 ("timeout-nan", ("--model", "nomodel", "--timeout", "nan")),
                                 ("max-body-zero", ("--model", "nomodel", "--max-body-bytes", "0")),
                                 ("max-sequences-zero", ("--model", "nomodel", "--max-sequences", "0")),
                                 ("max-new-tokens-negative", ("--model", "nomodel", "--max-new-tokens", "-1")),
                                 ("max-request-tokens-text", ("--model", "nomodel", "--max-request-tokens", "many")))]
    # trust (issue 20): standard-library / builtin callables refused as rewards and environments; a config file's
    # plugin needs --trust-code; a plugin that exits at import is one line
    for ref in ("builtins:exec", "builtins:eval", "pty:spawn", "os:system", "subprocess:run", "os.path:join"):
        cases.append(case("train", f"reward-stdlib-{ref}", "train", "--config", "good.yaml", "--set", f"rollout.reward={ref}",
                          "--dry-run"))
    cases += [
        case("train", "env-stdlib-class", "train", "--config", "good.yaml", "--set", "rollout.env=subprocess:Popen", "--dry-run"),
        case("train", "reward-is-a-class", "train", "--config", "good.yaml", "--set", "rollout.reward=plug.py:score",
             "--dry-run", files={"plug.py": "class score:\n    pass\n"}),
        case("train", "reward-in-config-untrusted", "train", "--config", "plugcfg.yaml", "--out", "new",
             files={"plug.py": "def score(response, example):\n    return 1.0\n",
                    "plugcfg.yaml": "rollout:\n  reward: plug.py:score\n"}),
        case("train", "reward-sys-exit-at-import", "train", "--config", "good.yaml", "--set", "rollout.reward=plug.py:score",
             "--out", "new", files={"plug.py": "import sys\nsys.exit(7)\n"}),
    ]
    return cases


# -------------------------------------------------------------------------------------------- eval

def eval_cases() -> list[Case]:
    base = ("eval", "--bench", "bench.jsonl", "--responses", "resp.jsonl")
    cases = [
        case("eval", "no-source", "eval", "--bench", "bench.jsonl", "--out", "new"),
        case("eval", "bench-missing", "eval", "--bench", "missing.jsonl", "--responses", "resp.jsonl", "--out", "new"),
        case("eval", "bench-dir", "eval", "--bench", "emptydir", "--responses", "resp.jsonl", "--out", "new"),
        case("eval", "bench-markup", "eval", "--bench", "[/bold]", "--responses", "resp.jsonl", "--out", "new"),
        case("eval", "responses-missing", "eval", "--bench", "bench.jsonl", "--responses", "missing.jsonl", "--out", "new"),
        case("eval", "responses-dir", "eval", "--bench", "bench.jsonl", "--responses", "emptydir", "--out", "new"),
        case("eval", "out-is-file", *base, "--out", "afile"),
        case("eval", "out-under-file", *base, "--out", "afile/x"),
        case("eval", "out-foreign", *base, "--out", "foreign"),
        case("eval", "out-train-run", *base, "--out", "trainrun"),
        case("eval", "out-ablate-run", *base, "--out", "ablaterun"),
        case("eval", "out-prepared", *base, "--out", "home/data/ds1"),
        case("eval", "out-other-settings", *base, "--out", "evalrun"),
        case("eval", "out-corrupt-run-json", *base, "--out", "badeval",
             files={"badeval/.emapg.json": marker("eval"), "badeval/run.json": "{truncated"}),
        case("eval", "out-run-json-list", *base, "--out", "badeval",
             files={"badeval/.emapg.json": marker("eval"), "badeval/run.json": "[1, 2]"}),
        case("eval", "out-corrupt-marker", *base, "--out", "badeval", files={"badeval/.emapg.json": "{", "badeval/x": "y"}),
        case("eval", "out-marker-not-object", *base, "--out", "badeval", files={"badeval/.emapg.json": "[]"}),
        case("eval", "n-zero", *base, "--n", "0", "--out", "new"),
        case("eval", "n-text", *base, "--n", "many", "--out", "new"),
        case("eval", "temperature-negative", *base, "--temperature", "-1", "--out", "new"),
        case("eval", "temperature-huge", *base, "--temperature", "1e308", "--out", "new"),
        case("eval", "top-p-zero", *base, "--top-p", "0", "--out", "new"),
        case("eval", "top-p-two", *base, "--top-p", "2", "--out", "new"),
        case("eval", "top-p-nan", *base, "--top-p", "nan", "--out", "new"),
        case("eval", "max-tokens-zero", *base, "--max-tokens", "0", "--out", "new"),
        case("eval", "seed-negative", *base, "--seed", "-1", "--out", "new"),
        case("eval", "limit-zero", *base, "--limit", "0", "--out", "new"),
        case("eval", "chunk-zero", *base, "--chunk", "0", "--out", "new"),
        case("eval", "grader-timeout-zero", *base, "--grader-timeout", "0", "--out", "new"),
        case("eval", "grader-timeout-huge", *base, "--grader-timeout", "1e300", "--out", "new"),  # issue 32: overflowed the pool's wait
        case("eval", "grader-workers-zero", *base, "--grader-workers", "0", "--out", "new"),
        case("eval", "backend-unknown", *base, "--backend", "tpu", "--out", "new"),
        case("eval", "dtype-unknown", *base, "--dtype", "int3", "--out", "new"),
        case("eval", "gpu-mem-two", *base, "--gpu-memory-utilization", "2", "--out", "new"),
        case("eval", "model-missing", "eval", "--bench", "bench.jsonl", "--model", "missing-model", "--backend", "hf", "--out", "new"),
        case("eval", "unknown-option", *base, "--frobnicate"),
        case("eval", "missing-bench-option", "eval", "--responses", "resp.jsonl"),
        case("eval", "bench-unprepared-name", "eval", "--bench", "aime24", "--responses", "resp.jsonl", "--out", "new"),
        case("eval", "bench-name-dotdot", "eval", "--bench", "../../etc", "--responses", "resp.jsonl", "--out", "new"),
        *env_cases("eval", "eval", "--bench", "bench.jsonl", "--model", "missing-model", "--backend", "hf"),
        # issue 36: --agent, checked as training's rollout.agent; it runs each problem itself
        *agent_cases("eval", "eval", "--bench", "bench.jsonl", "--model", "missing-model", "--backend", "hf"),
        case("eval", "agent-with-responses", *base, "--agent", "agentfile.py:agent", "--out", "new",
             files={"agentfile.py": "def agent(client, example):\n    return 1.0\n"}),
        case("eval", "agent-with-env", "eval", "--bench", "bench.jsonl", "--model", "missing-model", "--agent",
             "agentfile.py:agent", "--env", "calc", "--out", "new", files={"agentfile.py": "def agent(client, example):\n    return 1.0\n"}),
        case("eval", "agent-with-retriever", "eval", "--bench", "bench.jsonl", "--model", "missing-model", "--agent",
             "agentfile.py:agent", "--retriever", "bm25:idx", "--out", "new",
             files={"agentfile.py": "def agent(client, example):\n    return 1.0\n"}),
        case("eval", "agent-budget-over-context", "eval", "--bench", "bench.jsonl", "--model", "missing-model", "--agent",
             "agentfile.py:agent", "--max-tokens", "600", "--max-context-tokens", "500", "--out", "new",
             files={"agentfile.py": "def agent(client, example):\n    return 1.0\n"}),
        # --reward: a name or a plugin, checked as training's rollout.reward is, before anything is read or written
        case("eval", "reward-unknown", *base, "--reward", "nosuchreward", "--out", "new"),
        case("eval", "reward-empty", *base, "--reward", "", "--out", "new"),
        case("eval", "reward-markup", *base, "--reward", "[/bold]", "--out", "new"),
        case("eval", "reward-file-missing", *base, "--reward", "nofile.py:score", "--out", "new"),
        case("eval", "reward-file-is-dir", *base, "--reward", "emptydir:score", "--out", "new"),
        case("eval", "reward-no-function", *base, "--reward", "plug.py:absent", "--out", "new",
             files={"plug.py": "def score(response, example):\n    return 1.0\n"}),
        case("eval", "reward-not-callable", *base, "--reward", "plug.py:score", "--out", "new", files={"plug.py": "score = 3\n"}),
        case("eval", "reward-syntax-error", *base, "--reward", "plug.py:score", "--out", "new", files={"plug.py": "def score(:\n"}),
        case("eval", "reward-import-raises", *base, "--reward", "plug.py:score", "--out", "new",
             files={"plug.py": "raise RuntimeError('boom')\n"}),
        case("eval", "reward-module-missing", *base, "--reward", "no_such_module_xyz:score", "--out", "new"),
        # --compare A B [--json FILE]: two finished evaluations of the same items, nothing else on the line
        case("eval", "compare-one-folder", "eval", "--compare", "evalrun"),
        case("eval", "compare-missing", "eval", "--compare", "evalrun", "missing"),
        case("eval", "compare-file", "eval", "--compare", "evalrun", "afile"),
        case("eval", "compare-foreign", "eval", "--compare", "evalrun", "foreign"),
        case("eval", "compare-train-run-without-evals", "eval", "--compare", "evalrun", "trainrun"),
        case("eval", "compare-markup", "eval", "--compare", "evalrun", "[/bold]"),
        case("eval", "compare-other-items", "eval", "--compare", "evalrun", "cmp2",
             files={"cmp2/results.jsonl": jsonl([{"id": "9", "correct": [True]}])}),
        case("eval", "compare-corrupt-row", "eval", "--compare", "evalrun", "cmp2", files={"cmp2/results.jsonl": "{trunc\n"}),
        case("eval", "compare-not-bools", "eval", "--compare", "evalrun", "cmp2",
             files={"cmp2/results.jsonl": jsonl([{"id": "0", "correct": [1]}])}),
        case("eval", "compare-empty-correct", "eval", "--compare", "evalrun", "cmp2",
             files={"cmp2/results.jsonl": jsonl([{"id": "0", "correct": []}])}),
        case("eval", "compare-repeated-id", "eval", "--compare", "evalrun", "cmp2",
             files={"cmp2/results.jsonl": jsonl([{"id": "0", "correct": [True]}, {"id": "0", "correct": [False]}])}),
        case("eval", "compare-empty-file", "eval", "--compare", "evalrun", "cmp2", files={"cmp2/results.jsonl": ""}),
        case("eval", "compare-binary", "eval", "--compare", "evalrun", "cmp2", files={"cmp2/results.jsonl": b"\xff\xfe\x00"}),
        case("eval", "compare-with-model", "eval", "--compare", "evalrun", "evalrun", "--model", "missing-model"),
        case("eval", "compare-with-bench", "eval", "--compare", "evalrun", "evalrun", "--bench", "bench.jsonl"),
        case("eval", "compare-json-is-dir", "eval", "--compare", "evalrun", "evalrun", "--json", "emptydir"),
        case("eval", "compare-json-no-folder", "eval", "--compare", "evalrun", "evalrun", "--json", "nowhere/x.json"),
        case("eval", "json-without-compare", "eval", "--json", "x.json"),
    ]
    for name, text in BAD_JSONL.items():
        cases.append(case("eval", f"bench-{name}", "eval", "--bench", "badbench.jsonl", "--responses", "resp.jsonl",
                          "--out", "new", files={"badbench.jsonl": text}, owner=INPUT_READER_OWNER.get(name)))
    for name, text in BAD_RESPONSES.items():
        cases.append(case("eval", f"responses-{name}", "eval", "--bench", "bench.jsonl", "--responses", "badresp.jsonl",
                          "--out", "new", files={"badresp.jsonl": text}, owner=INPUT_READER_OWNER.get(name)))
    for i, s in enumerate(ODD_STRINGS):
        cases.append(case("eval", f"odd-bench-{i}", "eval", "--bench", s, "--responses", "resp.jsonl", "--out", "new"))
    cases += [
        case("eval", "bench-non-utf8", "eval", "--bench", "latin.jsonl", "--responses", "resp.jsonl", "--out", "new",
             files={"latin.jsonl": b'{"id": "0", "question": "caf\xe9", "answers": ["1"]}\n'}),
        case("eval", "responses-non-utf8", "eval", "--bench", "bench.jsonl", "--responses", "latin.jsonl", "--out", "new",
             files={"latin.jsonl": b'{"id": "0", "responses": ["caf\xe9"]}\n'}),
        case("eval", "bench-duplicate-ids", "eval", "--bench", "dup.jsonl", "--responses", "resp.jsonl", "--out", "new",
             files={"dup.jsonl": jsonl([BENCH_ROWS[0], BENCH_ROWS[0], BENCH_ROWS[1]])}),
        case("eval", "responses-duplicate-ids", "eval", "--bench", "bench.jsonl", "--responses", "dup.jsonl", "--out", "new",
             files={"dup.jsonl": jsonl([RESPONSE_ROWS[0], RESPONSE_ROWS[0]])}),
    ]
    # issue 20 (readers): ragged --responses, integers past Python's 4300-digit limit, a non-UTF-8 --prompt-template
    cases += [
        case("eval", "responses-ragged", "eval", "--bench", "bench.jsonl", "--responses", "ragged.jsonl", "--out", "new",
             files={"ragged.jsonl": jsonl([RESPONSE_ROWS[0], {"id": "1", "responses": ["\\boxed{2}"]}])}),
        case("eval", "bench-id-5000-digits", "eval", "--bench", "big.jsonl", "--responses", "resp.jsonl", "--out", "new",
             files={"big.jsonl": '{"id": ' + "9" * 5000 + ', "question": "q", "answers": ["1"]}\n'}),
        case("eval", "responses-id-5000-digits", "eval", "--bench", "bench.jsonl", "--responses", "big.jsonl", "--out", "new",
             files={"big.jsonl": '{"id": ' + "9" * 5000 + ', "responses": ["1"]}\n'}),
        case("eval", "prompt-template-non-utf8", "eval", "--bench", "bench.jsonl", "--model", "missing-model", "--retriever",
             "bm25:missing-index", "--prompt-template", "t.txt", "--out", "new", files={"t.txt": b"{question} caf\xe9"}),
    ]
    # issue 20, first hour: eval takes --preset/--config/--set as train does, and training's checks with them
    cases += [
        case("eval", "preset-unknown", *base, "--preset", "nosuchpreset", "--out", "new"),
        case("eval", "config-missing", *base, "--config", "missing.yaml", "--out", "new"),
        case("eval", "config-is-dir", *base, "--config", "emptydir", "--out", "new"),
        case("eval", "set-unknown-key", *base, "--set", "nosuch.key=1", "--out", "new"),
        case("eval", "set-no-equals", *base, "--set", "eval.n", "--out", "new"),
        case("eval", "set-eval-n-zero", *base, "--set", "eval.n=0", "--out", "new"),
        case("eval", "preset-context-2", *base, "--preset", "toy-search", "--max-context-tokens", "2", "--out", "new"),
        case("eval", "preset-turn-over-context", *base, "--preset", "toy-search", "--max-tokens", "999", "--out", "new"),
        case("eval", "set-context-2", *base, "--preset", "toy-search", "--set", "search.max_context_tokens=2", "--out", "new"),
        case("eval", "config-without-eval-set", "eval", "--config", "good.yaml", "--responses", "resp.jsonl", "--out", "new"),
        case("eval", "bench-toy-search-unprepared", "eval", "--bench", "toy-search", "--responses", "resp.jsonl", "--out", "new"),
    ]
    # issue 20 review: a typed --prompt-template path with ' #' is read as typed (not cut at a YAML comment); a
    # config file's reward plugin needs --trust-code in eval too
    cases += [
        case("eval", "preset-prompt-template-hash-missing", *base, "--preset", "toy-search", "--prompt-template",
             "no such #file.txt", "--out", "new"),
        case("eval", "config-plugin-untrusted", *base, "--config", "plugcfg.yaml", "--out", "new",
             files={"plug.py": "def score(response, example):\n    return 1.0\n",
                    "plugcfg.yaml": "rollout:\n  reward: plug.py:score\n"}),
    ]
    return cases


# ----------------------------------------------------------------------------------------- prepare

def prepare_cases() -> list[Case]:
    cases = [
        case("prepare", "no-name", "prepare"),
        case("prepare", "two-names", "prepare", "a", "b", "--from", "bench.jsonl"),
        case("prepare", "from-missing", "prepare", "x", "--from", "missing.jsonl"),
        case("prepare", "from-dir", "prepare", "x", "--from", "emptydir"),
        case("prepare", "from-unknown-suffix", "prepare", "x", "--from", "afile"),
        case("prepare", "from-csv", "prepare", "x", "--from", "t.csv", files={"t.csv": "a,b\n1,2\n"}),
        case("prepare", "out-is-file", "prepare", "x", "--from", "bench.jsonl", "--out", "afile"),
        case("prepare", "out-under-file", "prepare", "x", "--from", "bench.jsonl", "--out", "afile/x"),
        case("prepare", "out-foreign", "prepare", "x", "--from", "bench.jsonl", "--out", "foreign"),
        case("prepare", "out-train-run", "prepare", "x", "--from", "bench.jsonl", "--out", "trainrun"),
        case("prepare", "out-eval-run", "prepare", "x", "--from", "bench.jsonl", "--out", "evalrun"),
        case("prepare", "name-slash", "prepare", "a/b", "--from", "bench.jsonl"),
        case("prepare", "name-dotdot", "prepare", "..", "--from", "bench.jsonl"),
        case("prepare", "name-hidden", "prepare", ".hidden", "--from", "bench.jsonl"),
        case("prepare", "preset-unknown", "prepare", "--preset", "nope"),
        case("prepare", "preset-markup", "prepare", "--preset", "[/bold]"),
        case("prepare", "preset-with-name", "prepare", "x", "--preset", "toy"),
        case("prepare", "remove-alone", "prepare", "x", "--remove"),
        case("prepare", "decontaminate-one", "prepare", "--decontaminate", "ds1"),
        case("prepare", "decontaminate-missing", "prepare", "--decontaminate", "nope", "ds1"),
        case("prepare", "decontaminate-remove-file", "prepare", "--decontaminate", "--remove", "bench.jsonl", "ds1"),
        case("prepare", "ngram-zero", "prepare", "--decontaminate", "ds1", "ds1", "--ngram", "0"),
        case("prepare", "seed-negative", "prepare", "--preset", "toy", "--seed", "-1"),
        case("prepare", "unknown-option", "prepare", "x", "--frobnicate"),
        case("prepare", "json-not-list", "prepare", "x", "--from", "t.json", files={"t.json": "42"}),
        case("prepare", "json-two-lists", "prepare", "x", "--from", "t.json", files={"t.json": '{"a": [], "b": []}'}),
        case("prepare", "json-broken", "prepare", "x", "--from", "t.json", files={"t.json": '[{"id": 1,'}),
        case("prepare", "json-rows-numbers", "prepare", "x", "--from", "t.json", files={"t.json": "[1, 2, 3]"}),
        case("prepare", "json-empty-list", "prepare", "x", "--from", "t.json", files={"t.json": "[]"}),
        case("prepare", "parquet-garbage", "prepare", "x", "--from", "t.parquet", files={"t.parquet": b"PAR1 not really"}),
        case("prepare", "parquet-empty", "prepare", "x", "--from", "t.parquet", files={"t.parquet": b""}),
        case("prepare", "jsonl-non-utf8", "prepare", "x", "--from", "t.jsonl",
             files={"t.jsonl": b'{"id": "0", "question": "caf\xe9", "answer": "1"}\n'}),
        case("prepare", "jsonl-lone-surrogate", "prepare", "x", "--from", "t.jsonl",
             files={"t.jsonl": '{"id": "0", "question": "\\ud800", "answer": "1"}\n'}),
    ]
    for name, text in BAD_JSONL.items():
        if name in PREPARE_ACCEPTS:
            continue
        cases.append(case("prepare", f"jsonl-{name}", "prepare", "x", "--from", "t.jsonl", files={"t.jsonl": text}))
    for i, s in enumerate(ODD_STRINGS):
        cases.append(case("prepare", f"odd-from-{i}", "prepare", "x", "--from", s))
    # issue 33: reasoning-gym tasks (--size, --task-config) and the smol preset
    rg = "reasoning-gym:chain_sum"
    cases += [
        case("prepare", "rg-unknown-task", "prepare", "reasoning-gym:nope", "--size", "2", "--out", "new"),
        case("prepare", "rg-no-task", "prepare", "reasoning-gym:", "--out", "new"),
        case("prepare", "rg-empty-task", "prepare", "reasoning-gym:chain_sum,,gcd", "--out", "new"),
        case("prepare", "rg-repeated-task", "prepare", "reasoning-gym:gcd,gcd", "--out", "new"),
        case("prepare", "rg-size-zero", "prepare", rg, "--size", "0", "--out", "new"),
        case("prepare", "rg-size-huge", "prepare", rg, "--size", "10000000", "--out", "new"),
        case("prepare", "rg-size-text", "prepare", rg, "--size", "many", "--out", "new"),
        case("prepare", "rg-config-broken", "prepare", rg, "--task-config", "{", "--out", "new"),
        case("prepare", "rg-config-list", "prepare", rg, "--task-config", "[]", "--out", "new"),
        case("prepare", "rg-config-nested", "prepare", rg, "--task-config", "[" * 100000 + "]" * 100000, "--out", "new"),
        case("prepare", "rg-config-rejected", "prepare", rg, "--size", "2", "--task-config", '{"min_terms": 9}', "--out", "new"),
        case("prepare", "rg-config-unknown-key", "prepare", rg, "--size", "2", "--task-config", '{"x": 1}', "--out", "new"),
        case("prepare", "rg-config-wrong-type", "prepare", rg, "--size", "2", "--task-config", '{"min_terms": "two"}', "--out", "new"),
        case("prepare", "rg-config-seed", "prepare", rg, "--task-config", '{"seed": 1}', "--out", "new"),
        case("prepare", "rg-config-unkeyed-two", "prepare", "reasoning-gym:chain_sum,gcd", "--task-config", '{"max_value": 3}', "--out", "new"),
        case("prepare", "rg-from", "prepare", rg, "--from", "bench.jsonl", "--out", "new"),
        case("prepare", "rg-out-foreign", "prepare", rg, "--size", "2", "--out", "foreign"),
        case("prepare", "size-not-rg", "prepare", "x", "--from", "bench.jsonl", "--size", "3"),
        case("prepare", "task-config-not-rg", "prepare", "x", "--from", "bench.jsonl", "--task-config", "{}"),
        case("prepare", "smol-seed", "prepare", "--preset", "smol", "--seed", "1"),
        case("prepare", "smol-with-name", "prepare", "x", "--preset", "smol"),
    ]
    for i, s in enumerate(ODD_STRINGS):
        cases.append(case("prepare", f"rg-odd-task-{i}", "prepare", "reasoning-gym:" + s, "--out", "new"))
        cases.append(case("prepare", f"rg-odd-config-{i}", "prepare", rg, "--task-config", s, "--out", "new"))
    # issue 20 (readers): an id past Python's 4300-digit int <-> str limit
    cases += [
        case("prepare", "jsonl-id-5000-digits", "prepare", "x", "--from", "t.jsonl",
             files={"t.jsonl": '{"id": ' + "9" * 5000 + ', "question": "q", "answer": "1"}\n'}),
        case("prepare", "json-id-5000-digits", "prepare", "x", "--from", "t.json",
             files={"t.json": '[{"id": ' + "9" * 5000 + ', "question": "q", "answer": "1"}]'}),
    ]
    return cases


# ------------------------------------------------------------------------------------------ ablate

def ablate_cases() -> list[Case]:
    keys = config_keys()
    cases = []
    for key, default in keys[::2]:  # a grid axis of type-wrong values: rejected before any run starts
        bad = _bad_values(key, default)
        cases.append(case("ablate", f"grid-{key}", "ablate", "--preset", "toy", "--grid", f"{key}={bad[0]}", "--out", "sweep"))
    cases += [
        case("ablate", "nothing", "ablate", "--out", "sweep"),
        case("ablate", "study-unknown", "ablate", "--study", "nope", "--out", "sweep"),
        case("ablate", "study-markup", "ablate", "--study", "[/bold]", "--out", "sweep"),
        case("ablate", "study-dir", "ablate", "--study", "emptydir", "--out", "sweep"),
        case("ablate", "preset-unknown", "ablate", "--preset", "nope", "--grid", "kl.k=1,2", "--out", "sweep"),
        case("ablate", "grid-no-equals", "ablate", "--preset", "toy", "--grid", "kl.k", "--out", "sweep"),
        case("ablate", "grid-empty-values", "ablate", "--preset", "toy", "--grid", "kl.k=", "--out", "sweep"),
        case("ablate", "grid-unknown-key", "ablate", "--preset", "toy", "--grid", "nonsense=1,2", "--out", "sweep"),
        case("ablate", "grid-markup-key", "ablate", "--preset", "toy", "--grid", "[/]=1,2", "--out", "sweep"),
        case("ablate", "grid-negative-k", "ablate", "--preset", "toy", "--grid", "kl.k=-1,2", "--out", "sweep"),
        case("ablate", "seeds-zero", "ablate", "--preset", "toy", "--grid", "kl.k=1,2", "--seeds", "0", "--out", "sweep"),
        case("ablate", "jobs-zero", "ablate", "--preset", "toy", "--grid", "kl.k=1,2", "--jobs", "0", "--out", "sweep"),
        case("ablate", "set-bad", "ablate", "--preset", "toy", "--grid", "kl.k=1,2", "--set", "optim.lr=fast", "--out", "sweep"),
        case("ablate", "aggregate-no-out", "ablate", "--aggregate-only"),
        case("ablate", "aggregate-missing", "ablate", "--aggregate-only", "--out", "nowhere"),
        case("ablate", "aggregate-file", "ablate", "--aggregate-only", "--out", "afile"),
        case("ablate", "aggregate-foreign", "ablate", "--aggregate-only", "--out", "foreign"),
        case("ablate", "aggregate-eval-run", "ablate", "--aggregate-only", "--out", "evalrun"),
        case("ablate", "unknown-option", "ablate", "--frobnicate"),
    ]
    # a valid sweep aimed at a folder it may not write: refused before the first run starts
    for name, out in (("file", "afile"), ("under-file", "afile/x"), ("foreign", "foreign"), ("eval-run", "evalrun"),
                      ("train-run", "trainrun"), ("prepared", "home/data/ds1")):
        cases.append(case("ablate", f"out-{name}", "ablate", "--preset", "toy", "--grid", "kl.k=1,2", "--out", out))
    for name, text in BAD_YAML.items():
        cases.append(case("ablate", f"study-yaml-{name}", "ablate", "--study", "s.yaml", "--out", "sweep", files={"s.yaml": text}))
    cases += [
        case("ablate", "study-empty-grid", "ablate", "--study", "s.yaml", "--out", "sweep",
             files={"s.yaml": "name: s\npreset: toy\ngrid:\n  kl.k: []\n"}),
        case("ablate", "study-grid-seed", "ablate", "--study", "s.yaml", "--out", "sweep",
             files={"s.yaml": "name: s\npreset: toy\ngrid:\n  train.seed: [1, 2]\n"}),
    ]
    # issue 21: relative grid values (x<number>) and the study's analysis section
    cases += [case("ablate", f"grid-relative-{name}", "ablate", "--preset", "toy", "--grid", grid, "--out", "sweep")
              for name, grid in (("zero", "optim.lr=x0"), ("negative", "optim.lr=x-2"), ("bare", "optim.lr=x"),
                                 ("text-key", "kl.estimator=x2"), ("inf", "optim.lr=x1e400"), ("nan", "optim.lr=x.nan"))]
    study = "preset: toy\nvariants:\n  a: {}\n  b: {ema.decay: 1.0}\ngrid:\n  optim.lr: [x1, x2]\n"
    for name, analysis in (("baseline-unknown", "analysis: {baseline: nope}"), ("negative-points", "analysis: {baseline: a, collapse_points: -1}"),
                           ("unknown-key", "analysis: {baseline: a, frobnicate: 1}"), ("not-a-mapping", "analysis: [1, 2]"),
                           ("gain-text", "analysis: {baseline: a, target_gain: lots}")):
        cases.append(case("ablate", f"study-analysis-{name}", "ablate", "--study", "s.yaml", "--out", "sweep",
                          files={"s.yaml": study + analysis + "\n"}))
    cases.append(case("ablate", "study-analysis-two-axes", "ablate", "--study", "s.yaml", "--out", "sweep",
                      files={"s.yaml": study + "  kl.k: [1, 2]\nanalysis: {baseline: a}\n"}))
    # issue 22: the distill kind of the analysis section (no grid; its own settings only)
    plain = "preset: toy\nvariants:\n  a: {}\n  b: {kl.estimator: k1}\n"
    for name, text in (("distill-grid", study + "analysis: {kind: distill, baseline: a}"),
                       ("distill-stability-key", plain + "analysis: {kind: distill, baseline: a, collapse_points: 5}"),
                       ("distill-fraction-zero", plain + "analysis: {kind: distill, baseline: a, teacher_fraction: 0}"),
                       ("distill-tail-text", plain + "analysis: {kind: distill, baseline: a, tail_fraction: most}"),
                       ("kind-unknown", plain + "analysis: {kind: distil, baseline: a}")):
        cases.append(case("ablate", f"study-analysis-{name}", "ablate", "--study", "s.yaml", "--out", "sweep",
                          files={"s.yaml": text + "\n"}))
    # issue 41: the study's measure: and cost: sections (refused before the initial model is measured) and --generic
    rg = "untrained: 'reasoning-gym:gcd', format_prefix: [{role: user, content: hi}]"
    for name, section in (("measure-n-zero", "measure: {n: 0, " + rg + "}"),
                          ("measure-n-text", "measure: {n: many, " + rg + "}"),
                          ("measure-temperature-zero", "measure: {temperature: 0, " + rg + "}"),
                          ("measure-no-prefix", "measure: {untrained: 'reasoning-gym:gcd'}"),
                          ("measure-no-untrained", "measure: {format_prefix: []}"),
                          ("measure-untrained-not-gym", "measure: {untrained: toy, format_prefix: []}"),
                          ("measure-unknown-key", "measure: {bogus: 1, " + rg + "}"),
                          ("measure-not-a-mapping", "measure: [1, 2]"),
                          ("cost-step-zero", "cost: {step_s: 0, sequence_s: 1, eval_items: 3}"),
                          ("cost-step-nan", "cost: {step_s: .nan, sequence_s: 1, eval_items: 3}"),
                          ("cost-no-items", "cost: {step_s: 1, sequence_s: 1}"),
                          ("cost-jobs-zero", "cost: {jobs: 0, step_s: 1, sequence_s: 1, eval_items: 3}"),
                          ("cost-unknown-key", "cost: {step_s: 1, sequence_s: 1, eval_items: 3, hours: 2}"),
                          ("cost-not-a-mapping", "cost: 12")):
        cases.append(case("ablate", f"study-{name}", "ablate", "--study", "s.yaml", "--out", "sweep",
                          files={"s.yaml": plain + section + "\n"}))
    cases += [case("ablate", "generic-unknown-study", "ablate", "--study", "nope", "--preset", "smol", "--generic", "--out", "sweep"),
              case("ablate", "generic-unknown-preset", "ablate", "--study", "anchors", "--preset", "nope", "--generic", "--out", "sweep")]
    return cases


# ---------------------------------------------------------------------------------------- kl-check

def kl_check_cases() -> list[Case]:
    small = ("kl-check", "--vocab", "50", "--positions", "2", "--samples", "64", "--batches", "4",
             "--estimators", "k1", "--directions", "reverse", "--k", "1")
    cases = [
        case("kl-check", "k-text", "kl-check", "--k", "one"),
        case("kl-check", "k-empty", "kl-check", "--k", ","),
        case("kl-check", "k-zero", "kl-check", "--k", "0"),
        case("kl-check", "k-negative", "kl-check", "--k", "-4"),
        case("kl-check", "estimator-unknown", "kl-check", "--estimators", "k9"),
        case("kl-check", "estimator-markup", "kl-check", "--estimators", "[/bold]"),
        case("kl-check", "direction-unknown", "kl-check", "--directions", "sideways"),
        case("kl-check", "topk-from-unknown", "kl-check", "--topk-from", "teacher"),
        case("kl-check", "topk-from-empty", "kl-check", "--topk-from", ""),
        case("kl-check", "topk-from-markup", "kl-check", "--topk-from", "[/bold]"),
        case("kl-check", "topk-from-no-value", "kl-check", "--topk-from"),
        case("kl-check", "samples-zero", "kl-check", "--samples", "0"),
        case("kl-check", "batches-zero", "kl-check", "--batches", "0"),
        case("kl-check", "batches-over-samples", "kl-check", "--samples", "4", "--batches", "8"),
        case("kl-check", "confidence-two", "kl-check", "--confidence", "2"),
        case("kl-check", "confidence-nan", "kl-check", "--confidence", "nan"),
        case("kl-check", "vocab-zero", "kl-check", "--vocab", "0"),
        case("kl-check", "vocab-negative", "kl-check", "--vocab", "-5"),
        case("kl-check", "positions-zero", "kl-check", "--positions", "0"),
        case("kl-check", "tail-mass-one", "kl-check", "--tail-mass", "1"),
        case("kl-check", "kl-size-zero", "kl-check", "--kl-size", "0"),
        case("kl-check", "sampling-kl-negative", "kl-check", "--sampling-kl", "-1"),
        case("kl-check", "from-logits-and-model", "kl-check", "--from-logits", "x.npz", "--model", "m"),
        case("kl-check", "anchor-without-model", "kl-check", "--anchor-model", "m"),
        case("kl-check", "from-logits-missing", *small, "--from-logits", "missing.npz"),
        case("kl-check", "from-logits-dir", *small, "--from-logits", "emptydir"),
        case("kl-check", "from-logits-garbage", *small, "--from-logits", "g.npz", files={"g.npz": b"not a zip"}),
        case("kl-check", "from-logits-empty", *small, "--from-logits", "g.npz", files={"g.npz": b""}),
        case("kl-check", "model-missing", *small, "--model", "missing-model"),
        case("kl-check", "text-missing", *small, "--model", "missing-model", "--text", "missing.txt"),
        case("kl-check", "plot-is-dir", *small, "--plot", "emptydir"),
        case("kl-check", "plot-under-file", *small, "--plot", "afile/p.png"),
        case("kl-check", "json-is-dir", *small, "--json", "emptydir"),
        case("kl-check", "json-under-file", *small, "--json", "afile/r.json"),
        case("kl-check", "stability-plot-under-file", "kl-check", "--stability", "--plot", "afile/s.png"),
        case("kl-check", "stability-alphas-text", "kl-check", "--stability", "--alphas", "fast"),
        case("kl-check", "stability-alphas-empty", "kl-check", "--stability", "--alphas", ","),
        case("kl-check", "stability-alphas-negative", "kl-check", "--stability", "--alphas", "-1"),
        case("kl-check", "stability-etas-two", "kl-check", "--stability", "--etas", "2"),
        case("kl-check", "stability-period-zero", "kl-check", "--stability", "--period", "0"),
        case("kl-check", "stability-actions-zero", "kl-check", "--stability", "--actions", "0"),
        case("kl-check", "stability-steps-negative", "kl-check", "--stability", "--steps", "-1"),
        case("kl-check", "stability-beta-negative", "kl-check", "--stability", "--beta", "-1"),
        case("kl-check", "unknown-option", "kl-check", "--frobnicate"),
        case("kl-check", "from-logits-huge", *small, "--from-logits", "h.npz", files={"h.npz": _npz(1e308)}),
        case("kl-check", "text-non-utf8", *small, "--model", "missing-model", "--text", "latin.txt",
             files={"latin.txt": b"caf\xe9\n"}),
    ]
    for name, arrays in (("no-anchor", {"policy": [[0.0, 1.0]]}), ("int-arrays", {"policy": [[0, 1]], "anchor": [[0, 1]]}),
                         ("shape-mismatch", {"policy": [[0.0, 1.0]], "anchor": [[0.0, 1.0, 2.0]]}),
                         ("one-dim", {"policy": [0.0, 1.0], "anchor": [0.0, 1.0]}),
                         ("nan", {"policy": [[float("nan"), 1.0]], "anchor": [[0.0, 1.0]]})):
        cases.append(case("kl-check", f"npz-{name}", *small, "--from-logits", "a.npz", files={"a.npz": _npz_arrays(arrays)}))
    # issue 20 (readers): .npz members checked from their .npy headers before loading
    cases += [
        case("kl-check", "npz-header-lies", *small, "--from-logits", "a.npz", files={"a.npz": _npz_members(
            {"policy.npy": _npy_header((8192, 65536)) + bytes(16), "anchor.npy": _npy_header((8192, 65536)) + bytes(16)})}),
        case("kl-check", "npz-object-array", *small, "--from-logits", "a.npz", files={"a.npz": _npz_members(
            {"policy.npy": _npy_header((1, 2), "|O") + b"\x80\x02N.", "anchor.npy": _npy_header((1, 2)) + bytes(16)})}),
        case("kl-check", "npz-truncated", *small, "--from-logits", "a.npz",
             files={"a.npz": _npz_arrays({"policy": [[0.0, 1.0]], "anchor": [[0.0, 1.0]]})[:120]}),
    ]
    # issue 21 (adaptive eta): the adaptive rule's options of --stability
    stab = ("kl-check", "--stability", "--steps", "80", "--alphas", "0.1", "--etas", "0.9", "--period", "1")
    cases += [
        case("kl-check", "target-distance-without-stability", "kl-check", "--target-distance", "0.01"),
        # issue 32: --top-p in (0, 1]
        *(case("kl-check", f"top-p-{name}", *small, "--top-p", value)
          for name, value in (("zero", "0"), ("above-one", "1.5"), ("negative", "-0.1"), ("nan", "nan"), ("text", "most"))),
        case("kl-check", "stability-decay-max-without-target", *stab, "--decay-max", "0.9"),
        case("kl-check", "stability-target-distance-zero", *stab, "--target-distance", "0"),
        case("kl-check", "stability-target-distance-nan", *stab, "--target-distance", "nan"),
        case("kl-check", "stability-target-distance-text", *stab, "--target-distance", "far"),
        case("kl-check", "stability-decay-max-one", *stab, "--target-distance", "0.01", "--decay-max", "1"),
        case("kl-check", "stability-decay-min-above-max", *stab, "--target-distance", "0.01", "--decay-min", "0.99",
             "--decay-max", "0.9"),
    ]
    return cases


# ------------------------------------------------------------------------------------------- bench

def bench_cases() -> list[Case]:
    """`emapg bench`: bad values of every option are one line before anything is allocated (issue 32: --confident)."""
    small = ("bench", "update", "--tokens", "4", "--hidden", "4", "--vocab", "20", "--k", "2")
    cases = [case("bench", f"update-confident-{name}", *small, "--check", "--confident", value)
             for name, value in (("zero", "0"), ("one", "1"), ("above-one", "1.5"), ("negative", "-0.5"), ("nan", "nan"),
                                 ("text", "sure"))]
    cases += [
        case("bench", "update-check-too-big", "bench", "update", "--tokens", "1048576", "--hidden", "65536", "--vocab",
             "16777216", "--check"),
        case("bench", "update-dtype-float16", *small, "--dtype", "float16"),
        case("bench", "update-estimator-unknown", *small, "--estimator", "k9"),
        case("bench", "update-device-unknown", *small, "--device", "tpu"),
        case("bench", "update-tokens-zero", "bench", "update", "--tokens", "0"),
        case("bench", "passes-dtype-unknown", "bench", "passes", "--tokens", "4", "--hidden", "4", "--vocab", "20", "--dtype", "int8"),
        case("bench", "step-no-preset", "bench", "step"),
    ]
    return cases


def _npz_arrays(arrays: dict) -> bytes:
    import io

    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
    return buf.getvalue()


def _npy_header(shape: tuple, descr: str = "<f8") -> bytes:
    import io

    from numpy.lib import format as npy

    buf = io.BytesIO()
    npy.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _npz_members(members: dict[str, bytes]) -> bytes:
    """A zip of raw members (an .npz whose .npy headers may say anything)."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _npz(value: float) -> bytes:
    return _npz_arrays({"policy": [[value, -value, 0.0]], "anchor": [[-value, value, 0.0]]})


# ------------------------------------------------------------------------------------ retriever (issue 20)

def _index_files() -> dict[str, bytes]:
    """The files of a real bm25 index of a 3-row corpus (relative path under the index folder -> bytes)."""
    import tempfile

    from emapg_cli.retrieval.bm25 import build_index

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "c.jsonl"
        corpus.write_text(jsonl([{"id": f"d{i}", "contents": f"Title {i}\nriver{i} flows past stone{i}"} for i in range(3)]))
        build_index(corpus, Path(tmp) / "idx")
        root = Path(tmp) / "idx"
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def retriever_cases() -> list[Case]:
    """A tampered index (`retriever query`): every file deleted, cut or garbled, wrong counts and types in the
    manifest, a docs file shorter than the model; and `retriever index` into folders it may not write."""
    import hashlib

    good = _index_files()

    def variant(name: str, change) -> Case:
        files = dict(good)
        change(files)
        return case("retriever", f"index-{name}", "retriever", "query", "idx", "river1",
                    files={f"idx/{k}": v for k, v in files.items()})

    def manifest(fn):
        def change(files):
            files["manifest.json"] = fn(json.loads(files["manifest.json"])).encode()
        return change

    def dumps(fn):
        return manifest(lambda m: json.dumps(fn(m)))

    def short_docs(files):  # one row less, the manifest's rows and hashes made to agree: the model has 3 documents
        import io

        import numpy as np

        files["docs.bin"] = b"".join(files["docs.bin"].splitlines(keepends=True)[:2])
        offsets = np.load(io.BytesIO(files["docs.offsets.npy"]))[:3]
        buf = io.BytesIO()
        np.save(buf, offsets)
        files["docs.offsets.npy"] = buf.getvalue()
        m = json.loads(files["manifest.json"])
        m["rows"] = 2
        for name in ("docs.bin", "docs.offsets.npy"):
            m["files"][name] = {"bytes": len(files[name]), "sha256": hashlib.sha256(files[name]).hexdigest()}
        files["manifest.json"] = json.dumps(m).encode()

    def garble(name):
        def change(files):
            data = bytearray(files[name])
            data[len(data) // 2] ^= 0x5A
            files[name] = bytes(data)
        return change

    cases = [
        variant("manifest-deleted", lambda f: f.pop("manifest.json")),
        variant("manifest-truncated", lambda f: f.update({"manifest.json": f["manifest.json"][:40]})),
        variant("manifest-list", dumps(lambda m: [m])),
        variant("manifest-rows-text", dumps(lambda m: {**m, "rows": "3"})),
        variant("manifest-rows-wrong", dumps(lambda m: {**m, "rows": 30})),
        variant("manifest-missing-key", dumps(lambda m: {k: v for k, v in m.items() if k != "rows"})),
        variant("manifest-extra-key", dumps(lambda m: {**m, "extra": True})),
        variant("manifest-format", dumps(lambda m: {**m, "format": "emapg-bm25/0"})),
        variant("docs-deleted", lambda f: f.pop("docs.bin")),
        variant("docs-truncated", lambda f: f.update({"docs.bin": f["docs.bin"][:30]})),
        variant("docs-garbled", garble("docs.bin")),
        variant("offsets-deleted", lambda f: f.pop("docs.offsets.npy")),
        variant("docs-shorter-than-model", short_docs),
        variant("model-garbled", garble("bm25/data.csc.index.npy")),
        variant("model-params-deleted", lambda f: f.pop("bm25/params.index.json")),
        variant("planted-file", lambda f: f.update({"bm25/extra.npy": b"x"})),
        case("retriever", "index-stop-words", "retriever", "index", "sw.jsonl", "--out", "newidx",
             files={"sw.jsonl": jsonl([{"id": "1", "contents": "The\nthe of an"}])}),
        case("retriever", "index-chunk-rows-zero", "retriever", "index", "c.jsonl", "--out", "newidx", "--chunk-rows", "0",
             files={"c.jsonl": jsonl([{"id": "1", "contents": "T\nriver"}])}),
        case("retriever", "index-chunk-rows-text", "retriever", "index", "c.jsonl", "--out", "newidx", "--chunk-rows", "many",
             files={"c.jsonl": jsonl([{"id": "1", "contents": "T\nriver"}])}),
        case("retriever", "index-duplicate-id", "retriever", "index", "c.jsonl", "--out", "newidx", "--chunk-rows", "1",
             files={"c.jsonl": jsonl([{"id": "1", "contents": "T\nriver"}, {"id": "2", "contents": "U\nhill"}, {"id": "1", "contents": "V\nsea"}])}),
        case("retriever", "index-out-foreign", "retriever", "index", "c.jsonl", "--out", "foreign",
             files={"c.jsonl": jsonl([{"id": "1", "contents": "T\nriver"}])}),
        case("retriever", "index-out-train-run", "retriever", "index", "c.jsonl", "--out", "trainrun",
             files={"c.jsonl": jsonl([{"id": "1", "contents": "T\nriver"}])}),
    ]
    # issue 24, the dense index: option mistakes (refused with or without the extra) and a dense manifest's checks
    corpus = {"c.jsonl": jsonl([{"id": "1", "contents": "T\nriver"}])}
    cases += [
        case("retriever", "dense-option-without-dense", "retriever", "index", "c.jsonl", "--out", "newidx", "--nprobe", "4", files=corpus),
        case("retriever", "dense-faiss-unknown", "retriever", "index", "c.jsonl", "--out", "newidx", "--dense", "enc", "--faiss", "pq", files=corpus),
        case("retriever", "dense-option-of-other-kind", "retriever", "index", "c.jsonl", "--out", "newidx", "--dense", "enc",
             "--faiss", "hnsw", "--nlist", "2", files=corpus),
        case("retriever", "dense-batch-size-zero", "retriever", "index", "c.jsonl", "--out", "newidx", "--dense", "enc",
             "--batch-size", "0", files=corpus),
        case("retriever", "dense-manifest-faiss-kind", "retriever", "query", "didx", "river",
             files={"didx/manifest.json": json.dumps({"format": "emapg-dense/1", "faiss": {"kind": "pq"}})}),
    ]
    return cases


# ------------------------------------------------------------------------------------------- bench

def bench_cases() -> list[Case]:
    """`emapg bench` (issue 34's `bench generate` and the older subcommands): every bad option is one line before any
    model loads (the workspace's toy preset is not prepared, so no case reaches a measurement)."""
    gen = ("bench", "generate")
    cases = [case("bench", f"generate-{name}", *gen, *argv) for name, argv in (
        ("no-preset", ()), ("preset-unknown", ("--preset", "nosuch")), ("preset-markup", ("--preset", "[/bold]")),
        ("toy-unprepared", ("--preset", "toy")), ("engine-unknown", ("--preset", "toy", "--engine", "sglang")),
        ("sequences-zero", ("--preset", "toy", "--sequences", "0")), ("sequences-text", ("--preset", "toy", "--sequences", "many")),
        ("sequences-huge", ("--preset", "toy", "--sequences", "99999999")),
        ("sequences-not-a-multiple", ("--preset", "toy", "--sequences", "3")),
        ("max-new-tokens-zero", ("--preset", "toy", "--max-new-tokens", "0")),
        ("threads-zero", ("--preset", "toy", "--threads", "0")), ("rounds-zero", ("--preset", "toy", "--rounds", "0")),
        ("model-empty", ("--preset", "toy", "--model", "")), ("model-missing", ("--preset", "toy", "--model", "nomodel")),
        ("model-is-a-file", ("--preset", "toy", "--model", "good.yaml")),
        ("set-unknown-key", ("--preset", "toy", "--set", "rollout.nope=1")),
        ("set-fast-decode-text", ("--preset", "toy", "--set", "rollout.hf_fast_decode=maybe")),
        ("set-attention-unknown", ("--preset", "toy", "--set", "rollout.hf_attention=flash")))]
    cases += [case("bench", f"update-{name}", "bench", "update", *argv) for name, argv in (
        ("dtype-float16", ("--dtype", "float16")), ("estimator-unknown", ("--estimator", "k5")),
        ("device-tpu", ("--device", "tpu")), ("tokens-zero", ("--tokens", "0")))]
    cases += [case("bench", f"step-{name}", "bench", "step", *argv) for name, argv in (
        ("no-preset", ()), ("preset-unknown", ("--preset", "nosuch")))]
    return cases


# ------------------------------------------------------------------------------------ all of them

def all_cases() -> list[Case]:
    cases = prepare_cases() + train_cases() + eval_cases() + ablate_cases() + kl_check_cases() + config_cases()
    cases += retriever_cases() + bench_cases()
    seen: set[str] = set()
    for c in cases:
        assert c.id not in seen, f"duplicate case id {c.id}"
        seen.add(c.id)
    return cases


def counts(cases) -> dict[str, int]:
    return {cmd: sum(c.command == cmd for c in cases) for cmd in COMMANDS}


# ------------------------------------------------------------------------- the randomised generator

def _mutate_row(rng: random.Random, row: dict, kind: Optional[int] = None) -> tuple[int, object]:
    """(kind, a row made invalid for the canonical schema in one of several ways)."""
    kind = rng.randrange(6) if kind is None else kind
    if kind == 0:
        return kind, [row]  # not an object
    if kind == 1:
        return kind, {k: v for k, v in row.items() if k != "question"}  # a required field missing
    if kind == 2:
        return kind, {**row, "question": rng.choice([None, 5, ["x"], {"a": 1}])}  # wrong type
    if kind == 3:
        return kind, {**row, "answers": rng.choice([None, {"a": 1}, [[1]], []])}  # (a number is a valid answer: docs/eval.md)
    if kind == 4:
        return kind, rng.choice([None, 42, "text", True])
    return kind, {**row, "id": rng.choice([None, ["x"], {"a": 1}])}


def generated(seed: int, n: int) -> list[Case]:
    """`n` random malformed inputs across the commands (each invalid by construction)."""
    rng = random.Random(seed)
    keys = config_keys()
    cases = []
    for i in range(n):
        pick = rng.randrange(5)
        if pick == 0:  # a bench with one broken row among good ones
            rows: list = [dict(r) for r in BENCH_ROWS]
            j = rng.randrange(len(rows))
            # kinds 0-4: an id that is null, a list or an object is taken (the row index, the text; docs/eval.md)
            _, rows[j] = _mutate_row(rng, rows[j], rng.randrange(5))
            text = "".join(json.dumps(r) + "\n" for r in rows)
            cases.append(case("eval", f"gen{seed}-{i}", "eval", "--bench", "g.jsonl", "--responses", "resp.jsonl", "--out", "new",
                              files={"g.jsonl": text}))
        elif pick == 1:  # to prepare, which drops the rows it cannot use: every row unusable
            rows = [{"id": r["id"], "question": r["question"], "answer": r["answers"][0]} for r in BENCH_ROWS]
            rows = [_mutate_row(rng, r, rng.choice([0, 1, 4]))[1] for r in rows]
            text = "".join(json.dumps(r) + "\n" for r in rows)
            cases.append(case("prepare", f"gen{seed}-{i}", "prepare", "g", "--from", "g.jsonl", files={"g.jsonl": text}))
        elif pick == 2:  # a type-wrong --set value, with markup/unicode noise around it
            key, default = rng.choice(keys)
            value = rng.choice(_bad_values(key, default))
            cmd = rng.choice([("config", "show"), ("train",), ("train", "--dry-run")])
            cases.append(case(cmd[0], f"gen{seed}-{i}", *cmd, "--set", f"{key}={value}"))
        elif pick == 3:  # a truncated valid config: cut in the middle of a token
            from emapg_cli.config import Config
            from emapg_cli.config.loading import to_yaml

            text = to_yaml(Config()) + "train: {steps: [1, \n"
            cut = rng.randrange(len(text) // 2, len(text))
            text = text[:cut] + rng.choice(["\t", ": :", "[", "{", "\x00", "&a *b"]) + text[cut:]
            cases.append(case("config", f"gen{seed}-{i}", "config", "show", "--config", "g.yaml", files={"g.yaml": text}))
        else:  # responses with one broken row
            rows = [dict(r) for r in RESPONSE_ROWS]
            j = rng.randrange(len(rows))
            rows[j] = rng.choice([{"id": rows[j]["id"], "responses": rng.choice([5, "x", {"a": 1}, [1]])}, [1], "s", 3])
            text = "".join(json.dumps(r) + "\n" for r in rows)
            cases.append(case("eval", f"gen{seed}-{i}", "eval", "--bench", "bench.jsonl", "--responses", "g.jsonl", "--out", "new",
                              files={"g.jsonl": text}))
    return cases


if __name__ == "__main__":
    cases = all_cases()
    print(", ".join(f"{k} {v}" for k, v in counts(cases).items()), f"= {len(cases)} cases")
