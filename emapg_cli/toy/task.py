"""The toy task: addition of two two-digit numbers, answered as `\\boxed{N}`.

Everything here is pure and seeded: the same seed gives the same problems, byte for byte.
Problems are `Example` rows in the canonical schema so the trainer reads them like any
prepared dataset and grades them with the same `math` reward as the real presets.

The warm start trains on the true sums and stops part-way through learning them (at a measured
dev accuracy, see `toy/prepare.py`), so RL with the verifier has room to finish the job.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from emapg_cli.data.schema import Example

SOURCE = "toy-addition"


@dataclass(frozen=True)
class Problem:
    """`a + b` with two-digit operands."""

    a: int
    b: int

    @property
    def value(self) -> int:
        return self.a + self.b

    @property
    def carries(self) -> bool:
        """Whether the units column carries into the tens (e.g. 37 + 48: 7 + 8 >= 10)."""
        return self.a % 10 + self.b % 10 >= 10

    @property
    def question(self) -> str:
        return f"What is {self.a} + {self.b}?"


def sample_problem(rng: random.Random) -> Problem:
    """One problem, uniform over two-digit operands (10..99); 45% of them carry."""
    return Problem(rng.randint(10, 99), rng.randint(10, 99))


def problem_stream(seed: int, exclude: frozenset[str] = frozenset()) -> Iterator[Problem]:
    """An endless seeded stream of problems whose question is not in `exclude`."""
    rng = random.Random(seed)
    while True:
        p = sample_problem(rng)
        if p.question not in exclude:
            yield p


def response_text(answer: int) -> str:
    """The short response format taught by the warm start (and graded on its last `\\boxed{}`)."""
    return f"\\boxed{{{answer}}}"


def to_example(p: Problem, split: str, index: int) -> Example:
    """A problem as a canonical row."""
    return Example(
        id=f"toy-{split}-{index:05d}",
        question=p.question,
        answers=[str(p.value)],
        source=SOURCE,
        meta={"a": p.a, "b": p.b, "carry": p.carries},
    )


def make_splits(seed: int, n_train: int, n_test: int) -> tuple[list[Example], list[Example]]:
    """Disjoint train/test splits of distinct questions (test drawn first, then train excludes it)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    test: list[Problem] = []
    train: list[Problem] = []
    for target, n in ((test, n_test), (train, n_train)):
        while len(target) < n:
            p = sample_problem(rng)
            if p.question not in seen:
                seen.add(p.question)
                target.append(p)
    return (
        [to_example(p, "train", i) for i, p in enumerate(train)],
        [to_example(p, "test", i) for i, p in enumerate(test)],
    )
