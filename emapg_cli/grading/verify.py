"""Grade model responses against gold answers with math-verify, safely.

`MathGrader.grade(responses, golds)` extracts each response's final answer (`extract.py`, linear,
answers capped at `MAX_ANSWER_CHARS`), decides the easy cases in the parent (no box or an
over-long one: wrong; same strict key as a gold: right; a power or factorial too big to evaluate
(`screen.py`): wrong, counted as refused) and sends the rest to a `TimeoutPool` whose workers run
`verify(parse(gold), parse(pred))`.

Safety: only math-verify's LaTeX extraction is used (its plain-expression extractor hands text to
sympy's `parse_expr`, which evaluates Python), so nothing in a response is run as code. What runs
in the parent is linear in the response and bounded by the answer cap; every comparison has a hard
wall-clock budget (`timeout`) and each worker a memory cap (`MEMORY_LIMIT`): an answer over either
scores 0 and is counted.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from emapg_cli.grading.extract import extract_answer
from emapg_cli.grading.normalize import as_math, plain_number, strict_key
from emapg_cli.grading.pool import PoolStats, TimeoutPool
from emapg_cli.grading.screen import too_costly

#: Address-space cap of each grading worker (bytes): a comparison that needs more scores wrong.
MEMORY_LIMIT = 1 << 30


def grader_version() -> str:
    """Identifies the grading rules in result files (bump the first part when they change)."""
    from importlib.metadata import version

    return f"emapg-math-1/math-verify-{version('math-verify')}"


@dataclass(frozen=True)
class Gold:
    """The accepted answers of one item (any one is correct) and an optional absolute tolerance."""

    answers: tuple[str, ...]
    tolerance: Optional[float] = None

    @classmethod
    def of(cls, example) -> "Gold":
        """From a canonical `Example` (its `meta.tolerance`, when set, is the absolute tolerance)."""
        tol = example.meta.get("tolerance")
        return cls(tuple(example.answers), float(tol) if tol is not None else None)


@dataclass(frozen=True)
class Grade:
    """One graded response."""

    extracted: Optional[str]  # content of the final box, None when there is none
    correct: bool  # math-verify equivalence with any gold answer
    strict: bool  # exact match of the strict keys (normalised strings)


# --- worker side ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _latex_config():
    from math_verify import LatexExtractionConfig

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled": the pool enforces it
    return [LatexExtractionConfig()]


def _parse(latex: str) -> list:
    from math_verify import parse

    return parse(latex, _latex_config(), parsing_timeout=None)


def warmup() -> None:
    """Import math-verify and sympy and parse once (run by each new worker before it takes tasks)."""
    is_equivalent("1", ("1",))


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    return _parse(as_math(gold))


def _within(gold: list, pred: list, tolerance: float) -> bool:
    """|gold - pred| <= tolerance when both parsed to plain numbers."""
    import sympy

    g, p = (x[0] if x and isinstance(x[0], sympy.Basic) else None for x in (gold, pred))
    if g is None or p is None or not (g.is_number and p.is_number):
        return False
    try:
        return abs(float(g) - float(p)) <= tolerance
    except (TypeError, ValueError, OverflowError):
        return False


def is_equivalent(pred: str, golds: tuple[str, ...], tolerance: Optional[float] = None) -> bool:
    """math-verify equivalence of an extracted answer with any gold (runs inside a pool worker)."""
    from math_verify import verify

    parsed = _parse(as_math(pred))
    if not parsed:
        return False
    for gold in golds:
        g = _parse_gold(gold)
        if verify(g, parsed, timeout_seconds=None) or (tolerance is not None and _within(g, parsed, tolerance)):
            return True
    return False


# --- parent side ---------------------------------------------------------------------------------


def default_workers() -> int:
    """One worker per CPU core the process may use, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


