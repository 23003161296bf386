"""Whole-step throughput of emapg vs TRL's GRPOTrainer on a preset (the toy, or the real 135M model's `smol`), side by
side, with where each spends its time; the ratio is the last line.

Both sides: the preset's model and training prompts (rendered through the same chat template, after the preset's
chat turns when it has them; the script checks the prompt token ids are equal), its prompts per step, group size,
new tokens, learning rate and beta, optimizer steps per RL step (rollout.prompts_per_step / train.mini_batch_prompts),
the same `math` reward logic (emapg's grader: plain answers settled in-process, math-verify in a 2-process pool;
`--set rollout.reward=math` on emapg's side), the same torch threads. The EMA anchor: emapg's decay eta every
ema.update_period RL steps; TRL's `sync_ref_model` with ref_model_mixup_alpha = 1 - eta every update_period x (its
optimizer steps per RL step) steps. emapg's dual clip is off (TRL has none). Rounds alternate emapg and TRL; each
reports the median tokens/s of its timed RL steps after warm-up steps and the median seconds of each phase
(generation, reward, log-prob passes, update, the rest); the script prints every round, the medians, the breakdowns
and last the ratio emapg / TRL.

TRL runs in its own virtual environment (never an emapg dependency), for example:

    python3 -m venv venv-trl && venv-trl/bin/pip install torch==2.13.0 && \\
        venv-trl/bin/pip install trl==1.16.0 transformers==<emapg's> math-verify==<emapg's>
    emapg prepare --preset toy
    python scripts/benchmarks/trl_compare.py --trl-python venv-trl/bin/python --rounds 3
    emapg prepare --preset smol
    python scripts/benchmarks/trl_compare.py --preset smol --trl-python venv-trl/bin/python --rounds 3 --threads 2

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

REPO = Path(__file__).resolve().parents[2]
PHASES = ("generation", "reward", "passes", "update", "other")


def settings(preset: str, model: str | None) -> dict:
    """The numbers both sides share, read from the preset (in emapg's environment)."""
    sys.path.insert(0, str(REPO))
    from emapg_cli.config.loading import load_config
    from emapg_cli.paths import expand

    cfg = load_config(preset, overrides=[f"model.path={model}"] if model else [])
    folder = expand(cfg.model.path)
    if not (folder / "config.json").is_file():
        sys.exit(f"no model under {folder}: run `emapg prepare --preset {preset}` first (or pass --model)")
    r, t = cfg.rollout, cfg.train
    prefix = cfg.data.prefix_messages()  # chat turns before the question (data.chat_prefix)
    return dict(preset=preset, model=str(folder), data=str(expand(cfg.data.train)), prompts=r.prompts_per_step, n=r.n,
                new_tokens=r.max_new_tokens, mini_prompts=t.mini_batch_prompts, lr=cfg.optim.lr, beta=cfg.kl.coef,
                temperature=r.temperature, eta=cfg.ema.decay, period=cfg.ema.update_period, prefix=list(prefix))


def emapg_round(s: dict, steps: int, warmup: int, threads: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        sets = [a for kv in [f"model.path={s['model']}", f"train.torch_threads={threads}", "train.dual_clip=null", "eval.every=0",
                             "rollout.reward=math", *extra] for a in ("--set", kv)]
        subprocess.run([sys.executable, "-m", "emapg_cli", "bench", "step", "--preset", s["preset"], "--steps", str(steps),
                        "--warmup", str(warmup), *sets, "--json", str(out)],
                       check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
        r = json.loads(out.read_text())
        phases = {"generation": r["generation_s"], "reward": r["reward_s"], "passes": r["passes_s"], "update": r["update_s"]}
        phases["other"] = r["step_s"] - sum(phases.values())
        return {"tokens_per_s": r["tokens_per_s"], "step_s": r["step_s"], "phases": phases}


def trl_round(python: str, s: dict, steps: int, warmup: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trl.json"
        subprocess.run([python, __file__, "--trl-worker", json.dumps(s), "--steps", str(steps), "--warmup", str(warmup),
                        "--threads", str(threads), "--json", str(out)],
                       check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        return json.loads(out.read_text())


def _timed(cls, name: str, clock: dict) -> None:
    """Wrap cls.name so that its wall seconds add up in clock[name] (nested calls counted once)."""
    inner = getattr(cls, name)

    def wrapper(self, *a, **kw):
        start = time.perf_counter()
        try:
            return inner(self, *a, **kw)
        finally:
            clock[name] = clock.get(name, 0.0) + time.perf_counter() - start

    setattr(cls, name, wrapper)


def trl_worker(s: dict, steps: int, warmup: int, threads: int, json_path: Path) -> None:
    """Runs inside the TRL environment: GRPOTrainer on the preset's model and prompts, timing each RL step (one
    generation and prompts / mini_prompts optimizer steps) and its phases."""
    import dataclasses

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from emapg_cli.grading import Gold, MathGrader

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    rows = [json.loads(line) for line in Path(s["data"]).read_text().splitlines() if line.strip()]
    data = Dataset.from_list([{"prompt": [*s["prefix"], {"role": "user", "content": r["question"]}], "answers": r["answers"]}
                              for r in rows])
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

    per_rl = s["prompts"] // s["mini_prompts"]  # optimizer steps per RL step
    per_opt = s["mini_prompts"] * s["n"]  # sequences per optimizer step
    micro = min(s.get("trl_micro") or per_opt, per_opt)  # sequences per forward/backward (gradient accumulation)
    if per_opt % micro:
        sys.exit(f"--trl-micro-batch {micro} does not divide the {per_opt} sequences of an optimizer step")
    wanted = dict(
        output_dir=str(json_path.parent / "trl-out"), learning_rate=s["lr"], beta=s["beta"], num_generations=s["n"],
        per_device_train_batch_size=micro, generation_batch_size=s["prompts"] * s["n"],
        gradient_accumulation_steps=per_opt // micro, max_completion_length=s["new_tokens"], temperature=s["temperature"], epsilon=0.2,
        epsilon_high=0.28, loss_type="grpo", sync_ref_model=True, ref_model_mixup_alpha=1 - s["eta"],
        ref_model_sync_steps=s["period"] * per_rl, max_steps=per_rl * (warmup + steps), logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, bf16=False, seed=0, weight_decay=0.0, max_grad_norm=1.0,
        lr_scheduler_type="constant", gradient_checkpointing=False,  # TRL's default is on; emapg's presets recompute nothing
    )
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    unmatched = sorted(set(wanted) - known)
    cfg = GRPOConfig(**{k: v for k, v in wanted.items() if k in known})
    clock: dict[str, float] = {}
    for name in ("_generate", "_calculate_rewards", "_generate_and_score_completions", "training_step", "_prepare_inputs"):
        _timed(GRPOTrainer, name, clock)
    marks: list[tuple[float, dict]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            marks.append((time.perf_counter(), dict(clock)))

    start = (time.perf_counter(), {})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    grader.close()
    ends = [start] + marks[per_rl - 1::per_rl]  # one RL step = one generation + per_rl optimizer steps
    rates, step_s, phases = [], [], []
    for i, ((t0, c0), (t1, c1)) in enumerate(zip(ends, ends[1:])):
        if i < warmup:
            continue
        d = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in clock}
        ph = {"generation": d["_generate"], "reward": d["_calculate_rewards"],
              "passes": d["_generate_and_score_completions"] - d["_generate"] - d["_calculate_rewards"],
              "update": d["training_step"] - d["_prepare_inputs"]}
        ph["other"] = (t1 - t0) - sum(ph.values())
        step_s.append(t1 - t0)
        rates.append(tokens[i] / (t1 - t0))
        phases.append(ph)
    json_path.write_text(json.dumps({"tokens_per_s": statistics.median(rates), "step_s": statistics.median(step_s),
                                     "phases": {k: statistics.median(p[k] for p in phases) for k in PHASES},
                                     "tokens": tokens, "unmatched_settings": unmatched}))
    if unmatched:
        print(f"TRL settings not available in this version: {', '.join(unmatched)}", file=sys.stderr)


def breakdown(name: str, rounds: list[dict]) -> str:
    med = {k: statistics.median(r["phases"][k] for r in rounds) for k in PHASES}
    step = statistics.median(r["step_s"] for r in rounds)
    return f"{name:>6} step {step:.2f} s: " + ", ".join(f"{k} {v:.2f} s ({100 * v / step:.0f}%)" for k, v in med.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", help="Python of the environment that has TRL installed.")
    parser.add_argument("--preset", default="toy", help="toy (default) or smol (or any preset with a local model).")
    parser.add_argument("--model", help="A model folder in place of the preset's model.path (both sides).")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="Timed RL steps per round.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed RL steps first.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides.")
    parser.add_argument("--trl-micro-batch", type=int, metavar="N",
                        help="TRL's per_device_train_batch_size (sequences per forward/backward; gradient accumulation "
                             "fills the optimizer step). Default: a whole optimizer step in one pass. On the smol preset "
                             "that (128 sequences, no gradient checkpointing) was killed for memory on 24 GiB: use 32.")
    parser.add_argument("--emapg-set", action="append", default=[], metavar="KEY=VALUE",
                        help="An extra config override for emapg's side (repeatable), e.g. train.share_prompts=never.")
    parser.add_argument("--trl-worker", metavar="SETTINGS", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker), args.steps, args.warmup, args.threads, args.json)
        return
    if not args.trl_python:
        sys.exit("pass --trl-python (the interpreter of a virtual environment with TRL)")
    s = settings(args.preset, args.model)
    s["trl_micro"] = args.trl_micro_batch
    ours, theirs = [], []
    for r in range(args.rounds):
        ours.append(emapg_round(s, args.steps, args.warmup, args.threads, args.emapg_set))
        theirs.append(trl_round(args.trl_python, s, args.steps, args.warmup, args.threads))
        print(f"round {r + 1}: emapg {ours[-1]['tokens_per_s']:.0f} tok/s, TRL {theirs[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    a, b = (statistics.median(x["tokens_per_s"] for x in side) for side in (ours, theirs))
    print(f"median: emapg {a:.0f} tok/s, TRL {b:.0f} tok/s")
    print(breakdown("emapg", ours))
    print(breakdown("TRL", theirs))
    print(f"ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
