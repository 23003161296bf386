"""What an anchor is for, measured on every run of a study and once on the initial model (`measure:` in a study file;
docs/ablate.md "The anchor study", docs/evidence.md "The anchor question on a real model").

An anchor is meant to keep the policy's breadth and what it knew. The field measures that with pass@k at larger k
and the number of distinct answers (Yue et al. 2504.13837), and with forgetting on tasks not trained on (RL's Razor,
2509.04259). After a run's training ends, `measure_run` evaluates its final policy with `emapg eval` subprocesses:

- `sampled`: the first `per_task` held-out items of each trained task (data.eval), `n` samples at `temperature`:
  pass@n per task and the distinct answers per item (the answer in the last <answer>...</answer>, or none);
- `untrained`: greedy, on reasoning-gym tasks the study never trains on (`untrained`, prepared once with the same
  chat turns as the training prompts): accuracy against the initial model's (forgetting) and distinct answers.

The per-task greedy held-out accuracy and answers are the run's own final evaluation (evals/step_<N>.jsonl; a run
whose rows lack the answers, written by an older version, is evaluated again greedily into measure/heldout). Once
per study, `measure_base` evaluates the initial model the same way (and greedy on data.eval, the step-0 evaluation each run
would otherwise repeat: the study sets eval.initial=false) and two baselines a gain must clear:

- **best constant**: per task, the accuracy of answering the task's most common gold answer to every item;
- **format only**: the initial model with `format_prefix` (two demonstrations of the answer format), greedy, no RL.

Everything lands under the sweep folder as `emapg eval` folders (results.jsonl, summary.json; no plots), plus
`measure/baselines.json`, so the analysis (`ablate/anchors.py`) reads files only. A measured run's weights (final/,
checkpoints/, and its plots/) are deleted unless `keep_weights`: the folder holds results, never weights.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from emapg_cli.config.loading import load_config
from emapg_cli.data.schema import read_jsonl
from emapg_cli.errors import UserError
from emapg_cli.paths import expand, write_text_atomic

MEASURE_DIR = "measure"
BASELINES = "baselines.json"
DONE = "done.json"  # a run's (or the base's) measurements are complete: written last
KL_FILE = "kl.json"  # heldout_kl of a run
#: The longest answer counted as one (a longer text inside <answer> tags is still one answer, cut to this).
MAX_ANSWER_CHARS = 200
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class Measures(BaseModel):
    """The `measure:` section of a study file."""

    model_config = ConfigDict(extra="forbid")

    per_task: int = Field(32, ge=1, le=10_000, description="Held-out items per trained task (the first of each task in data.eval) sampled `n` times: pass@n and distinct answers.")
    n: int = Field(8, ge=1, le=64, description="Samples per item for pass@n and distinct answers.")
    temperature: float = Field(0.7, gt=0, le=10, description="Sampling temperature of those samples (the training temperature).")
    untrained: str = Field(description="reasoning-gym tasks the study does not train on, as `emapg prepare` names them (reasoning-gym:TASK,TASK): greedy accuracy and distinct answers there, against the initial model's (forgetting).")
    untrained_size: int = Field(50, ge=1, le=10_000, description="Items per untrained task.")
    untrained_seed: int = Field(1, ge=0, description="reasoning-gym seed of the untrained items.")
    untrained_config: dict[str, Any] = Field(default_factory=dict, description="--task-config of the untrained tasks ({TASK: {...}}).")
    format_prefix: list[dict[str, str]] = Field(description="The chat turns of the `format only` baseline: the initial model shown these demonstrations, greedy on data.eval, no RL.")
    keep_weights: bool = Field(False, description="Keep a measured run's final/, checkpoints/ and plots/ (default: deleted once measured; the study folder holds results only, and `emapg plot` redraws a run's plots).")

    @field_validator("untrained")
    @classmethod
    def _gym_tasks(cls, v: str) -> str:
        """Refused when the study file is read, not after the initial model's measurements have started."""
        if not re.fullmatch(r"reasoning-gym:[^,\s]+(,[^,\s]+)*", v):
            raise ValueError("give reasoning-gym:TASK or reasoning-gym:TASK,TASK (as `emapg prepare` names them), "
                             f"not {v!r:.60}")
        return v


