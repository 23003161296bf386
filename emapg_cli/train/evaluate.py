"""Accuracy of a model on the evaluation set during training: generate, score, count the solved responses (reward > 0.5,
or the reward's own `solved` rule), overall and per source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from emapg_cli.agents.environments import generate
from emapg_cli.engines.base import SamplingParams
from emapg_cli.train.rollout import score, solved_rule


def eval_max_new_tokens(cfg, step: int) -> int:
    """The response cap of the evaluation after RL step `step` (0: before training): eval.max_new_tokens, and with
    staged lengths (cfg.stages, single-turn runs) at most the length of that step's stage, as each of the official
    stage scripts validates with its own data.max_response_length."""
    cap = cfg.eval.max_new_tokens
    if cfg.stages and not cfg.search.enabled:
        cap = min(cap, cfg.stage_at(max(step, 1)).max_new_tokens)
    return cap


def eval_params(cfg, step: int, seed: int) -> SamplingParams:
    """Sampling of the evaluation after RL step `step`: the `eval` section, stopping on rollout.stop, capped by
    `eval_max_new_tokens` (for search runs the budget of each turn, as rollout.max_new_tokens is in training)."""
    e = cfg.eval
    return SamplingParams(n=e.n, max_new_tokens=eval_max_new_tokens(cfg, step), temperature=e.temperature, top_p=e.top_p,
                          stop=tuple(cfg.rollout.stop), seed=seed)


@dataclass
class EvalScores:
    """`accuracy`: fraction of (item, sample) pairs solved (`solved_rule`) over the whole evaluation set; `by_source`: the
    same per data source (`Example.source`), only when the set mixes several (data.eval as a list, or a merged file)."""

    accuracy: float
    by_source: dict[str, float] = field(default_factory=dict)
    items: list[dict] = field(default_factory=list)  # per item, in the set's order: {id, correct: [bool], scores: [float]}

    def metrics(self, key: str) -> dict[str, float]:
        """{key: accuracy, key/<source>: each source's accuracy}, e.g. eval/accuracy and eval/accuracy/nq."""
        return {key: self.accuracy, **{f"{key}/{name}": acc for name, acc in self.by_source.items()}}


def evaluate(engine, prompts: list[list[int]], examples: list, reward_fn, params: SamplingParams, accelerator,
             truncated: str = "zero") -> EvalScores:
    """Accuracy over all ranks (each rank takes every world-th item), overall and per source.

    `params.max_new_tokens` is the budget of one generation call: the whole response for single-turn tasks,
    one turn for a multi-turn environment (`engine` is then its bound generator, which runs each turn with it).
    `truncated`: `zero` scores a response cut at the token cap 0 (reward.truncated)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    sources = sorted({ex.source for ex in examples})  # the same list on every rank: the examples are the whole set
    slot = {name: i + 1 for i, name in enumerate(sources)}  # row 0 counts everything
    mine = list(range(rank, len(prompts), world))
    counts = torch.zeros((1 + len(sources), 2))  # [1 + S, (correct, total)], float32 as before (exact below 2^24)
    # every rank calls generate, even with no items: a sharded engine gathers weights collectively
    groups = generate(engine, [prompts[i] for i in mine], params, [examples[i] for i in mine])
    items: list[tuple[int, dict]] = []
    if mine:
        completions = [c for g in groups for c in g]
        exs = [examples[i] for i in mine for _ in range(params.n)]
        rewards, _ = score(reward_fn, completions, exs, shaping={"truncated": truncated})
        solved = solved_rule(reward_fn)
        for r, ex in zip(rewards, exs):
            for row in (0, slot[ex.source]):
                counts[row, 0] += float(solved(r))
                counts[row, 1] += 1.0
        for j, i in enumerate(mine):
            scores = [float(x) for x in rewards[j * params.n:(j + 1) * params.n]]
            texts = [c.text[:MAX_ITEM_CHARS] for c in completions[j * params.n:(j + 1) * params.n]]
            items.append((i, {"id": str(examples[i].id), "correct": [solved(x) for x in scores], "scores": scores,
                              "responses": texts}))
    counts = counts.to(accelerator.device)
    if world > 1:
        counts = accelerator.reduce(counts, reduction="sum")
        from accelerate.utils import gather_object

        items = gather_object(items)
    counts = counts.cpu()
    acc = [float(row[0] / row[1]) if row[1] > 0 else float("nan") for row in counts]  # float32 division, as before
    return EvalScores(acc[0], {name: acc[slot[name]] for name in sources} if len(sources) > 1 else {},
                      [row for _, row in sorted(items, key=lambda x: x[0])])


#: A run's per-item outcomes of each policy evaluation: evals/step_<N>.jsonl (what `emapg eval --compare` reads).
EVALS_DIR = "evals"
#: The longest response text kept in a row of evals/step_<N>.jsonl (what was answered: distinct answers, reading).
MAX_ITEM_CHARS = 2000


def write_items(run_dir, step: int, items: list[dict]) -> None:
    """evals/step_<step>.jsonl: one row per evaluation item {id, correct, scores, responses (each cut to MAX_ITEM_CHARS)},
    written under a temporary name."""
    from pathlib import Path

    from emapg_cli.data.schema import json_line
    from emapg_cli.paths import write_text_atomic

    folder = Path(run_dir) / EVALS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / f"step_{step}.jsonl", "".join(json_line(row) for row in items))
