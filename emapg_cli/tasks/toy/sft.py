"""The toy warm start: a short supervised fine-tune of a fresh tiny Llama, in plain torch on CPU.

The model learns `\\boxed{a+b}` from an endless seeded stream of problems (held-out questions
excluded), with loss on the response tokens only. A tiny transformer learns two-digit addition
abruptly: the loss plateaus, then accuracy climbs from ~5% to ~90% within a few hundred steps.
The warm start stops in the middle of that climb, once the dev accuracy (the caller's
`dev_accuracy`), averaged over the last `smooth` checks, reaches `target_accuracy`, leaving the
RL stage a model that formats perfectly and adds correctly only part of the time. Checks are
coarse (every `check_every` steps) on the plateau and fine (every `fine_every` steps) from the first
check at or above `fine_from` on: during the climb accuracy rises by 1-3 points per step, so a
coarse check would overshoot the target by up to ~20 points, by an amount that depends on where
the climb happens to fall between two checks, which differs between CPUs (floating-point reduction
order) and seeds. Stopping on a smoothed, finely sampled accuracy rather than a step count keeps the
starting point within a few points across seeds and machines; everything is still deterministic for
a given seed, machine and torch thread count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

from emapg_cli.models.prompts import render_prompt
from emapg_cli.tasks.toy.task import problem_stream, response_text

IGNORE = -100  # label value the cross-entropy skips (prompt and padding positions)


@dataclass(frozen=True)
class SFTConfig:
    """Size of the toy model and the warm-start schedule."""

    hidden: int = 64
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    max_steps: int = 2500
    check_every: int = 20  # steps between dev checks on the plateau
    fine_every: int = 1  # steps between dev checks once the dev accuracy reached `fine_from`
    fine_from: float = 0.10
    smooth: int = 3  # stop on the mean of the last `smooth` dev accuracies ...
    target_accuracy: float = 0.30  # ... once it reaches this
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class PairEncoder:
    """Token ids of (question, response) pairs, prompts rendered exactly as the trainer renders them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._prompts: dict[str, list[int]] = {}  # the toy has only 8100 distinct questions

    def prompt(self, question: str) -> list[int]:
        if question not in self._prompts:
            self._prompts[question] = render_prompt(self.tokenizer, question)
        return self._prompts[question]

    def __call__(self, question: str, response: str) -> tuple[list[int], list[int]]:
        """Prompt + response + EOS ids, and labels that mask the prompt with IGNORE."""
        prompt = self.prompt(question)
        answer = self.tokenizer(response, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return prompt + answer, [IGNORE] * len(prompt) + answer


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-pad a batch: input ids, attention mask and labels, each [B, T]."""
    import torch

    width = max(len(ids) for ids, _ in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(pairs), width), dtype=torch.long)  # [B, T]
    labels = torch.full((len(pairs), width), IGNORE, dtype=torch.long)  # [B, T]
    for row, (x, y) in enumerate(pairs):
        ids[row, : len(x)] = torch.tensor(x)
        mask[row, : len(x)] = 1
        labels[row, : len(y)] = torch.tensor(y)
    return ids, mask, labels


def smoothed_accuracy(accuracies: list[float], smooth: int) -> float:
    """The stopping statistic: the mean of the last `smooth` dev accuracies."""
    recent = accuracies[-smooth:]
    return sum(recent) / len(recent)


def warm_start(
    model,
    tokenizer,
    cfg: SFTConfig,
    seed: int,
    exclude: frozenset[str],
    dev_accuracy: Callable[[], float],
    progress: Optional[Callable[[int, float], None]] = None,
) -> tuple[list[float], list[tuple[int, float]]]:
    """Fine-tune `model` in place on the addition stream until the smoothed `dev_accuracy()` reaches
    `cfg.target_accuracy` (see the module docstring for the check schedule) or `cfg.max_steps`.

    Returns the loss of every step and the dev checks as (step, accuracy). `exclude` holds
    questions never trained on (test and dev); `progress(step, loss)` is called after each
    optimizer step. The model is left in eval mode.
    """
    encode = PairEncoder(tokenizer)
    stream = problem_stream(seed + 1, exclude)
    checks: list[tuple[int, float]] = []
    steps = iter(range(1, cfg.max_steps + 1))  # `fit` asks after every step (check_every=1 below)

    def next_batch() -> list[tuple[list[int], list[int]]]:
        problems = [next(stream) for _ in range(cfg.batch_size)]
        return [encode(p.question, response_text(p.value)) for p in problems]

    def should_stop() -> bool:
        step = next(steps)
        fine = any(acc >= cfg.fine_from for _, acc in checks)  # latched: noise on the climb must not fall back to coarse
        if step % (cfg.fine_every if fine else cfg.check_every):
            return False
        checks.append((step, dev_accuracy()))
        return smoothed_accuracy([acc for _, acc in checks], cfg.smooth) >= cfg.target_accuracy

    losses = fit(model, replace(cfg, check_every=1), seed, next_batch, tokenizer.pad_token_id, should_stop, progress)
    return losses, checks


def fit(
    model,
    cfg: SFTConfig,
    seed: int,
    next_batch: Callable[[], list[tuple[list[int], list[int]]]],
    pad_id: int,
    should_stop: Callable[[], bool],
    progress: Optional[Callable[[int, float], None]] = None,
) -> list[float]:
    """The warm-start loop: AdamW on `next_batch()` (ids, labels with IGNORE off the trained tokens) until
    `should_stop()` (asked every `cfg.check_every` steps) or `cfg.max_steps`.

    Returns the loss of every step; `progress(step, loss)` is called after each optimizer step.
    The model is left in eval mode.
    """
    import torch

    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses: list[float] = []
    for step in range(cfg.max_steps):
        model.train()
        ids, mask, labels = collate(next_batch(), pad_id)
        for group in opt.param_groups:  # linear warm-up over cfg.warmup steps, then constant (the run length is unknown)
            group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1, losses[-1])
        if (step + 1) % cfg.check_every == 0:
            model.eval()
            if should_stop():
                break
    model.eval()
    return losses