class Cost(BaseModel):
    """The `cost:` section of a study file: what one step and one evaluated sequence took on the machine the design was
    fitted to, so `--dry-run` estimates the wall time before anything is prepared."""

    model_config = ConfigDict(extra="forbid")

    jobs: int = Field(1, ge=1, le=64, description="Runs at once the design assumes (the default of --jobs): two 1-thread runs side by side on 2 cores.")
    step_s: float = Field(gt=0, le=86_400, description="Seconds per RL step of one run while `jobs` runs share the machine.")
    sequence_s: float = Field(gt=0, le=3_600, description="Seconds per evaluated sequence (greedy or sampled, eval.max_new_tokens) of one run while `jobs` share the machine.")
    eval_items: int = Field(ge=0, le=1_000_000, description="Items of one evaluation on data.eval (known before the data is prepared).")
    tasks: int = Field(1, ge=1, le=1_000, description="Trained tasks in data.eval (measure.per_task items of each are sampled).")
    measured: str = Field("", description="Where and how step_s and sequence_s were measured (one line).")


# --- answers --------------------------------------------------------------------------------------


def answer_of(response: str) -> Optional[str]:
    """The text of the last <answer>...</answer> of a response, stripped and cut to MAX_ANSWER_CHARS (None without
    one). Counting only: scores come from the reward's own grading in `emapg eval`."""
    found = _ANSWER.findall(response[-16_384:])
    return found[-1].strip()[:MAX_ANSWER_CHARS] if found else None


def task_of(item_id: str) -> str:
    """The task of a reasoning-gym row id `TASK-SEED-INDEX` (datasets/reasoning_gym_data.py)."""
    return item_id.rsplit("-", 2)[0]


def read_results(folder: Path) -> list[dict[str, Any]]:
    """The rows of an `emapg eval` folder's results.jsonl, or of a run's last evals/step_<N>.jsonl."""
    from emapg_cli.evaluation.compare import outcomes_file

    path = outcomes_file(folder)
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get("id"), str):
                    rows.append(row)
    return rows


