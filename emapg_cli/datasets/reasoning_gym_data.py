"""reasoning-gym tasks as canonical datasets (`emapg prepare reasoning-gym:TASK[,TASK...]`), and the entries
their scorer needs (the `reasoning-gym` reward, rewards/reasoning_gym_reward.py).

reasoning-gym (the extra `emapg[tasks]`) generates its problems offline from a seed:
`reasoning_gym.create_dataset(TASK, size=N, seed=S, **config)` is a list of N entries
`{question, answer, metadata}`, and the task's `score_answer(answer, entry)` grades an extracted answer
against the whole entry (some tasks read its metadata, or the dataset's own config). So a row keeps in
`meta` what rebuilds that entry exactly: the task, its config, the seed, the size and the row's index. The
reward regenerates the entry from them (`entry_of`) and checks that its question is the row's
(`meta.question`, reasoning-gym's own text), so a row is never scored against another problem (a different
reasoning-gym version, an edited file): that is an error, not a score.

A row of the canonical schema:

    {"id": "chain_sum-0-17", "question": PROMPT_TEMPLATE.format(question=entry["question"]),
     "answers": [entry["answer"]], "source": "chain_sum",
     "meta": {"task": "chain_sum", "config": {...}, "seed": 0, "size": 500, "index": 17,
              "question": entry["question"]}}

This is the only module (with the reward) that imports reasoning_gym, inside its functions.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

from emapg_cli.data.schema import Example
from emapg_cli.errors import UserError, first_line
from emapg_cli.tasks import REASONING_GYM

PREFIX = REASONING_GYM.name  # "reasoning-gym:"

#: The user message of every row: reasoning-gym's question, then its answer format (the reward reads the
#: last <answer>...</answer>, reasoning-gym's `extract_answer`). Short, so that a small model answers at once.
PROMPT_TEMPLATE = "{question}\nAnswer with <answer>...</answer> and nothing else."

#: Rows per task when --size is not given (reasoning-gym's own default size).
DEFAULT_SIZE = 500
#: Bounded work: at most this many rows per task, this many tasks.
MAX_SIZE = 100_000
MAX_TASKS = 64

#: Bounded work: each task's rows are generated in a worker process (grading/pool.py) within this many seconds and
#: under this address-space cap; a config that asks for more (`{"min_numbers": 10000000, ...}`) is refused in one line.
GENERATE_TIMEOUT_S = 600.0
GENERATE_MEMORY_MIB = 4096

#: What a task's generator or config may raise on bad settings (reasoning-gym validates with asserts).
_CONFIG_ERRORS = (AssertionError, ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, AttributeError)


def library():
    """The reasoning_gym module, or a one-line UserError naming the extra."""
    try:
        import reasoning_gym
    except ImportError:
        raise UserError("reasoning-gym tasks need the reasoning-gym package: pip install 'emapg[tasks]'") from None
    return reasoning_gym


def parse_reference(name: str) -> list[str]:
    """The tasks of `reasoning-gym:TASK[,TASK...]`, in order; a UserError for an empty or repeated task or an
    unknown one (listing a few known names)."""
    tasks = [t.strip() for t in name[len(PREFIX):].split(",")]
    if not tasks or any(not t for t in tasks):
        raise UserError(f"'{name}': give reasoning-gym:TASK or reasoning-gym:TASK,TASK,... (no empty task names)")
    if len(tasks) > MAX_TASKS:
        raise UserError(f"'{name}': at most {MAX_TASKS} tasks (got {len(tasks)})")
    repeated = sorted({t for t in tasks if tasks.count(t) > 1})
    if repeated:
        raise UserError(f"'{name}': task {repeated[0]} is given twice")
    known = set(library().factory.DATASETS)
    for t in tasks:
        if t not in known:
            near = sorted(k for k in known if k[:3] == t[:3])[:5]
            hint = f" (similar: {', '.join(near)})" if near else ""
            raise UserError(f"unknown reasoning-gym task '{t}'{hint}; {len(known)} tasks are known "
                            "(python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))')")
    return tasks


def parse_task_config(text: Optional[str], tasks: Sequence[str]) -> list[dict[str, Any]]:
    """Each task's config keyword arguments from `--task-config JSON`: with one task, an object of its
    arguments (or {TASK: {...}}); with several, {TASK: {...}, ...} (a task not named gets its defaults)."""
    if text is None:
        return [{} for _ in tasks]
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise UserError(f"--task-config: not valid JSON ({first_line(e)})") from None
    if not isinstance(value, dict):
        raise UserError(f"--task-config: expected a JSON object, got {type(value).__name__}")
    keyed = bool(value) and all(k in tasks and isinstance(v, dict) for k, v in value.items())
    if keyed:
        return [dict(value.get(t, {})) for t in tasks]
    if len(tasks) > 1:
        raise UserError("--task-config with several tasks: give {\"TASK\": {...}, ...} keyed by the tasks "
                        f"({', '.join(tasks)})")
    return [value]


def make_dataset(task: str, config: dict[str, Any], size: int, seed: int):
    """`reasoning_gym.create_dataset(task, size=size, seed=seed, **config)`; a config the task rejects is a
    one-line UserError."""
    rg = library()
    if "size" in config or "seed" in config:
        raise UserError(f"--task-config of {task}: give the size and seed with --size and --seed, not in the config")
    try:
        return rg.create_dataset(task, size=size, seed=seed, **config)
    except _CONFIG_ERRORS as e:
        raise UserError(f"reasoning-gym task {task} rejects the config {json.dumps(config)}: "
                        f"{type(e).__name__}: {first_line(e) or 'invalid setting'}") from None


def entry_at(dataset, task: str, config: dict[str, Any], index: int) -> dict[str, Any]:
    """Entry `index` of `dataset`; a generator that fails on the config is a UserError (some tasks only
    check their settings when they draw an item)."""
    try:
        return dataset[index]
    except _CONFIG_ERRORS as e:
        raise UserError(f"reasoning-gym task {task} rejects the config {json.dumps(config)} (item {index}): "
                        f"{type(e).__name__}: {first_line(e) or 'invalid setting'}") from None


def task_rows(task: str, config: dict[str, Any], size: int, seed: int, template: str = PROMPT_TEMPLATE) -> list[Example]:
    """The canonical rows of `create_dataset(task, size=size, seed=seed, **config)`, in order."""
    if not 1 <= size <= MAX_SIZE:
        raise UserError(f"--size must be between 1 and {MAX_SIZE} (got {size})")
    dataset = make_dataset(task, config, size, seed)
    rows = []
    for index in range(size):
        entry = entry_at(dataset, task, config, index)
        answer = str(entry["answer"])
        if not answer.strip():
            raise UserError(f"reasoning-gym task {task} gave item {index} an empty answer (config {json.dumps(config)})")
        rows.append(Example(
            id=f"{task}-{seed}-{index}", question=template.format(question=entry["question"]), answers=[answer],
            source=task, meta={"task": task, "config": config, "seed": seed, "size": size, "index": index,
                               "question": entry["question"]},
        ))
    return rows


def task_row_dicts(task: str, config: dict[str, Any], size: int, seed: int) -> list[dict[str, Any]]:
    """`task_rows` as plain rows (in a generating worker)."""
    return [row.model_dump() for row in task_rows(task, config, size, seed)]


def generate(tasks: Sequence[tuple[str, dict[str, Any]]], size: int, seed: int) -> list[Example]:
    """Each (task, config)'s `size` rows with seed `seed`, concatenated in the order given, each task generated in a
    worker within GENERATE_TIMEOUT_S and GENERATE_MEMORY_MIB: past either, a one-line UserError."""
    from emapg_cli.grading.pool import TimeoutPool

    why: dict[int, str] = {}
    with TimeoutPool(task_row_dicts, workers=1, timeout=GENERATE_TIMEOUT_S, warmup=library,
                     memory_limit=GENERATE_MEMORY_MIB << 20) as pool:
        out = pool.map([(t, c, size, seed) for t, c in tasks],
                       on_result=lambda i, v: why.setdefault(i, pool.stats.last_error) if v is None else None)
    for i, (task, config) in enumerate(tasks):
        if out[i] is None:
            if why[i].startswith("UserError: "):
                raise UserError(why[i][len("UserError: "):])
            raise UserError(f"reasoning-gym task {task} with the config {json.dumps(config)}: {size} rows need more than "
                            f"{GENERATE_TIMEOUT_S:g} s or {GENERATE_MEMORY_MIB} MiB to generate ({why[i]}); ask for less")
    return [Example(**row) for rows in out for row in rows]


def provenance(tasks: Sequence[tuple[str, dict[str, Any]]], size: int, seed: int) -> dict[str, Any]:
    """The manifest fields that say how the rows were made (and with which reasoning-gym)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        rg_version = version("reasoning-gym")
    except PackageNotFoundError:
        rg_version = None
    return {"source": PREFIX + ",".join(t for t, _ in tasks), "revision": None,
            "reasoning_gym_version": rg_version, "tasks": [{"task": t, "config": c} for t, c in tasks],
            "size": size, "seed": seed, "prompt_template": PROMPT_TEMPLATE}


