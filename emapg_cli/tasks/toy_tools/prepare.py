"""`emapg prepare --preset toy-tools`: the multiplication task, and a tiny model that rarely uses its calculator.

Writes, under `<home>/toy-tools/`:
  * `train.jsonl`, `test.jsonl` — canonical rows (`emapg_cli.tasks.toy_tools.task`);
  * `model/` — the toy's tiny Llama and byte tokenizer after the warm start below;
  * `manifest.json` — seed, sizes, the warm-start settings and curve, the probability of calling at the first
    response token, greedy test accuracy and calls per episode in the `calc` environment, measured as
    `emapg train --preset toy-tools` measures them at step 0.

The warm start (supervised, on gold episodes built as the environment builds a trajectory: the calculator's
observation is masked out of the loss) separates two things a batch teaches:
  * *the decision* (the first response token: `<` of `<calc>` or `\\` of `\\boxed`): `1 - COPY_SHARE` of each
    batch are full gold episodes, `TOOL_SHARE` of them with the calculator and the rest answered directly (the
    true product, which the model cannot compute), so the model calls with probability ~TOOL_SHARE;
  * *the protocol* (copying the expression into `<calc>`, the result into `\\boxed{}`): the other `COPY_SHARE`
    of each batch are gold calculator episodes whose first token is not trained, so copying is learnt at the
    rate of a batch of calculator episodes without moving the decision.
It stops at the first check (every `check_every` steps) where, on dev episodes, the model predicts every
trained token of the gold calculator episode after the first (teacher-forced argmax = greedy decoding once it
has chosen to call) for `target_accuracy` of them. RL then has to find out that calling pays.
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path
from typing import Any, Callable

from emapg_cli.agents.environments import make_environment
from emapg_cli.config import load_config
from emapg_cli.data.schema import Example, write_jsonl
from emapg_cli.models.prompts import render_prompt
from emapg_cli.models.tiny import build_byte_tokenizer
from emapg_cli.outputs import claim_prepare
from emapg_cli.rewards import get_reward
from emapg_cli.tasks.toy.prepare import greedy_accuracy, save_warm_start, sft_threads, tiny_llama, warm_start_bar
from emapg_cli.tasks.toy.sft import IGNORE, SFTConfig, collate, fit
from emapg_cli.tasks.toy_tools import TASK
from emapg_cli.tasks.toy_tools.task import SOURCE, Problem, gold_turns, make_splits, problem_stream

SIZES = {"test": 500, "dev": 200, "train": 4000}  # questions per split, drawn in this order, disjoint
#: Batches of 32: copying is learnt in about as many steps as with 64 (~200-450), at half the cost per step.
SFT = SFTConfig(max_steps=1500, check_every=10, target_accuracy=0.8, batch_size=32, lr=3e-3, warmup=50)
TOOL_SHARE = 0.25  # of the episodes that train the decision: share that call the calculator
COPY_SHARE = 0.5  # of each batch: calculator episodes with an untrained first token (the protocol only)


def encode_episode(tokenizer, prompt: list[int], pieces: list[tuple[str, bool]], decide: bool = True) -> tuple[list[int], list[int]]:
    """Prompt + each (text, trained) piece + EOS as ids, and labels: IGNORE on the prompt, on untrained pieces
    (observations) and, unless `decide`, on the first response token (the call-or-answer decision).
    Each piece is tokenised on its own, as the environment runner appends turns and observations."""
    ids, labels = list(prompt), [IGNORE] * len(prompt)
    for text, trained in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids, labels = ids + piece, labels + (piece if trained else [IGNORE] * len(piece))
    ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
    if not decide:
        labels[len(prompt)] = IGNORE
    return ids, labels


def protocol_check(model, tokenizer, episodes: list[tuple[list[int], list[int]]], prompt_lens: list[int]) -> tuple[float, float]:
    """(share of `episodes` whose trained tokens after the first are all the argmax of the teacher-forced
    prediction, mean probability of `<` as the first response token). The first is greedy decoding's accuracy
    once the call is chosen: a greedy run that reproduces every token so far predicts the next one as here."""
    import torch

    call = tokenizer("<", add_special_tokens=False)["input_ids"][0]
    ids, mask, labels = collate(episodes, tokenizer.pad_token_id)  # [B, T] each
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # [B, T-1, V]: position t predicts t+1
    target = labels[:, 1:]  # [B, T-1]
    first = torch.tensor(prompt_lens) - 1  # [B]: the position predicting the first response token
    rows = torch.arange(len(episodes))
    checked = target != IGNORE
    checked[rows, first] = False
    exact = ((logits.argmax(-1) == target) | ~checked).all(-1).float().mean().item()
    p_call = logits[rows, first].softmax(-1)[:, call].mean().item()
    return exact, p_call


def env_accuracy(model, tokenizer, examples: list[Example], reward, max_new_tokens: int) -> tuple[float, float]:
    """(greedy accuracy, calculator calls per episode) of `model` on `examples` in the `calc` environment, built by
    the factory training uses, generated by the `hf` engine, graded by `reward`."""
    env, episodes = make_environment(TASK.env, tokenizer), []
    prompts = [render_prompt(tokenizer, e.question) for e in examples]
    accuracy = greedy_accuracy(model, tokenizer, examples, prompts, reward, max_new_tokens, env, episodes)
    return accuracy, env.metrics(episodes)["env/calls"]


def prepare_toy_tools(home: Path, seed: int = 0, progress: bool = False, sft: SFTConfig = SFT) -> dict[str, Any]:
    """Generate the task and warm-start its model under `home/toy-tools`; returns the manifest (also written)."""
    preset = load_config(TASK.name)
    start = time.perf_counter()
    out = Path(home) / TASK.name
    splits = make_splits(seed, SIZES)
    write_jsonl(out / "train.jsonl", (e.model_dump() for e in splits["train"]))
    write_jsonl(out / "test.jsonl", (e.model_dump() for e in splits["test"]))

    tokenizer = build_byte_tokenizer()
    model = tiny_llama(tokenizer, sft, seed)

    prompts: dict[str, list[int]] = {}

    def episode(p: Problem, call: bool, decide: bool = True) -> tuple[list[int], list[int]]:
        if p.question not in prompts:
            prompts[p.question] = render_prompt(tokenizer, p.question)
        return encode_episode(tokenizer, prompts[p.question], gold_turns(p, call), decide)

    dev = [Problem(e.meta["a"], e.meta["b"]) for e in splits["dev"]]
    dev_episodes = [episode(p, call=True) for p in dev]
    dev_prompt_lens = [len(prompts[p.question]) for p in dev]
    stream = problem_stream(seed + 1, frozenset(e.question for e in splits["test"] + splits["dev"]))
    rng = random.Random(f"{seed}-sft")

    def next_batch() -> list[tuple[list[int], list[int]]]:
        batch = []
        for _ in range(sft.batch_size):
            p = next(stream)
            batch.append(episode(p, True, decide=False) if rng.random() < COPY_SHARE else episode(p, rng.random() < TOOL_SHARE))
        return batch

    curve: list[tuple[int, float, float]] = []  # (SFT step, dev protocol accuracy, dev call probability)
    reward = get_reward(preset.rollout.reward)
    with sft_threads(), contextlib.closing(reward), warm_start_bar(progress) as bar:
        task = bar.add_task("warm start (SFT)", total=None, loss=float("nan"), dev="")

        def reached_target() -> bool:
            exact, p_call = protocol_check(model, tokenizer, dev_episodes, dev_prompt_lens)
            curve.append(((len(curve) + 1) * sft.check_every, exact, p_call))
            bar.update(task, dev=f"dev calculator episodes right {exact:.0%} (stops at {sft.target_accuracy:.0%}), "
                                 f"p(call) {p_call:.2f}")
            return exact >= sft.target_accuracy

        sft_start = time.perf_counter()
        losses = fit(model, sft, seed, next_batch, tokenizer.pad_token_id, reached_target,
                     progress=lambda step, loss: bar.update(task, completed=step, loss=loss))
        sft_seconds = time.perf_counter() - sft_start
        bar.update(task, total=len(losses), completed=len(losses), description="greedy test accuracy ...")
        accuracy, calls = env_accuracy(model, tokenizer, splits["test"], reward, preset.eval.max_new_tokens)
        bar.update(task, description=f"warm start {sft_seconds:.0f}s, greedy test accuracy {accuracy:.1%}, "
                                     f"{calls:.2f} calls per episode")

    return save_warm_start(out, model, tokenizer, {
        "name": TASK.name,
        "source": SOURCE,
        "seed": seed,
        "rows": {split: len(rows) for split, rows in splits.items() if split != "dev"},
        "tool_share": TOOL_SHARE,
        "copy_share": COPY_SHARE,
    }, sft, losses, {
        "sft_dev_checks": [{"step": s, "protocol_accuracy": a, "call_probability": p} for s, a, p in curve],
        "sft_wall_s": round(sft_seconds, 1),
        "sft_call_probability": curve[-1][2] if curve else None,
        "sft_test_accuracy": accuracy,
        "sft_test_calls": calls,
        "wall_s": round(time.perf_counter() - start, 1),
    })


def run(home: Path, seed: int, say: Callable[[str], None]) -> tuple[str, dict[str, Any], list[tuple[str, str]]]:
    """The declared prepare step, `emapg prepare --preset toy-tools` (holding the folder): (table title, manifest, rows)."""
    with claim_prepare(Path(home) / TASK.name, f"--preset {TASK.name}"):
        m = prepare_toy_tools(home, seed, progress=True)
    return "prepared the toy tools task", m, [
        ("model", f"{m['model']['arch']}, {m['model']['parameters']:,} parameters ({TASK.name}/model)"),
        ("warm start", f"{m['sft_steps']} steps in {m['sft_wall_s']:.0f} s, greedy test accuracy "
                       f"{m['sft_test_accuracy']:.1%} with {m['sft_test_calls']:.2f} calculator calls per episode "
                       f"(sampled: calls with probability {m['sft_call_probability']:.2f})")]