def per_task(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per task: `accuracy` (mean over items of the fraction of samples correct; greedy: the share solved),
    `pass` (share of items with a correct sample: pass@n with n the samples per item), `distinct` (mean distinct
    answers per item over its samples, no answer counting as one), `distinct_items` (distinct first-sample answers
    across the task's items: 1 when every item gets the same answer), `answered` (share of samples with an answer)
    and `items`."""
    tasks: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        tasks.setdefault(task_of(row["id"]), []).append(row)
    out = {}
    for task, its in tasks.items():
        correct = [[bool(c) for c in r.get("correct") or []] for r in its]
        answers = [[answer_of(str(x)) for x in r.get("responses") or []] for r in its]
        samples = sum(len(a) for a in answers) or 1
        out[task] = {
            "items": float(len(its)),
            "accuracy": sum(sum(c) / len(c) for c in correct if c) / len(its),
            "pass": sum(any(c) for c in correct) / len(its),
            "distinct": sum(len(set(a)) for a in answers if a) / len(its),
            "distinct_items": float(len({a[0] for a in answers if a and a[0] is not None})),
            "answered": sum(x is not None for a in answers for x in a) / samples,
        }
    return out


def best_constant(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per task of data rows ({id, answers}): the most common gold answer and the share of items it solves
    (`accuracy`; ties: the first answer in the rows' order)."""
    tasks: dict[str, list[str]] = {}
    for row in rows:
        tasks.setdefault(task_of(row["id"]), []).append(str((row.get("answers") or [""])[0]).strip())
    out = {}
    for task, golds in tasks.items():
        answer, count = Counter(golds).most_common(1)[0]
        out[task] = {"answer": answer, "accuracy": count / len(golds), "items": len(golds)}
    return out


# --- running --------------------------------------------------------------------------------------


def _emapg(args: list[str], log: Path, env: Optional[dict[str, str]] = None, module: str = "emapg_cli") -> None:
    """Run `emapg ARGS` (this interpreter's emapg; with `module`, `python -m emapg_cli.ablate.measures ARGS`: heldout_kl
    in a process of its own), appending its output to `log`; UserError naming the log on failure."""
    own = module == "emapg_cli"
    with open(log, "a") as f:
        f.write(f"$ emapg {' '.join(args)}\n" if own else f"$ python -m {module} {args[0]} ...\n")
        f.flush()
        rc = subprocess.call([sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    if rc != 0:
        raise UserError(f"measuring failed: {f'`emapg {args[0]}`' if own else 'the held-out KL'} exited {rc} (its output: {log})")


def _evaluate(sweep, model: str, bench: Path, out: Path, n: int, temperature: float, log: Path,
              env: Optional[dict[str, str]], sets: tuple[str, ...] = ()) -> None:
    """One `emapg eval` into `out` (skipped when it finished before), its plots removed (results only)."""
    if (out / "summary.json").is_file():
        return
    if out.exists():
        shutil.rmtree(out)  # an interrupted evaluation of ours: start it again
    _emapg(sweep.command("eval", [*sweep.set, *sets]) + ["--model", model, "--bench", str(bench), "--n", str(n),
                                                        "--temperature", str(temperature), "--out", str(out)], log, env)
    shutil.rmtree(out / "plots", ignore_errors=True)


def benches(out: Path) -> Path:
    return out / MEASURE_DIR / "benches"


def prepare_benches(sweep, m: Measures, out: Path, log: Path) -> None:
    """Once per study: the sampled subset of data.eval, the untrained tasks' rows and the best-constant baselines."""
    folder = benches(out)
    if (out / MEASURE_DIR / BASELINES).is_file():
        return
    folder.mkdir(parents=True, exist_ok=True)
    cfg = load_config(sweep.preset, sweep.config, sweep.set)
    heldout = list(read_jsonl(expand(cfg.data.eval)))
    seen: Counter = Counter()
    sampled = []
    for row in heldout:
        task = task_of(row["id"])
        if seen[task] < m.per_task:
            seen[task] += 1
            sampled.append(row)
    write_text_atomic(folder / "sampled.jsonl", "".join(json.dumps(r) + "\n" for r in sampled))
    untrained = folder / "untrained"
    if not (untrained / "data.jsonl").is_file():
        shutil.rmtree(untrained, ignore_errors=True)
        _emapg(["prepare", m.untrained, "--size", str(m.untrained_size), "--seed", str(m.untrained_seed),
                "--task-config", json.dumps(m.untrained_config), "--out", str(untrained)], log)
    rows = list(read_jsonl(untrained / "data.jsonl"))
    baselines = {"heldout": best_constant(heldout), "untrained": best_constant(rows)}
    write_text_atomic(out / MEASURE_DIR / BASELINES, json.dumps({"best_constant": baselines}, indent=2) + "\n")


def measure_base(sweep, m: Measures, out: Path, log: Path, env: Optional[dict[str, str]] = None) -> None:
    """Once per study: the initial model greedy on data.eval, sampled, on the untrained tasks, and format-only."""
    base = out / MEASURE_DIR / "base"
    if (base / DONE).is_file():
        return
    prepare_benches(sweep, m, out, log)
    cfg = load_config(sweep.preset, sweep.config, sweep.set)
    model, folder, heldout = str(expand(cfg.model.path)), benches(out), expand(cfg.data.eval)
    _evaluate(sweep, model, heldout, base / "heldout", 1, 0.0, log, env)
    _evaluate(sweep, model, folder / "sampled.jsonl", base / "sampled", m.n, m.temperature, log, env)
    _evaluate(sweep, model, folder / "untrained", base / "untrained", 1, 0.0, log, env)
    _evaluate(sweep, model, heldout, base / "format_only", 1, 0.0, log, env,
              (f"data.chat_prefix={json.dumps(m.format_prefix)}",))
    make_portable([*_records(base), log], out)
    write_text_atomic(base / DONE, "{}\n")


def measure_run(sweep, m: Measures, out: Path, rdir: Path, log: Path, env: Optional[dict[str, str]] = None) -> None:
    """After a run's training: its final policy sampled and on the untrained tasks; then its weights go."""
    here = rdir / MEASURE_DIR
    if (here / DONE).is_file():
        return
    prepare_benches(sweep, m, out, log)
    policy = rdir / "final" / "policy"
    if not policy.is_dir():
        raise UserError(f"measuring {rdir}: its final policy ({policy}) is gone; delete the run folder to run it again")
    cfg = load_config(sweep.preset, sweep.config, sweep.set)
    if not all("responses" in row for row in read_results(rdir)):  # a run of an older version: its answers again
        _evaluate(sweep, str(policy), expand(cfg.data.eval), here / "heldout", 1, 0.0, log, env)
    _evaluate(sweep, str(policy), benches(out) / "sampled.jsonl", here / "sampled", m.n, m.temperature, log, env)
    _evaluate(sweep, str(policy), benches(out) / "untrained", here / "untrained", 1, 0.0, log, env)
    if not (here / KL_FILE).is_file():
        _emapg(["kl", str(policy), str(expand(cfg.model.path)), str(here / "sampled"), str(benches(out) / "sampled.jsonl"),
                json.dumps(cfg.data.prefix_messages()), str(here / KL_FILE)], log, env, "emapg_cli.ablate.measures")
    make_portable([*_records(here), rdir / "config.yaml", rdir.with_name(rdir.name + ".log"),
                   rdir.with_name(rdir.name + ".status.json")], out)
    write_text_atomic(here / DONE, "{}\n")
    if not m.keep_weights:
        for name in ("final", "checkpoints", "plots"):  # plots: `emapg plot RUN` draws them again from metrics.jsonl
            shutil.rmtree(rdir / name, ignore_errors=True)


def heldout_kl(policy: str, initial: str, sampled: Path, bench: Path, prefix: list[dict[str, str]]) -> dict[str, float]:
    """The KL to the initial model on held-out prompts, per response token:

        KL_t = sum_v pi(v | s_t) (log pi(v | s_t) - log pi_0(v | s_t))        (exact over the vocabulary)

    at every response position s_t of the policy's first sample of each item of the `sampled` evaluation (held-out
    prompts at the training temperature; the response text re-tokenised, which can split a word differently from the
    sampled ids), averaged over the tokens (`kl`) and, summed per response, over the items (`kl_sequence`). The
    distributions are the models' own (temperature 1). Runs in its own process (`python -m emapg_cli.ablate.measures`)."""
    import torch

    from emapg_cli.models.loading import load_causal_lm, load_tokenizer
    from emapg_cli.models.prompts import render_prompt

    tok = load_tokenizer(initial)
    pi, pi0 = load_causal_lm(policy, "float32").eval(), load_causal_lm(initial, "float32").eval()
    questions = {r["id"]: r["question"] for r in read_jsonl(bench)}
    tokens, total, seqs = 0, 0.0, []
    with torch.no_grad():
        for row in read_results(sampled):
            response = str((row.get("responses") or [""])[0])[:4096]
            prompt = render_prompt(tok, questions[row["id"]], prefix)
            resp = tok(response, add_special_tokens=False)["input_ids"]
            if not resp:
                continue
            ids = torch.tensor([prompt + resp])  # [1, P + R]
            at = slice(len(prompt) - 1, ids.shape[1] - 1)  # the positions that predict the response's tokens
            lp = torch.log_softmax(pi(ids).logits[0, at].float(), -1)  # [R, V]
            lq = torch.log_softmax(pi0(ids).logits[0, at].float(), -1)  # [R, V]
            kl = (lp.exp() * (lp - lq)).sum(-1)  # [R]
            tokens, total = tokens + kl.numel(), total + float(kl.sum())
            seqs.append(float(kl.sum()))
    return {"kl": total / tokens if tokens else float("nan"), "kl_sequence": sum(seqs) / len(seqs) if seqs else float("nan"),
            "tokens": float(tokens), "responses": float(len(seqs))}


def make_portable(files: list[Path], out: Path) -> None:
    """The study's records name no path of the machine they ran on, so the folder can be committed and rebuilt
    anywhere: in these text files the study folder's absolute path becomes `out` as given, and the expanded
    $EMAPG_HOME becomes `$EMAPG_HOME` (results.jsonl hold model output, not paths, and are left as they are)."""
    from emapg_cli.paths import emapg_home

    swaps = [(str(out.resolve()), str(out)), (str(emapg_home().resolve()), "$EMAPG_HOME")]
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        new = text
        for old, by in swaps:
            new = new.replace(old, by)
        if new != text:
            write_text_atomic(path, new)


def _records(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and p.suffix in (".json", ".md", ".yaml", ".log")]


def is_measured(rdir: Path) -> bool:
    return (rdir / MEASURE_DIR / DONE).is_file()


# --- reading back ----------------------------------------------------------------------------------


def read_base(out: Path) -> dict[str, Any]:
    """{"heldout", "sampled", "untrained", "format_only": per_task(...), "best_constant": {...}} of the study's base
    measurements, each {} when missing."""
    base = out / MEASURE_DIR / "base"
    found: dict[str, Any] = {name: _per_task_of(base / name) for name in ("heldout", "sampled", "untrained", "format_only")}
    try:
        found["best_constant"] = json.loads((out / MEASURE_DIR / BASELINES).read_text())["best_constant"]
    except (OSError, ValueError, KeyError, TypeError):
        found["best_constant"] = {}
    return found


def read_run(rdir: Path) -> dict[str, Any]:
    """{"heldout": per task of the run's final evaluation, "sampled", "untrained"}, each {} when missing, and "kl"
    (heldout_kl's numbers, {} when missing)."""
    found: dict[str, Any] = {}
    try:
        found["kl"] = json.loads((rdir / MEASURE_DIR / KL_FILE).read_text())
    except (OSError, ValueError):
        found["kl"] = {}
    greedy = rdir / MEASURE_DIR / "heldout"  # the final evaluation again, where the run's rows lack the answers
    found["heldout"] = _per_task_of(greedy if greedy.is_dir() else rdir)
    return {**found, **{name: _per_task_of(rdir / MEASURE_DIR / name) for name in ("sampled", "untrained")}}


def _per_task_of(folder: Path) -> dict[str, Any]:
    """per_task of an evaluation folder's results; {} when it is missing or unreadable."""
    try:
        return per_task(read_results(folder))
    except (UserError, OSError, ValueError):
        return {}


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize_run(found: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """One run's numbers against the study's base (`read_run`, `read_base`), accuracies as fractions:

    - `gain`: mean over trained tasks of final greedy accuracy − max(best constant, format only) of that task;
    - `pass_n`, `distinct`: mean over trained tasks of pass@n and of distinct sampled answers per item;
    - `distinct_items`: mean over trained tasks of distinct greedy answers across the task's items;
    - `forgetting`: mean over untrained tasks of the initial model's greedy accuracy − the run's (> 0: forgot);
    - `untrained_distinct_items`: distinct greedy answers across the items of an untrained task, mean over tasks;
    - `kl_heldout`: heldout_kl's per-token KL to the initial model on held-out prompts;
    - `tasks`: per trained task {final, pass, distinct, distinct_items}."""
    heldout, sampled, untrained = found["heldout"], found["sampled"], found["untrained"]
    constant, fmt = base["best_constant"].get("heldout", {}), base["format_only"]
    gains = []
    for task, t in heldout.items():
        bars = [x for x in ((constant.get(task) or {}).get("accuracy"), (fmt.get(task) or {}).get("accuracy")) if x is not None]
        gains.append(t["accuracy"] - max(bars) if bars else None)
    start = base["untrained"]
    return {
        "gain": _mean(gains),
        "pass_n": _mean(v["pass"] for v in sampled.values()),
        "distinct": _mean(v["distinct"] for v in sampled.values()),
        "distinct_items": _mean(v["distinct_items"] for v in heldout.values()),
        "forgetting": _mean(start[t]["accuracy"] - u["accuracy"] for t, u in untrained.items() if t in start),
        "untrained_distinct_items": _mean(u["distinct_items"] for u in untrained.values()),
        "kl_heldout": (found.get("kl") or {}).get("kl"),
        "tasks": {t: {"final": v["accuracy"], "pass": (sampled.get(t) or {}).get("pass"),
                      "distinct": (sampled.get(t) or {}).get("distinct"), "distinct_items": v["distinct_items"]}
                  for t, v in heldout.items()},
    }


if __name__ == "__main__":  # kl POLICY INITIAL SAMPLED_DIR BENCH PREFIX_JSON OUT: heldout_kl into OUT
    _, verb, policy_, initial_, sampled_, bench_, prefix_, out_ = sys.argv
    assert verb == "kl"
    numbers = heldout_kl(policy_, initial_, Path(sampled_), Path(bench_), json.loads(prefix_))
    write_text_atomic(Path(out_), json.dumps(numbers, indent=2) + "\n")
