"""Refactors must not change training: the same seeds give bit-identical final weights before and after.

Three short CPU runs (a single-turn run, a search-agent run over a BM25 index, and a 2-process DDP run, the last
marked slow) are hashed (sha256 of final/policy and final/anchor). Floating-point results depend on the CPU's
instruction set and on torch, so each expectation is stored per (CPU capability, torch version) in
`golden_weights.json`. On a machine with no stored expectation the test checks the baseline commit out of git
history (`git archive BASELINE`, the code before the redesign of the extension points) into a temporary folder,
runs the same command there and compares: the comparison still happens, only the reference is computed. Without
git history (a shallow copy) it skips, saying so.

Record new expectations with `EMAPG_RECORD_GOLDEN=1 pytest tests/test_golden_weights.py` on the baseline commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train_helpers import free_port, run, tiny_overrides, write_dataset

#: The last commit before issue 19's redesign: the behaviour every later commit must reproduce.
BASELINE = "aa08d4efabf7a29e099bb2b1233083660375b53a"
GOLDEN = Path(__file__).with_name("golden_weights.json")
ROOT = Path(__file__).resolve().parents[1]
DOCS = [("Paris", "Paris is the capital of France."), ("Rome", "Rome is the capital of Italy."),
        ("Madrid", "Madrid is the capital of Spain."), ("Berlin", "Berlin is the capital of Germany.")]


def _machine() -> str:
    return f"{torch.backends.cpu.get_cpu_capability()}|torch {torch.__version__.split('+')[0]}"


def _search_setup(tmp: Path, code: Path = ROOT) -> tuple[Path, Path]:
    """The QA rows and a BM25 index built by the source tree `code` (in a subprocess: the baseline commit reads only
    the index format it wrote, emapg-bm25/1)."""
    corpus = tmp / "corpus.jsonl"
    build = ("import json, sys; from pathlib import Path; from emapg_cli.retrieval.bm25 import build_index; "
             "from emapg_cli.retrieval.corpus import paragraph_contents; docs = json.loads(sys.argv[1]); "
             "Path(sys.argv[2]).write_text(''.join(json.dumps({'id': str(i), 'contents': paragraph_contents(t, x)}) + "
             "'\\n' for i, (t, x) in enumerate(docs))); build_index(Path(sys.argv[2]), Path(sys.argv[3]))")
    proc = subprocess.run([sys.executable, "-c", build, json.dumps(DOCS), str(corpus), str(tmp / "index")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(code)}, cwd=code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [{"id": f"q{i}", "question": f"What is the capital of {c}", "answers": [a]}
            for i, (c, a) in enumerate([("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin")])]
    data = tmp / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data, tmp / "index"


def _options(case: str, model: Path, tmp: Path, baseline: bool, code: Path = ROOT) -> list[str]:
    """--set options of `case`; `baseline` spells keys as the baseline commit did (renamed keys only); `code`: the
    source tree whose retriever builds the search case's index."""
    if case in ("single", "ddp"):
        extra = {"train.micro_batch_size": 2, "eval.anchor_every": 0} if case == "ddp" else {}
        return tiny_overrides(model, write_dataset(tmp / "train.jsonl"), steps=2, **{"train.save_every": 0, **extra})
    data, index = _search_setup(tmp, code)
    turns = {"rollout.max_turns": 2} if baseline else {"search.max_turns": 2}
    return tiny_overrides(model, data, steps=2, **{
        "rollout.reward": "em", "rollout.max_new_tokens": 8, "data.eval_limit": 2, "data.max_prompt_tokens": 1000,
        "train.save_every": 0, "search.enabled": "true", "search.retriever": "bm25", f"search.index": index,
        "search.max_obs_tokens": 32, "search.max_context_tokens": 1024, "eval.max_new_tokens": 8, **turns})


def _train(code: Path, case: str, opts: list[str], out: Path) -> dict[str, str]:
    """Run `emapg train` from the source tree `code`; sha256 of the final weights."""
    launcher = str(code / "tests" / "train_launcher.py")
    cmd = [sys.executable, launcher, "train", *opts, "--out", str(out)]
    if case == "ddp":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), *cmd[1:]]
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=code)
    assert proc.returncode == 0, f"{code}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return {part: hashlib.sha256((out / "final" / part / "model.safetensors").read_bytes()).hexdigest()
            for part in ("policy", "anchor")}


def _baseline_tree(tmp: Path) -> Path:
    """The baseline commit's files, extracted from git history into `tmp/baseline`."""
    if not (ROOT / ".git").exists():
        pytest.skip("no git history here to take the baseline commit from, and no stored expectation for this machine")
    probe = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BASELINE}^{{commit}}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"baseline commit {BASELINE[:10]} is not in this clone's history (shallow?), and no stored expectation for this machine")
    dest = tmp / "baseline"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASELINE], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


@pytest.mark.parametrize("case", ["single", "search", pytest.param("ddp", marks=pytest.mark.slow)])
def test_weights_match_the_baseline(case, tiny_qwen2, tmp_path):
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    key = _machine()
    record = os.environ.get("EMAPG_RECORD_GOLDEN") == "1"
    (tmp_path / "now").mkdir()
    got = _train(ROOT, case, _options(case, tiny_qwen2, tmp_path / "now", baseline=record), tmp_path / "now" / "run")
    if record:
        golden.setdefault(key, {})[case] = got
        GOLDEN.write_text(json.dumps(golden, indent=2, sort_keys=True) + "\n")
        return
    expected = golden.get(key, {}).get(case)
    if expected is None:  # no stored expectation for this CPU/torch: compute the baseline's weights here
        base = _baseline_tree(tmp_path)
        (tmp_path / "then").mkdir()
        expected = _train(base, case, _options(case, tiny_qwen2, tmp_path / "then", baseline=True, code=base),
                          tmp_path / "then" / "run")
    assert got == expected, f"{case}: final weights differ from the baseline's ({key})"
