"""Does any KL anchor keep breadth that no KL loses? An exact permutation test over the finished runs of this folder.

Reads anchors.json (written by `emapg ablate --study anchors --preset smol --aggregate-only --out THIS_FOLDER`) and,
for each breadth measure, compares the 12 anchored runs (fixed, ema, fixed-10b, ema-10b; 3 seeds each) with the 3 runs
without a KL term: the difference of means, and its one-sided exact p over all C(15, 3) = 455 ways to split the 15
values into groups of 12 and 3 (H1: anchored > none), then Holm's correction over the five measures. It pools the four
anchored arms (they do not differ from each other on these measures) and treats runs as exchangeable, ignoring the
seed pairing: an exploratory test, chosen after the per-arm tables were read. Standard library only:

    python docs/evidence/anchors-smol/breadth_test.py [FOLDER]
"""
import json
import sys
from itertools import combinations
from pathlib import Path

MEASURES = {  # key in a run's record (top level, else under "measured") -> what it is
    "entropy": "sampling entropy, mean of the last 20% of steps",
    "distinct": "distinct sampled answers per held-out item (8 samples, T 0.7)",
    "pass_n": "pass@8 on held-out items",
    "untrained_distinct_items": "distinct greedy answers across items, untrained tasks",
    "distinct_items": "distinct greedy answers across items, trained tasks",
}


def value(run: dict, key: str) -> float:
    return run[key] if key in run else run["measured"][key]


def one_sided_p(a: list[float], b: list[float]) -> float:
    """P(mean(A) - mean(B) >= observed) over every split of a + b into groups of len(a) and len(b)."""
    pooled, n = a + b, len(a)
    observed = sum(a) / n - sum(b) / len(b)
    hits = total = 0
    for idx in combinations(range(len(pooled)), n):
        chosen = set(idx)
        A = [pooled[i] for i in idx]
        B = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        total += 1
        hits += sum(A) / n - sum(B) / len(B) >= observed - 1e-12
    return hits / total


def main(folder: Path) -> None:
    runs = [r for r in json.loads((folder / "anchors.json").read_text())["runs"] if r.get("status") == "done"]
    rows = []
    for key, what in MEASURES.items():
        anchored = [value(r, key) for r in runs if r["rule"] != "none"]
        none = [value(r, key) for r in runs if r["rule"] == "none"]
        rows.append((key, what, sum(anchored) / len(anchored), sum(none) / len(none), one_sided_p(anchored, none)))
    order = sorted(range(len(rows)), key=lambda i: rows[i][4])  # Holm: k-th smallest p times (m - k), running max
    holm, running = [0.0] * len(rows), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, rows[i][4] * (len(rows) - rank)))
        holm[i] = running
    print(f"{len(runs)} runs: {sum(r['rule'] != 'none' for r in runs)} anchored, {sum(r['rule'] == 'none' for r in runs)} without KL")
    print("| measure | anchored mean | no KL mean | one-sided exact p | Holm |")
    print("|---|---:|---:|---:|---:|")
    for (key, what, a, b, p), h in zip(rows, holm):
        print(f"| {what} (`{key}`) | {a:.4f} | {b:.4f} | {p:.4f} | {h:.3f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
