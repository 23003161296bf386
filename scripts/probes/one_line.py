"""Internal errors where one line belongs (issue 32, item 11): time limits past what Python's waits take, broken or
tampered model folders, a faiss.index whose header lies, tampered sweep folders under `ablate --aggregate-only`
(docs/reliability.md "Model folders", "Time limits"; docs/ablate.md "Aggregating a sweep folder")."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

from . import probe
from .common import ROOT, base_env, emapg, ok, one_line_error, snapshot

BENCH = "".join(json.dumps({"id": str(i), "question": f"{i}+{i}", "answers": [str(2 * i)]}) + "\n" for i in range(3))
RESPONSES = "".join(json.dumps({"id": str(i), "responses": ["a"]}) + "\n" for i in range(3))


# ---------------------------------------------------------------------------------------------- time limits

@probe("time_limits_bounded")
def time_limits_bounded(ws: Path) -> None:
    """rollout.env_timeout_s=1e13 (an OverflowError in the first wait), search.timeout_s=1e300, search.backoff_s=1e9,
    search.retries=200 (doubling back-off), and `eval --grader-timeout 1e300` with a reward plugin: one line each,
    exit 2, naming the key or option, before anything runs."""
    for key in ("rollout.env_timeout_s=1e13", "search.timeout_s=1e300", "search.backoff_s=1e9", "search.retries=200"):
        one_line_error(emapg(ws, "config", "show", "--preset", "toy", "--set", key, timeout=60), key.split("=")[0])
    (ws / "b.jsonl").write_text(BENCH)
    (ws / "r.jsonl").write_text(RESPONSES)
    (ws / "plug.py").write_text("def score(response, example):\n    return 1.0\n")
    one_line_error(emapg(ws, "eval", "--bench", "b.jsonl", "--responses", "r.jsonl", "--reward", "plug.py:score",
                         "--grader-timeout", "1e300", "--out", "o", timeout=60), "--grader-timeout")
    assert not (ws / "o").exists(), "an output folder was left behind"


# -------------------------------------------------------------------------------------------- model folders

class _Mkdir:
    """A pickle that creates a folder when loaded (what a hostile pytorch_model.bin can do)."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def broken_model_folders(ws: Path) -> dict[str, tuple[Path, str]]:
    """A tiny model and copies of it, each broken one way: {name: (folder, a word the error must hold)}."""
    good = ws / "tiny"
    code = "import sys; from emapg_cli.models.tiny import save_tiny; save_tiny(sys.argv[1], hidden=16, layers=1, heads=2, kv_heads=1)"
    subprocess.run([sys.executable, "-c", code, str(good)], check=True, cwd=ROOT, timeout=120, capture_output=True,
                   env=base_env(ws))
    weights = (good / "model.safetensors").read_bytes()
    config = json.loads((good / "config.json").read_text())
    folders: dict[str, tuple[Path, str]] = {}

    def copy(name: str, needle: str) -> Path:
        shutil.copytree(good, ws / name)
        folders[name] = (ws / name, needle)
        return ws / name

    d = copy("pickle", "pickle")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Mkdir(str(ws / "PWNED"))))
    copy("cfg-list", "not an object").joinpath("config.json").write_text("[]")
    copy("cfg-null", "not an object").joinpath("config.json").write_text("null")
    copy("cfg-latin1", "UTF-8").joinpath("config.json").write_bytes(b'{"model_type": "llama", "name": "\xe9\xff"}')
    copy("cfg-vocab-str", "vocab_size").joinpath("config.json").write_text(json.dumps({**config, "vocab_size": "259"}))
    copy("st-truncated", "cut short").joinpath("model.safetensors").write_bytes(weights[: len(weights) // 2])
    copy("st-zeroed", "safetensors").joinpath("model.safetensors").write_bytes(bytes(len(weights)))
    d = copy("st-link-loop", "link loop")
    (d / "model.safetensors").unlink()
    os.symlink("model.safetensors", d / "model.safetensors")
    os.symlink("dir-link-loop", ws / "dir-link-loop")
    folders["dir-link-loop"] = (ws / "dir-link-loop", "link loop")
    return folders


@probe("model_folders_one_line", slow=True)
def model_folders_one_line(ws: Path) -> None:
    """A model folder whose pytorch_model.bin is a pickle that would create a folder, whose config.json is a list,
    null, not UTF-8 or has a string vocab_size, whose model.safetensors is cut in half or zeroed or a link loop, or
    that is itself a link loop: `eval --model`, `kl-check --model`, `train` with it as model.path and as a teacher's
    anchor.path each say so in one line, exit 2 (they were internal errors, or blamed the hub); the pickle never
    runs; no output folder is left."""
    folders = broken_model_folders(ws)
    (ws / "b.jsonl").write_text(BENCH)
    train = ("train", "--preset", "toy", "--set", "data.train=b.jsonl", "--set", "data.eval=null", "--set", "train.steps=1",
             "--set", "rollout.prompts_per_step=2", "--set", "train.mini_batch_prompts=2", "--set", "rollout.n=2",
             "--set", "rollout.max_new_tokens=4", "--out", "run")
    for name, (folder, needle) in folders.items():
        one_line_error(emapg(ws, "eval", "--bench", "b.jsonl", "--model", str(folder), "--backend", "hf", "--n", "1",
                             "--max-tokens", "4", "--out", "ev"), needle)
        one_line_error(emapg(ws, "kl-check", "--model", str(folder)), needle)
        one_line_error(emapg(ws, *train, "--set", f"model.path={folder}"), "model.path", needle)
        one_line_error(emapg(ws, *train, "--set", f"model.path={ws / 'tiny'}", "--set", "anchor.source=teacher",
                             "--set", f"anchor.path={folder}"), "anchor.path", needle)
        left = [d for d in ("ev", "run") if (ws / d).exists()]
        assert not left, f"{name}: output folders left behind: {left}"
    assert not (ws / "PWNED").exists(), "the pickle in pytorch_model.bin ran"


# ------------------------------------------------------------------------------------------- sweep folders

def _sweep(ws: Path, seeds: int) -> tuple[Path, list]:
    """A sweep folder as `emapg ablate` leaves it (study.yaml, plan.jsonl; kl.k = 1, 8 x `seeds` seeds), every
    run finished (summary.json, metrics.jsonl): built in a subprocess with this checkout's emapg."""
    out = ws / "sweep"
    code = f"""
import json, sys
from pathlib import Path
from emapg_cli.ablate.aggregate import save_plan
from emapg_cli.ablate.grid import parse_grid
from emapg_cli.ablate.runner import run_dir
from emapg_cli.ablate.study import build_sweep, save_sweep
out = Path(sys.argv[1])
sweep = build_sweep(None, "toy", None, [parse_grid("kl.k=1,8")], {seeds}, [])
runs = sweep.runs()
save_sweep(sweep, out)
save_plan(out, runs)
for i, spec in enumerate(runs):
    rdir = run_dir(out, spec)
    rdir.mkdir(parents=True)
    rows = [{{"step": s, "reward/mean": 0.1 * s, "kl/value": 0.01, "eval/accuracy": 0.3 + 0.01 * i}} for s in (1, 2)]
    (rdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    (rdir / "summary.json").write_text(json.dumps({{"eval_accuracy_initial": 0.3, "eval_accuracy_final": 0.4 + 0.01 * i,
                                                   "steps": 2, "wall_time_s": 3.0}}))
"""
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ws, capture_output=True, text=True, timeout=120,
                       env=base_env(ws))
    assert r.returncode == 0, f"could not build the sweep folder: {r.stderr[-400:]}"
    plan = [json.loads(line) for line in (out / "plan.jsonl").read_text().splitlines()]
    return out, plan


def _rewrite_plan(out: Path, rows: list) -> None:
    """plan.jsonl with `rows`: dicts are written as JSON, strings and bytes as they are (one line each)."""
    raw = [r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode() for r in rows]
    (out / "plan.jsonl").write_bytes(b"\n".join(raw) + b"\n")


#: Tampered plan.jsonl rows: (how the first row is replaced, a word the error must hold). Every one is refused in one
#: line naming plan.jsonl:1, before any run's files are read.
BAD_PLAN_ROWS = {
    "not-json": ("{broken", "not a JSON row"),
    "list": ("[1, 2]", "JSON object"),
    "config-id-outside": (lambda r: {**r, "config_id": "../../outside"}, "config_id"),
    "config-id-dotdot": (lambda r: {**r, "config_id": ".."}, "config_id"),
    "config-id-number": (lambda r: {**r, "config_id": 5}, "config_id"),
    "seed-string": (lambda r: {**r, "seed": "0"}, "seed"),
    "seed-1e999": ('{"config_id": "kl.k=1", "seed": 1e999, "values": {"kl.k": 1}, "overrides": []}', "seed"),
    "seed-not-the-sweeps": (lambda r: {**r, "seed": 99}, "seed"),
    "seed-5000-digits": ('{"config_id": "kl.k=1", "seed": ' + "9" * 5000 + ', "values": {}, "overrides": []}', "not a JSON row"),
    "values-list": (lambda r: {**r, "values": [1]}, "values"),
    "values-without-grid-key": (lambda r: {**r, "values": {}, "grid": {}}, "kl.k"),
    "grid-value-not-the-sweeps": (lambda r: {**r, "values": {"kl.k": 3}, "grid": {}}, "kl.k = 3"),
    "overrides-numbers": (lambda r: {**r, "overrides": [1]}, "overrides"),
    "nested": ("[" * 100_000 + "]" * 100_000, "not a JSON row"),
    "not-utf8": (b'{"config_id": "kl.k=1", "seed": 0, "values": {"kl.k": "\xff"}}', "UTF-8"),
}


@probe("ablate_aggregate_tampered_plan")
def ablate_aggregate_tampered_plan(ws: Path) -> None:
    """`ablate --aggregate-only` on a sweep folder whose plan.jsonl row is not JSON, a list, has a config_id of
    `../../outside` (aggregation read runs/../../outside/seed0/summary.json, a file outside the sweep), `..` or a
    number, a seed "0", 1e999, 99 or of 5000 digits, values that are a list or lack the grid key or hold a value the
    sweep does not have, overrides that are numbers, deep nesting, or non-UTF-8 bytes; a row repeated; an empty
    plan: one line each naming plan.jsonl, exit 2, nothing written (no results.csv)."""
    out, plan = _sweep(ws, seeds=1)
    outside = ws / "outside" / "seed0"  # where ../../outside leads from runs/: a finished-looking run of nobody's
    outside.mkdir(parents=True)
    (outside / "summary.json").write_text(json.dumps({"eval_accuracy_final": 0.99, "steps": 1}))
    for name, (change, needle) in BAD_PLAN_ROWS.items():
        first = change(plan[0]) if callable(change) else change
        _rewrite_plan(out, [first, *plan[1:]])
        line = one_line_error(emapg(ws, "ablate", "--aggregate-only", "--out", "sweep", timeout=60), needle)
        assert "plan.jsonl" in line, f"{name}: the error does not name plan.jsonl: {line}"
        assert not (out / "results.csv").exists(), f"{name}: results.csv was written from a tampered plan"
    for name, rows, needle in (("repeated", [plan[0], *plan], "planned twice"), ("empty", [""], "no planned runs")):
        _rewrite_plan(out, rows)
        one_line_error(emapg(ws, "ablate", "--aggregate-only", "--out", "sweep", timeout=60), needle)
    _rewrite_plan(out, plan)
    ok(emapg(ws, "ablate", "--aggregate-only", "--out", "sweep", timeout=120))  # the untouched plan aggregates


#: Tampered files of single runs: (file under the run's folder, its content, a word its warning must hold, the
#: run's status in results.csv). The sweep aggregates (exit 0); each file is warned about or left out as it fits.
BAD_RUN_FILES = {
    "summary-list": ("summary.json", "[1, 2]", "not a readable JSON object", "failed"),
    "summary-null": ("summary.json", "null", "not a readable JSON object", "failed"),
    "summary-not-utf8": ("summary.json", b'{"eval_accuracy_final": "\xff"}', "not a readable JSON object", "failed"),
    "summary-5000-digits": ("summary.json", '{"steps": ' + "9" * 5000 + "}", "not a readable JSON object", "failed"),
    "summary-nested": ("summary.json", "[" * 100_000 + "]" * 100_000, "not a readable JSON object", "failed"),
    "summary-inf-values": ("summary.json", '{"eval_accuracy_final": 1e999, "steps": 1e999, "wall_time_s": true}', None, "done"),
    "metrics-step-1e999": ("metrics.jsonl", '{"step": 1e999, "eval/accuracy": 0.5}\n', "skipped 1", "done"),
    "metrics-list-row": ("metrics.jsonl", "[1, 2]\n", "skipped 1", "done"),
    "metrics-not-utf8": ("metrics.jsonl", b'{"step": 1, "kl/value": "\xff"}\n', "skipped 1", "done"),
    "metrics-step-string": ("metrics.jsonl", '{"step": "two", "kl/value": 0.1}\n', "skipped 1", "done"),
}
#: Status records of unfinished runs (summary.json removed): read as absent, the run pending, no error.
BAD_STATUS = {"status-list": "[1]", "status-not-utf8": b'{"status": "\xff"}', "status-fields-wrong": '{"status": 5, "error": [1], "returncode": "x"}'}


@probe("ablate_aggregate_tampered_runs")
def ablate_aggregate_tampered_runs(ws: Path) -> None:
    """`ablate --aggregate-only` on a sweep whose runs hold a summary.json that is a list, null, not UTF-8, a
    5000-digit number, deep nesting or values of 1e999; metrics.jsonl rows with step 1e999, a list, non-UTF-8 bytes
    or a string step; status records that are a list, not UTF-8 or of wrong types: the sweep aggregates (exit 0,
    results.csv), each unreadable summary makes its run `failed` with a warning naming the file, bad metric rows are
    skipped with a warning counting them, a bad status record reads as none (the run pending)."""
    n = len(BAD_RUN_FILES) + len(BAD_STATUS)
    out, plan = _sweep(ws, seeds=(n + 1) // 2)
    specs = [f"{r['config_id']}/seed{r['seed']}" for r in plan]
    cases = dict(zip(specs, [*BAD_RUN_FILES.items(), *BAD_STATUS.items()]))
    for run_id, (name, case) in cases.items():
        rdir = out / "runs" / run_id
        if name in BAD_STATUS:
            (rdir / "summary.json").unlink()
            for path in (rdir / "status.json", rdir.with_name(f"{rdir.name}.status.json")):
                path.write_bytes(case if isinstance(case, bytes) else case.encode())
            continue
        file, content, _, _ = case
        (rdir / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    r = ok(emapg(ws, "ablate", "--aggregate-only", "--out", "sweep", timeout=180))
    warnings = [ln for ln in r.err.splitlines() if ln.startswith("warning: ")]
    import csv

    status = {row["run_id"]: row["status"] for row in csv.DictReader(open(out / "results.csv"))}
    for run_id, (name, case) in cases.items():
        expected = "pending" if name in BAD_STATUS else case[3]
        assert status.get(run_id) == expected, f"{name}: {run_id} is {status.get(run_id)!r} in results.csv, not {expected}: {r.show()}"
        needle = None if name in BAD_STATUS else case[2]
        if needle is not None:
            hits = [ln for ln in warnings if f"{run_id}/" in ln and needle in ln]
            assert hits, f"{name}: no warning about {run_id}/{case[0]} holding {needle!r}: {r.show()}"


# ------------------------------------------------------------------------------------ config values (issue 40)

@probe("config_values_bounded")
def config_values_bounded(ws: Path) -> None:
    """Values that passed validation and broke later (issue 40, item 5): train.logit_memory_mib=1e308 on a real model's
    plan (an OverflowError in the chunk arithmetic), BEMA's lag 0 with multiplier 0.001 (beta_1 = 0.001^-0.5 = 31.6:
    ema/decay logged as -30.6), BEMA's bias_power 200 below base 1 (an OverflowError at step 1), anchor.rule=previous
    with rollout.max_staleness=1 (the anchor is then not the policy that sampled): one line each, exit 2, nothing run."""
    code = "import sys; from emapg_cli.models.tiny import save_tiny; save_tiny(sys.argv[1], hidden=16, layers=1, heads=2, kv_heads=1)"
    subprocess.run([sys.executable, "-c", code, str(ws / "tiny")], check=True, cwd=ROOT, timeout=120, capture_output=True,
                   env=base_env(ws))
    one_line_error(emapg(ws, "train", "--preset", "toy", "--set", f"model.path={ws / 'tiny'}", "--set",
                         "train.logit_memory_mib=1e308", "--dry-run", timeout=60), "train.logit_memory_mib")
    for sets, needle in ((("anchor.bema.lag=0", "anchor.bema.multiplier=0.001"), "at least 1"),
                         (("anchor.bema.lag=0", "anchor.bema.multiplier=0.5", "anchor.bema.bias_power=50"), "at least 1"),
                         (("anchor.bema.bias_power=200",), "anchor.bema.bias_power")):
        argv = [a for s in ("anchor.rule=bema", *sets) for a in ("--set", s)]
        one_line_error(emapg(ws, "train", "--preset", "toy", *argv, "--dry-run", timeout=60), "anchor.bema", needle)
    one_line_error(emapg(ws, "train", "--preset", "toy", "--set", "anchor.rule=previous", "--set", "rollout.max_staleness=1",
                         "--set", "rollout.engine_url=http://127.0.0.1:9", "--dry-run", timeout=60),
                   "anchor.rule=previous", "rollout.max_staleness")


@probe("resume_changes_the_method")
def resume_changes_the_method(ws: Path) -> None:
    """`train --resume RUN --set anchor.rule=fixed` on a run trained with ema (issue 40, item 4) exited 0, wrote
    `rule: fixed` into config.yaml and printed "the initial policy" while the anchor was the checkpointed EMA: refused
    in one line, nothing written; with --allow-method-change the plan names the checkpointed anchor."""
    run = ws / "run"
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    code = ("import sys; from emapg_cli.config.loading import load_config, to_yaml; "
            "open(sys.argv[1], 'w').write(to_yaml(load_config('toy', None, [])))")
    subprocess.run([sys.executable, "-c", code, str(run / "config.yaml")], check=True, cwd=ROOT, timeout=60,
                   capture_output=True, env=base_env(ws))
    before = snapshot(run)
    one_line_error(emapg(ws, "train", "--resume", "run", "--set", "anchor.rule=fixed", timeout=60),
                   "anchor.rule=ema", "--allow-method-change")
    assert snapshot(run) == before, "the refused resume changed the run folder"
    plan = ok(emapg(ws, "train", "--resume", "run", "--set", "anchor.rule=fixed", "--allow-method-change", "--dry-run",
                    env={"COLUMNS": "400"}, timeout=60))
    assert "the anchor checkpointed at step 4 (anchor.rule=ema's), not the initial policy" in " ".join(plan.out.split()), plan.show()


@probe("plan_says_what_runs")
def plan_says_what_runs(ws: Path) -> None:
    """The plan said what did not happen (issue 40, items 5 and 8): anchor.rule=fixed counted 40 "EMA anchor updates",
    every one a no-op, and reasoning-gym's gameable partial credit trained without a word. Now: "no anchor updates",
    and one warning line naming reward.credit=solved."""
    fixed = ok(emapg(ws, "train", "--preset", "toy", "--set", "anchor.rule=fixed", "--dry-run", timeout=60))
    assert "no anchor updates" in fixed.out and "EMA anchor updates" not in fixed.out, fixed.show()
    partial = ok(emapg(ws, "train", "--preset", "smol", "--set", "reward.credit=partial", "--dry-run", timeout=60))
    warned = [x for x in partial.out.splitlines() if x.startswith("warning: rollout.reward=reasoning-gym trains on partial")]
    assert len(warned) == 1 and "reward.credit=solved" in warned[0], partial.show()
