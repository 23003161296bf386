"""Dynamic sampling (train.filter_groups): DAPO's filter of uninformative groups.

DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", Sec. 3.2 "Dynamic
Sampling", Eq. 11) over-samples prompts and keeps only groups with 0 < |{correct}| < n, whose GRPO advantages are
not all zero (`grpo.informative_groups`, here: rewards not all equal), until the batch is full. Deviation: the
number of extra rounds is capped (train.filter_max_rounds); when the cap is hit, uninformative groups fill the rest
of the batch (advantage 0: only the KL term acts on them), so every step has prompts_per_step groups.
"""

from __future__ import annotations

import random
from typing import Callable

import torch

from emapg_cli.engines.base import derive_seed
from emapg_cli.grpo import informative_groups
from emapg_cli.train.rollout import score

#: The seed stream of the extra rounds' prompt draws (the trainer's other streams: 1 rollout, 2 update, 3 eval).
FILTER_STREAM = 4


def global_max(acc, value: int) -> int:
    """The largest `value` over all ranks (every rank calls this)."""
    if acc.num_processes == 1:
        return value
    return int(acc.reduce(torch.tensor(float(value), device=acc.device), reduction="max"))


def grade_groups(generate: Callable, reward_fn, shaping: dict, n: int, items: list[int], round_: int):
    """Generate and grade the groups of dataset indices `items`; returns ([(prompt ids, its n completions, its n
    examples, its rewards [n])], reward errors)."""
    prompts, completions, examples = generate(items, round_)
    rewards, errors = score(reward_fn, completions, examples, shaping=shaping)
    rewards = torch.tensor(rewards, dtype=torch.float32).view(len(items), n)  # [G, n]
    return [(prompts[g], completions[g * n:(g + 1) * n], examples[g * n:(g + 1) * n], rewards[g])
            for g in range(len(items))], errors


def filtered_groups(acc, mine: list[int], graded: Callable, n_examples: int, max_rounds: int, seed: int, step: int):
    """This rank's share of prompts_per_step groups after dynamic sampling.

    `mine`: this rank's scheduled dataset indices; `graded(items, round_)`: `grade_groups` of the indices (may be
    empty: every rank generates in every round, which a sharded engine needs). The first round grades `mine`; groups
    whose rewards are all equal are dropped and fresh prompts (a seeded draw per extra round) are sampled until this
    rank has len(mine) informative groups, or `max_rounds` extra rounds were spent (every rank runs the same number:
    the loop ends on the largest shortfall over all ranks); then uninformative groups fill the rest.
    Returns (prompt ids, completions, examples, rewards [G_rank, n], reward errors, `rollout/filter_*` metrics).
    """
    per_rank = len(mine)
    groups, errors = graded(mine, 0)
    flags = informative_groups(torch.stack([g[3] for g in groups])).tolist()  # [G_rank]
    keep = [g for g, ok in zip(groups, flags) if ok]
    spare = [g for g, ok in zip(groups, flags) if not ok]
    rounds = 0
    while global_max(acc, per_rank - len(keep)) > 0 and rounds < max_rounds:
        rounds += 1
        need = per_rank - len(keep)
        draw = random.Random(derive_seed(seed, FILTER_STREAM, step, rounds, acc.process_index))
        items = draw.sample(range(n_examples), min(per_rank, n_examples)) if need > 0 else []
        more, e2 = graded(items, rounds)
        errors += e2
        if more:
            for g, ok in zip(more, informative_groups(torch.stack([g[3] for g in more])).tolist()):
                (keep if ok else spare).append(g)
    filled = max(0, per_rank - len(keep))
    groups = (keep + spare[:filled])[:per_rank]
    dropped = len(spare) - filled
    counts = torch.tensor([float(rounds), float(dropped), float(filled)], device=acc.device)
    if acc.num_processes > 1:
        counts = acc.reduce(counts, reduction="sum")
        counts[0] = rounds  # every rank runs the same number of rounds
    filtering = {"rollout/filter_rounds": float(counts[0]), "rollout/filtered_groups": float(counts[1]),
                 "rollout/filter_filled": float(counts[2])}
    return ([g[0] for g in groups], [c for g in groups for c in g[1]], [e for g in groups for e in g[2]],
            torch.stack([g[3] for g in groups]), errors, filtering)
