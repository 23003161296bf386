"""Evaluation metrics over graded samples: avg@n, unbiased pass@k, maj@n (by equivalence class and by string), per-subset breakdown.

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
    return [1 << i for i in range(max(n, 0).bit_length())]


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


#: maj@n clusters at most this many distinct answers (the most frequent) by equivalence; the rest
#: stay clusters of their own string. Bounds the comparisons per item at 16 * 15 / 2 = 120.
MAX_VOTE_ANSWERS = 16


def candidates(votes: Sequence[Optional[str]]) -> list[str]:
    """The distinct votes compared for equivalence: the MAX_VOTE_ANSWERS most frequent (ties: first seen)."""
    counts = Counter(v for v in votes if v is not None)
    order = {v: i for i, v in reversed(list(enumerate(votes)))}  # first position of each vote
    return sorted(counts, key=lambda v: (-counts[v], order[v]))[:MAX_VOTE_ANSWERS]


def candidate_pairs(cands: Sequence[str]) -> list[tuple[int, int]]:
    """Every pair (i, j), i < j, of candidates to compare."""
    return [(i, j) for i in range(len(cands)) for j in range(i + 1, len(cands))]


def equivalence_votes(votes: Sequence[Optional[str]], cands: Sequence[str], same: Sequence[bool]) -> list[Optional[str]]:
    """Each vote replaced by its equivalence class's name (the class's most frequent candidate).

    `same[p]` says whether the pair `candidate_pairs(cands)[p]` is mathematically equivalent; classes
    are the connected components (union-find). Votes outside the candidates keep their own string.
    """
    parent = list(range(len(cands)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for (i, j), eq in zip(candidate_pairs(cands), same, strict=True):
        if eq:
            a, b = root(i), root(j)
            parent[max(a, b)] = min(a, b)  # the more frequent candidate names the class
    name = {c: cands[root(i)] for i, c in enumerate(cands)}
    return [None if v is None else name.get(v, v) for v in votes]


@dataclass(frozen=True)
class ItemScores:
    """The graded samples of one item."""

    correct: Sequence[bool]  # math-verify equivalence, one per sample
    strict: Sequence[bool]  # exact match of the normalised boxed string, one per sample
    votes: Sequence[Optional[str]]  # normalised extracted answers (maj@n_strict); None: no vote
    subset: Optional[str] = None
    classes: Optional[Sequence[Optional[str]]] = None  # votes mapped to equivalence classes (maj@n); None: as votes


def summarize(items: Sequence[ItemScores], votes: bool = True) -> dict:
    """avg@n (= pass@1), pass@k for k = 1, 2, 4, ... <= n, maj@n, maj@n_strict and strict avg@n, mean over items.

    maj@n votes on equivalence classes of the answers (`0.5`, `\\frac12` and `1/2` are one vote each
    for the same class); maj@n_strict votes on the normalised strings. `votes=False` (a reward graded by
    its score alone, which gives no answer to vote on): maj@n and maj@n_strict are None.

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
    if votes:
        out["maj@n"] = sum(majority_correct(it.classes if it.classes is not None else it.votes, it.correct) for it in items) / len(items)
        out["maj@n_strict"] = sum(majority_correct(it.votes, it.correct) for it in items) / len(items)
    else:
        out["maj@n"] = out["maj@n_strict"] = None
    out["strict"] = sum(sum(it.strict) / len(it.strict) for it in items) / len(items)
    return out


def by_subset(items: Sequence[ItemScores], votes: bool = True) -> dict[str, dict]:
    """`summarize` per subset (items without a subset are left out); empty when there are none."""
    groups: dict[str, list[ItemScores]] = defaultdict(list)
    for it in items:
        if it.subset is not None:
            groups[it.subset].append(it)
    return {name: summarize(group, votes) for name, group in sorted(groups.items())}