def prepare_reasoning_gym(name: str, size: int, seed: int, task_config: Optional[str], out_dir: Path) -> dict[str, Any]:
    """`emapg prepare reasoning-gym:TASK[,TASK...]`: data.jsonl and manifest.json in `out_dir` (claimed by the
    caller); returns the manifest. Nothing is written before every row is generated."""
    from emapg_cli.datasets.prepare import Converted, write_dataset
    from emapg_cli.datasets.registry import DatasetSpec

    tasks = parse_reference(name)
    tasks_configs = list(zip(tasks, parse_task_config(task_config, tasks)))
    rows = generate(tasks_configs, size, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = DatasetSpec(name=name, role="train", expected_rows=size * len(tasks))
    return write_dataset(out_dir, Converted(examples=rows), provenance(tasks_configs, size, seed), spec)


@lru_cache(maxsize=64)
def _dataset(task: str, config_json: str, size: int, seed: int):
    return make_dataset(task, json.loads(config_json), size, seed)


def entry_of(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the reasoning-gym dataset, the entry) a row's `meta` rebuilds; a ValueError when `meta` is not a
    reasoning-gym row's or rebuilds another question than the one it was prepared with."""
    try:
        task, config, seed, size, index = (meta[k] for k in ("task", "config", "seed", "size", "index"))
    except (KeyError, TypeError):
        raise ValueError("the example's meta has no reasoning-gym entry (task, config, seed, size, index): "
                         "prepare the data with `emapg prepare reasoning-gym:TASK`") from None
    if not isinstance(config, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in (seed, size, index)) \
            or not 0 <= index < size:
        raise ValueError("the example's reasoning-gym meta is malformed (config an object; seed, size, index integers)")
    try:
        dataset = _dataset(str(task), json.dumps(config, sort_keys=True), size, seed)
        entry = entry_at(dataset, str(task), config, index)
    except UserError as e:
        raise ValueError(str(e)) from None
    if entry["question"] != meta.get("question"):
        raise ValueError(f"reasoning-gym rebuilds another question for {task} item {index} (seed {seed}) than the one "
                         "the row was prepared with (another reasoning-gym version?): prepare the data again")
    return dataset, entry
