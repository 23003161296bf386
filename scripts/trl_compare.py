"""Whole-step throughput of emapg vs TRL's GRPOTrainer on the toy preset, side by side; the ratio is the last line.

Both sides: the toy's model and training prompts (rendered through the same chat template; the
script checks the prompt token ids are equal), 32 prompts x 8 samples, 14 new tokens, 2 AdamW
steps of 16 prompts per RL step, lr 3e-4, beta 0.01, the same `math` reward logic (emapg's grader:
plain answers settled in-process, math-verify in a 2-process pool), 2 torch threads. emapg: EMA
anchor eta 0.9 every 5 steps (TRL: ref_model_mixup_alpha 0.1, ref_model_sync_steps 10 -- not the
same schedule), dual clip off (TRL has none). Rounds alternate emapg and TRL; each reports the median
tokens/s of its timed RL steps after warm-up steps; the script prints every round, the medians, and
last the ratio emapg / TRL.

TRL runs in its own virtual environment (never an emapg dependency), for example:

    python3 -m venv venv-trl && venv-trl/bin/pip install torch==2.13.0 && \\
        venv-trl/bin/pip install trl==1.16.0 transformers==<emapg's> math-verify==<emapg's>
    emapg prepare --preset toy
    python scripts/trl_compare.py --trl-python venv-trl/bin/python --rounds 3

Run it on a quiet machine: other jobs on the cores change both sides' times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS, N, NEW_TOKENS, MINI_PROMPTS, LR, BETA = 32, 8, 14, 16, 3e-4, 0.01


def toy_dir() -> Path:
    home = Path(os.environ.get("EMAPG_HOME", Path.home() / ".emapg"))
    d = home / "toy"
    if not (d / "model").is_dir():
        sys.exit(f"no toy task under {d}: run `emapg prepare --preset toy` first")
    return d


def emapg_round(steps: int, warmup: int, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        sets = [a for kv in extra for a in ("--set", kv)]
        subprocess.run([sys.executable, "-m", "emapg_cli", "bench", "step", "--preset", "toy", "--steps", str(steps),
                        "--warmup", str(warmup), "--set", "train.torch_threads=2", "--set", "train.dual_clip=null",
                        "--set", "eval.every=0", *sets, "--json", str(out)],
                       check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["tokens_per_s"]


def trl_round(python: str, steps: int, warmup: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trl.json"
        subprocess.run([python, __file__, "--trl-worker", "--steps", str(steps), "--warmup", str(warmup), "--json", str(out)],
                       check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        return json.loads(out.read_text())["tokens_per_s"]


def trl_worker(steps: int, warmup: int, json_path: Path) -> None:
    """Runs inside the TRL environment: GRPOTrainer on the toy, timing each RL step (2 optimizer steps)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from emapg_cli.grading import Gold, MathGrader

    torch.set_num_threads(2)
    d = toy_dir()
    tok = AutoTokenizer.from_pretrained(d / "model")
    model = AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32)
    rows = [json.loads(line) for line in (d / "train.jsonl").read_text().splitlines()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answers": r["answers"]} for r in rows])
    # the same prompt token ids as emapg's render_prompt (chat template, then tokenise without special tokens)
    text = tok.apply_chat_template(data[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert tok(text, add_special_tokens=False)["input_ids"] == tok.apply_chat_template(
        data[0]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"], "prompt ids differ"
    grader = MathGrader(workers=2)
    tokens: list[int] = []

    def reward(completions, answers, **kw):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        ids = kw.get("completion_ids")
        tokens.append(sum(len(x) for x in ids) if ids is not None else sum(len(tok(t)["input_ids"]) for t in texts))
        return [1.0 if g.correct else 0.0 for g in grader.grade(texts, [Gold(tuple(a)) for a in answers])]

    wanted = dict(
        output_dir=str(json_path.parent / "trl-out"), learning_rate=LR, beta=BETA, num_generations=N,
        per_device_train_batch_size=MINI_PROMPTS * N, generation_batch_size=PROMPTS * N,  # -> 2 optimizer steps per generation
        gradient_accumulation_steps=1, max_completion_length=NEW_TOKENS, temperature=1.0, epsilon=0.2, epsilon_high=0.28,
        loss_type="grpo", sync_ref_model=True, ref_model_mixup_alpha=0.1, ref_model_sync_steps=10,
        max_steps=2 * (warmup + steps), logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        bf16=False, seed=0, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant",
        gradient_checkpointing=False,  # TRL's default is on; emapg's toy preset recomputes nothing
    )
    import dataclasses

    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    unmatched = sorted(set(wanted) - known)
    cfg = GRPOConfig(**{k: v for k, v in wanted.items() if k in known})
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    start = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    grader.close()
    marks = [start] + times[1::2]  # one RL step = one generation + 2 optimizer steps
    step_s = [b - a for a, b in zip(marks, marks[1:])][warmup:]
    rates = [t / s for t, s in zip(tokens[warmup:], step_s)]
    json_path.write_text(json.dumps({"tokens_per_s": statistics.median(rates), "step_s": step_s, "tokens": tokens,
                                     "unmatched_settings": unmatched}))
    if unmatched:
        print(f"TRL settings not available in this version: {', '.join(unmatched)}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", help="Python of the environment that has TRL installed.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="Timed RL steps per round.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed RL steps first.")
    parser.add_argument("--emapg-set", action="append", default=[], metavar="KEY=VALUE",
                        help="An extra config override for emapg's side (repeatable), e.g. train.share_prompts=never.")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.steps, args.warmup, args.json)
        return
    if not args.trl_python:
        sys.exit("pass --trl-python (the interpreter of a virtual environment with TRL)")
    toy_dir()
    ours, theirs = [], []
    for r in range(args.rounds):
        ours.append(emapg_round(args.steps, args.warmup, args.emapg_set))
        theirs.append(trl_round(args.trl_python, args.steps, args.warmup))
        print(f"round {r + 1}: emapg {ours[-1]:.0f} tok/s, TRL {theirs[-1]:.0f} tok/s")
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"median: emapg {a:.0f} tok/s, TRL {b:.0f} tok/s")
    print(f"ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
