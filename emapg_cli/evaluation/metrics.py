"""Evaluation metrics over graded samples: avg@n, unbiased pass@k, maj@n, per-subset breakdown.

Pure functions on lists of booleans and strings: no I/O, no models.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, Eq. 1).

    pass@k = 1 - C(n - c, k) / C(n, k), computed as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i)
    (the same identity as the paper's numpy snippet), exact 1.0 when n - c < k. Requires 1 <= k <= n.
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"need 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def ks_for(n: int) -> list[int]:
    """k = 1, 2, 4, ... <= n."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def majority_correct(votes: Sequence[Optional[str]], correct: Sequence[bool]) -> bool:
    """maj@n of one item: is the most frequent answer correct?

    `votes` are normalised answers (None: no answer, never voted for). Ties go to the answer seen
    first. All-None is wrong.
    """
    counts = Counter(v for v in votes if v is not None)
    if not counts:
        return False
    best = max(counts.values())
    winner = next(v for v in votes if v is not None and counts[v] == best)
    return bool(correct[votes.index(winner)])


@dataclass(frozen=True)
class ItemScores:
    """The graded samples of one item."""

    correct: Sequence[bool]  # math-verify equivalence, one per sample
    strict: Sequence[bool]  # exact match of the normalised boxed string, one per sample
    votes: Sequence[Optional[str]]  # normalised extracted answers (maj@n)
    subset: Optional[str] = None


def summarize(items: Sequence[ItemScores]) -> dict:
    """avg@n (= pass@1), pass@k for k = 1, 2, 4, ... <= n, maj@n and strict avg@n, mean over items.

    `n` is the smallest sample count among the items (pass@k needs k <= n for every item).
    """
    if not items:
        return {"num_items": 0}
    n = min(len(it.correct) for it in items)
    out: dict = {"num_items": len(items), "n": n}
    avg = sum(sum(it.correct) / len(it.correct) for it in items) / len(items)
    out["avg@n"] = avg
    for k in ks_for(n):
        out[f"pass@{k}"] = sum(pass_at_k(len(it.correct), sum(it.correct), k) for it in items) / len(items)
    out["maj@n"] = sum(majority_correct(it.votes, it.correct) for it in items) / len(items)
    out["strict"] = sum(sum(it.strict) / len(it.strict) for it in items) / len(items)
    return out


def by_subset(items: Sequence[ItemScores]) -> dict[str, dict]:
    """`summarize` per subset (items without a subset are left out); empty when there are none."""
    groups: dict[str, list[ItemScores]] = defaultdict(list)
    for it in items:
        if it.subset is not None:
            groups[it.subset].append(it)
    return {name: summarize(group) for name, group in sorted(groups.items())}