class MathGrader:
    """Grades batches of responses; owns a worker pool (started on first use; `close()` stops it)."""

    votes = True  # extracted answers vote (maj@n), keyed by `vote_key`
    vote_key = staticmethod(strict_key)

    def __init__(self, workers: Optional[int] = None, timeout: float = 5.0, memory_limit: int = MEMORY_LIMIT,
                 think: str = "emapg") -> None:
        self.workers = workers or default_workers()
        self.timeout, self.memory_limit = timeout, memory_limit
        self.think = think  # where the answer is looked for (extract.answer_region)
        self.refused = 0  # answers refused unevaluated (screen.too_costly) so far
        self._pool: Optional[TimeoutPool] = None

    @property
    def timeouts(self) -> int:
        """Comparisons killed at the deadline so far."""
        return self._pool.stats.timeouts if self._pool else 0

    @property
    def pool_stats(self) -> PoolStats:
        """The worker pool's counts so far (timeouts, errors, out_of_memory, crashes)."""
        return self._pool.stats if self._pool else PoolStats()

    def _get_pool(self) -> TimeoutPool:
        if self._pool is None:
            self._pool = TimeoutPool(
                is_equivalent, workers=self.workers, timeout=self.timeout, default=False, warmup=warmup,
                memory_limit=self.memory_limit,
            )
        return self._pool

    @property
    def version(self) -> str:
        """summary.json's grader_version."""
        return grader_version()

    def grade(self, responses: Sequence[str], golds: Sequence[Gold], on_grade=None) -> list[Grade]:
        """Grade `responses[i]` against `golds[i]` (a `Gold`, or an `Example`: `Gold.of` it); `on_grade(i, grade)`
        is called as each finishes."""
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
        golds = [g if isinstance(g, Gold) else Gold.of(g) for g in golds]
        extracted = [extract_answer(r, self.think) for r in responses]
        grades: list[Optional[Grade]] = [None] * len(responses)
        todo: list[int] = []
        gold_keys: dict[tuple[str, ...], set[str]] = {}  # eval repeats each gold n times: normalise it once
        gold_numbers: dict[tuple[str, ...], Optional[set]] = {}  # all golds plain numbers: their values
        for i, (pred, gold) in enumerate(zip(extracted, golds)):
            if gold.answers not in gold_keys:
                gold_keys[gold.answers] = {strict_key(a) for a in gold.answers}
                values = [plain_number(key) for key in gold_keys[gold.answers]]
                gold_numbers[gold.answers] = set(values) if values and None not in values else None
            key = strict_key(pred) if pred is not None else None
            number = plain_number(key) if key is not None and gold.tolerance is None else None
            if key is None:  # no box, or one over MAX_ANSWER_CHARS
                grades[i] = Grade(pred, False, False)
            elif key in gold_keys[gold.answers]:
                grades[i] = Grade(pred, True, True)
            elif number is not None and gold_numbers[gold.answers] is not None:  # plain numbers: settled here
                grades[i] = Grade(pred, number in gold_numbers[gold.answers], False)
            elif too_costly(pred):
                self.refused += 1
                grades[i] = Grade(pred, False, False)
            else:
                todo.append(i)
                continue
            if on_grade:
                on_grade(i, grades[i])

        def done(j: int, correct: bool) -> None:
            i = todo[j]
            grades[i] = Grade(extracted[i], bool(correct), False)
            if on_grade:
                on_grade(i, grades[i])

        if todo:
            tasks = [(extracted[i], golds[i].answers, golds[i].tolerance) for i in todo]
            self._get_pool().map(tasks, on_result=done)
        return grades  # type: ignore[return-value]

    def equivalent(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """math-verify equivalence of each (a, b) pair of extracted answers, in the pool (same timeout;
        a timeout or an error counts as not equivalent). Strict-key equality is decided here; answers
        `screen.too_costly` refuses are never evaluated (their pairs are not equivalent)."""
        out = [strict_key(a) == strict_key(b) for a, b in pairs]
        todo = [i for i, same in enumerate(out) if not same and not too_costly(pairs[i][0]) and not too_costly(pairs[i][1])]
        if todo:
            results = self._get_pool().map([(pairs[i][0], (pairs[i][1],), None) for i in todo])
            for i, r in zip(todo, results):
                out[i] = bool(r)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "MathGrader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
