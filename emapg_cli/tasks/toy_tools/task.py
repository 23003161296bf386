"""The toy-tools task: three-digit by two-digit multiplication (five-digit products), which a calculator makes easy.

"What is 347 * 58?", answered as `\\boxed{20126}`. A 3-layer, 64-wide model does not learn such products
in its head within minutes of CPU, but it learns quickly to copy: `<calc>347 * 58</calc>` (the expression,
copied from the question) gets the observation `<result>20126</result>` from the calculator environment
(`emapg_cli.agents.calculator`), and `\\boxed{20126}` copies the result. The warm start shows the calculator
in only a minority of its episodes (`gold_response`), so the model starts by answering in its head, and
RL has to discover that calling pays.

Everything here is pure and seeded: the same seed gives the same problems, byte for byte.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from emapg_cli.data.schema import Example
from emapg_cli.tasks.toy import task

SOURCE = "toy-tools"


@dataclass(frozen=True)
class Problem:
    """`a * b` with a three-digit `a` and a two-digit `b`."""

    a: int
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a} * {self.b}"

    @property
    def value(self) -> int:
        return self.a * self.b

    @property
    def question(self) -> str:
        return f"What is {self.expression}?"


def sample_problem(rng: random.Random) -> Problem:
    """One problem, uniform over the 100..999 times 10..99 whose product has five digits (66,471 questions).

    Four-digit products (100 * 10 .. 999 * 99 spans 1000..98901; 18% of the pairs) are left out: with answers
    of two lengths, one of three warm-start seeds learnt to copy five-digit results only and never answered a
    four-digit one, which RL cannot repair (eight wrong samples give no advantage)."""
    while True:
        p = Problem(rng.randint(100, 999), rng.randint(10, 99))
        if p.value >= 10_000:
            return p


def problem_stream(seed: int, exclude: frozenset[str] = frozenset()) -> Iterator[Problem]:
    """An endless seeded stream of problems whose question is not in `exclude`."""
    return task.problem_stream(seed, exclude, sample_problem)


def gold_turns(p: Problem, call: bool) -> list[tuple[str, bool]]:
    """A gold episode's text pieces as (text, trained?): with `call`, the calculator call, its observation
    (not trained: the environment writes it) and the copied answer; without, the answer alone."""
    answer = task.response_text(p.value)
    if not call:
        return [(answer, True)]
    return [(f"<calc>{p.expression}</calc>", True), (f"<result>{p.value}</result>", False), (answer, True)]


def to_example(p: Problem, split: str, index: int) -> Example:
    """A problem as a canonical row."""
    return Example(id=f"toy-tools-{split}-{index:05d}", question=p.question, answers=[str(p.value)], source=SOURCE,
                   meta={"a": p.a, "b": p.b})


def make_splits(seed: int, sizes: dict[str, int]) -> dict[str, list[Example]]:
    """Disjoint splits of distinct questions, drawn in the order of `sizes` (e.g. test, dev, train)."""
    groups = task.draw_distinct(random.Random(seed), sample_problem, list(sizes.values()))
    return {split: [to_example(p, split, i) for i, p in enumerate(g)] for split, g in zip(sizes, groups)}
