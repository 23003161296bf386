"""`emapg prepare --preset toy-distill`: the toy addition task with a teacher and a weaker student (docs/distill.md).

One supervised run of the toy's warm start (`toy.sft.fit`, the toy's task, tokenizer and model) yields both models:
the student is the model at the point where the toy's own warm start stops (smoothed dev accuracy 30%), the teacher
is the same run continued until the smoothed dev accuracy reaches `TEACHER_TARGET`. Same tokenizer, same
architecture, same vocabulary. Writes, under `<home>/toy-distill/`:
  * `train.jsonl`, `test.jsonl` — the toy's canonical rows (`tasks.toy.task.make_splits`, the same seed gives the same rows);
  * `student/`, `teacher/` — the two models with their byte tokenizer, `save_pretrained` format;
  * `manifest.json` — steps, dev curves, wall time and the greedy test accuracy of both (graded by the preset's
    reward with its evaluation budget, as `emapg train --preset toy-distill` measures `teacher_accuracy`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from pathlib import Path
from typing import Any, Callable

from emapg_cli.config import load_config
from emapg_cli.data.schema import write_jsonl
from emapg_cli.models.tiny import build_byte_tokenizer
from emapg_cli.outputs import claim_prepare
from emapg_cli.paths import write_text_atomic
from emapg_cli.rewards import get_reward
from emapg_cli.tasks import toy
from emapg_cli.tasks.toy.prepare import (N_DEV, N_TEST, N_TRAIN, SFT_THREADS, greedy_accuracy, render_all, sft_threads,
                                        tiny_llama)
from emapg_cli.tasks.toy.sft import PairEncoder, SFTConfig, fit, smoothed_accuracy
from emapg_cli.tasks.toy.task import SOURCE, make_splits, problem_stream, response_text
from emapg_cli.tasks.toy_distill import TASK

TEACHER_TARGET = 0.85  # the teacher: the run continued until the smoothed dev accuracy reaches this
TEACHER_CHECK_EVERY = 5  # dev checks between the student's snapshot and the teacher (the climb is steep: 1-3 points a step)


def two_stops(cfg: SFTConfig, dev_accuracy: Callable[[], float], on_student: Callable[[int], None],
              say: Callable[[str], None]) -> Callable[[], bool]:
    """`fit`'s `should_stop` (asked after every step): the toy warm start's dev-check schedule (`toy.sft.warm_start`:
    every `check_every` steps on the plateau, every step from `fine_from` on) until the smoothed accuracy reaches
    `cfg.target_accuracy`, where `on_student(step)` snapshots the student; then every TEACHER_CHECK_EVERY steps
    until it reaches TEACHER_TARGET (stop)."""
    checks: list[float] = []
    state = {"step": 0, "student": False}

    def should_stop() -> bool:
        state["step"] += 1
        step, student = state["step"], state["student"]
        fine = any(a >= cfg.fine_from for a in checks)
        every = TEACHER_CHECK_EVERY if student else cfg.fine_every if fine else cfg.check_every
        if step % every:
            return False
        checks.append(dev_accuracy())
        smooth = smoothed_accuracy(checks, cfg.smooth)
        if step % 20 == 0 or (fine and not student):
            say(f"  step {step}: dev accuracy {checks[-1]:.1%} (mean of last {cfg.smooth}: {smooth:.1%})")
        if not student and smooth >= cfg.target_accuracy:
            state["student"] = True
            on_student(step)
            checks.clear()  # the teacher's stop looks at its own checks only
            return False
        return student and smooth >= TEACHER_TARGET

    return should_stop


def prepare_toy_distill(home: Path, seed: int = 0, say: Callable[[str], None] = print,
                        sft: SFTConfig = SFTConfig()) -> dict[str, Any]:
    """Write the toy-distill folder under `home` (module docstring); returns the manifest (also written)."""
    from dataclasses import replace

    preset, start, out = load_config(toy.TASK.name), time.perf_counter(), Path(home) / TASK.name
    train, test = make_splits(seed, N_TRAIN, N_TEST)
    write_jsonl(out / "train.jsonl", (e.model_dump() for e in train))
    write_jsonl(out / "test.jsonl", (e.model_dump() for e in test))
    tokenizer = build_byte_tokenizer()
    model = tiny_llama(tokenizer, sft, seed)
    dev, reward, budget = train[:N_DEV], get_reward(preset.rollout.reward), preset.eval.max_new_tokens
    dev_prompts, encode = render_all(tokenizer, dev), PairEncoder(tokenizer)
    stream = problem_stream(seed + 1, frozenset(e.question for e in test + dev))
    snap: dict[str, Any] = {}

    def next_batch():
        return [encode(p.question, response_text(p.value)) for p in (next(stream) for _ in range(sft.batch_size))]

    def on_student(step: int) -> None:
        snap.update(model=copy.deepcopy(model).eval(), step=step)
        say(f"student: step {step} (the toy warm start's stop); training on to the teacher ({TEACHER_TARGET:.0%} dev)")

    with sft_threads(), contextlib.closing(reward):
        say(f"supervised run: student at {sft.target_accuracy:.0%} smoothed dev accuracy, teacher at {TEACHER_TARGET:.0%}")
        stop = two_stops(sft, lambda: greedy_accuracy(model, tokenizer, dev, dev_prompts, reward, budget), on_student, say)
        losses = fit(model, replace(sft, check_every=1, max_steps=2 * sft.max_steps), seed, next_batch,
                     tokenizer.pad_token_id, stop)
        if "model" not in snap:
            from emapg_cli.errors import UserError

            raise UserError(f"{TASK.name}: the supervised run never reached {sft.target_accuracy:.0%} dev accuracy in "
                            f"{len(losses)} steps (seed {seed}); try another --seed")
        test_prompts = render_all(tokenizer, test)
        acc = {name: greedy_accuracy(m, tokenizer, test, test_prompts, reward, budget)
               for name, m in (("student", snap["model"]), ("teacher", model))}
        say(f"greedy test accuracy: student {acc['student']:.1%}, teacher {acc['teacher']:.1%}")
    for name, m in (("student", snap["model"]), ("teacher", model)):
        m.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    manifest = {
        "name": TASK.name, "source": SOURCE, "seed": seed, "rows": {"train": len(train), "test": len(test)},
        "model": {"arch": model.config.model_type, "parameters": sum(p.numel() for p in model.parameters())},
        "sft": sft.as_dict(), "student_steps": snap["step"], "teacher_steps": len(losses), "teacher_target": TEACHER_TARGET,
        "student_test_accuracy": acc["student"], "teacher_test_accuracy": acc["teacher"],
        "wall_s": round(time.perf_counter() - start, 1), "torch_threads": SFT_THREADS,
    }
    write_text_atomic(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    return manifest


def run(home: Path, seed: int, say: Callable[[str], None]) -> tuple[str, dict[str, Any], list[tuple[str, str]]]:
    """The declared prepare step, `emapg prepare --preset toy-distill` (holding the folder): (table title, manifest, rows)."""
    with claim_prepare(Path(home) / TASK.name, f"--preset {TASK.name}"):
        m = prepare_toy_distill(home, seed, say=say)
    return "prepared the toy distillation task", m, [
        ("models", f"{m['model']['arch']}, {m['model']['parameters']:,} parameters each ({TASK.name}/student, {TASK.name}/teacher)"),
        ("greedy test accuracy", f"student {m['student_test_accuracy']:.1%} (step {m['student_steps']}), "
                                 f"teacher {m['teacher_test_accuracy']:.1%} (step {m['teacher_steps']}); {m['wall_s']:.0f} s")]
