"""The toy task: addition of two two-digit numbers, answered as `\\boxed{N}`.

Everything here is pure and seeded: the same seed gives the same problems, byte for byte.
Problems are `Example` rows in the canonical schema so the trainer reads them like any
prepared dataset and grades them with the same `math` reward as the real presets.

The warm start trains on the true sums and stops part-way through learning them (at a measured
dev accuracy, see `prepare.py`), so RL with the verifier has room to finish the job.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, TypeVar

from emapg_cli.data.schema import Example

SOURCE = "toy-addition"
P = TypeVar("P")  # a problem type with a `question` (this module's `Problem`, or another toy's)


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


def problem_stream(seed: int, exclude: frozenset[str] = frozenset(),
                   sample: Callable[[random.Random], P] = sample_problem) -> Iterator[P]:
    """An endless seeded stream of problems (drawn by `sample`) whose question is not in `exclude`."""
    rng = random.Random(seed)
    while True:
        p = sample(rng)
        if p.question not in exclude:
            yield p


def draw_distinct(rng: random.Random, sample: Callable[[random.Random], P], sizes: Sequence[int]) -> list[list[P]]:
    """Groups of `sizes[i]` problems drawn by `sample`, in order, no question twice across all groups."""
    seen: set[str] = set()
    groups: list[list[P]] = []
    for n in sizes:
        group: list[P] = []
        while len(group) < n:
            p = sample(rng)
            if p.question not in seen:
                seen.add(p.question)
                group.append(p)
        groups.append(group)
    return groups


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
    test, train = draw_distinct(random.Random(seed), sample_problem, (n_test, n_train))
    return (
        [to_example(p, "train", i) for i, p in enumerate(train)],
        [to_example(p, "test", i) for i, p in enumerate(test)],
    )
