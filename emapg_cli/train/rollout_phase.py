"""The rollout phase of a step: this rank's prompts, generation, grading in the
background, and the padded batch. Advantages are filled later (`Trainer._advantages`), once the grades are in."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from emapg_cli.agents.environments import generate
from emapg_cli.engines.base import SamplingParams, derive_seed
from emapg_cli.grpo import grpo_advantages
from emapg_cli.train.rollout import padded_batch, schedule, score

#: The seed stream of rollouts (the trainer's others: 2 update, 3 eval).
ROLLOUT_STREAM = 1


@dataclass
class Rollouts:
    """What the rollout phase samples from and grades with; `Rollouts(...)(step)` runs it for one RL step."""

    cfg: Any  # the run's Config
    acc: Any  # accelerate.Accelerator
    generator: Any  # the engine, or the environment's episodes on it (`agents.environments`)
    train_prompts: list[list[int]]  # tokenised prompts of the training examples
    train_ex: list  # the training examples
    reward_fn: Callable
    grader: ThreadPoolExecutor  # grades beside the log-prob passes
    pad_id: int
    topk: int  # top-k ids the engine records per token (`StepSettings.engine_topk` when the engine records top-k; 0: none)
    timed: Callable[[str], Any]  # name -> context manager adding the block's wall time to the step's phases
    # versioned engines: step -> the oldest weights version its samples may come from (train/async_rollouts.py)
    min_version: Optional[Callable[[int], int]] = None

    def generate(self, items: list[int], step: int, stage) -> tuple[list, list, list]:
        """Generate this rank's groups for dataset indices `items`. Returns (prompt ids, completions, their examples)."""
        cfg, acc, r = self.cfg, self.acc, self.cfg.rollout
        prompts = [self.train_prompts[i] for i in items]
        seed = derive_seed(cfg.train.seed, ROLLOUT_STREAM, step, acc.process_index)
        params = SamplingParams(n=r.n, max_new_tokens=stage.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                stop=tuple(r.stop), seed=seed, topk=self.topk,
                                min_version=self.min_version(step) if self.min_version is not None else None)
        with self.timed("generation"):
            # engines take their memory back themselves; a user environment builds its episodes from the examples
            groups = generate(self.generator, prompts, params, [self.train_ex[i] for i in items])
        completions = [c for g in groups for c in g]
        examples = [self.train_ex[i] for i in items for _ in range(r.n)]
        return prompts, completions, examples

    def scheduled(self, step: int) -> list[int]:
        """This rank's dataset indices of RL step `step` (a pure function of the step: `rollout.schedule`)."""
        per_rank = self.cfg.rollout.prompts_per_step // self.acc.num_processes
        idx = schedule(len(self.train_ex), self.cfg.rollout.prompts_per_step, step, self.cfg.train.seed)
        return idx[self.acc.process_index * per_rank:(self.acc.process_index + 1) * per_rank]

    def __call__(self, step: int, first: Optional[tuple] = None):
        """Generate this rank's groups, start grading them in the background and build the padded batch
        (advantages still zero). Returns (batch, pending grades, metrics inputs).
        `first`: the `generate` of `scheduled(step)`, already run (asynchronous rollouts)."""
        cfg, acc = self.cfg, self.acc
        r, t = cfg.rollout, cfg.train
        mine = self.scheduled(step)
        stage = cfg.stage_at(step)  # staged response lengths (cfg.stages), else rollout.max_new_tokens
        roll: dict[str, Any] = {}
        prompts, completions, examples = first if first is not None else self.generate(mine, step, stage)
        # only the advantages need the rewards: grade while the batch is built and the log-prob passes run
        if t.objective == "distill":  # no verifier: every reward 0, so every GRPO advantage is 0 (docs/distill.md)
            grading: Future = Future()
            grading.set_result(([0.0] * len(completions), 0))
        else:
            grading = self.grader.submit(score, self.reward_fn, completions, examples,
                                         dict(truncated=cfg.reward.truncated, credit=cfg.reward.credit))
        with self.timed("batch"):  # overlong filtering (stage.mask_truncated): truncated rows leave the update
            batch, truncated = padded_batch(prompts, completions, r.n, stage.mask_truncated, self.pad_id, acc.device)
        roll.update(response_lens=[len(c.token_ids) for c in completions], truncated=truncated, max_new_tokens=stage.max_new_tokens)
        return batch, (grading, completions, examples), roll


def group_advantages(acc, rewards: list[float], n: int, norm: str, eps: float):
    """GRPO advantages (`grpo.grpo_advantages`) over all ranks' rewards (this rank's: G_rank groups of n, in order).
    Returns (this rank's advantages [G_rank * n] on its device, all ranks' rewards [G, n] on the CPU)."""
    per_rank = len(rewards) // n
    local = torch.tensor(rewards, dtype=torch.float32, device=acc.device).view(per_rank, n)  # [G_rank, n]
    all_rewards = acc.gather(local) if acc.num_processes > 1 else local  # [G, n]
    adv = grpo_advantages(all_rewards, norm, eps)  # [G, n]
    adv_local = adv[acc.process_index * per_rank:(acc.process_index + 1) * per_rank].reshape(-1)  # [G_rank * n]
    return adv_local.to(acc.device).float(), all_rewards.cpu()
