"""The smol preset's acceptance measurement: for each seed, a fresh EMAPG_HOME, `emapg prepare --preset smol`, then
`emapg train --preset smol --set train.seed=S`, both timed; then the base model and the final policy graded by
`emapg eval --preset smol` (the run's own evaluation settings) to split the gain into format and content.

    python scripts/benchmarks/smol_benchmark.py --seeds 0 1 2 --out smol-benchmark

Prints per seed: prepare and train wall times, greedy held-out accuracy before and after (the run's eval/accuracy),
the gain; then the mean gain with a 95% confidence interval (Student's t over the seeds). For the base model and
each final policy, from `emapg eval`'s results rows: the share of answers in reasoning-gym's format (an
`<answer>...</answer>` that its `extract_answer` finds), the accuracy among those, and each task's accuracy. Writes
everything to OUT/summary.json. A check: `emapg eval --preset smol` of the final policy must reproduce the run's
final eval/accuracy (the same prompts, stop strings, budget and reward).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: two-sided 95% Student's t quantiles by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def cli(args: list[str], home: Path, log: Path) -> float:
    """Run `emapg ARGS` with EMAPG_HOME=home, its output appended to `log`; returns the wall time in seconds."""
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ emapg {' '.join(args)}\n")
        f.flush()
        subprocess.run([sys.executable, "-m", "emapg_cli", *args], env={**os.environ, "EMAPG_HOME": str(home)},
                       stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def answers_breakdown(eval_dir: Path, bench: Path) -> dict:
    """Format rate, accuracy among formatted answers and per-task accuracy of an `emapg eval` folder of `bench`."""
    from reasoning_gym.utils import extract_answer

    rows = [json.loads(line) for line in (eval_dir / "results.jsonl").read_text().splitlines()]
    task_of = {r["id"]: r["source"] for r in map(json.loads, bench.read_text().splitlines())}
    formatted = solved = total = 0
    per_task: dict[str, list[int]] = {}
    for row in rows:
        task = task_of[row["id"]]
        for text, ok in zip(row["responses"], row["correct"]):
            total += 1
            formatted += extract_answer(text) is not None
            solved += bool(ok)
            per_task.setdefault(task, [0, 0])
            per_task[task][0] += bool(ok)
            per_task[task][1] += 1
    return {"responses": total, "accuracy": solved / total, "format_rate": formatted / total,
            "accuracy_among_formatted": solved / formatted if formatted else None,
            "by_task": {t: c / n for t, (c, n) in sorted(per_task.items())}}


def run_seed(seed: int, out: Path) -> dict:
    home = (out / f"home-{seed}").resolve()
    runs = (out / f"runs-{seed}").resolve()
    runs.mkdir(parents=True, exist_ok=True)
    log = runs / "log.txt"
    prepare_s = cli(["prepare", "--preset", "smol"], home, log)
    train_s = cli(["train", "--preset", "smol", "--set", f"train.seed={seed}", "--out", str(runs / "run")], home, log)
    run = runs / "run"
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    cli(["eval", "--preset", "smol", "--model", str(home / "smol" / "model"), "--out", str(runs / "eval-base")], home, log)
    cli(["eval", "--preset", "smol", "--model", str(run / "final" / "policy"), "--out", str(runs / "eval-final")], home, log)
    final_eval = json.loads((runs / "eval-final" / "summary.json").read_text())["pass@1"]
    if abs(final_eval - summary["eval_accuracy_final"]) > 1e-6:
        raise SystemExit(f"seed {seed}: `emapg eval --preset smol` scored {final_eval:.6f}, the run's final evaluation "
                         f"{summary['eval_accuracy_final']:.6f}")
    return {"seed": seed, "prepare_s": round(prepare_s, 1), "train_s": round(train_s, 1),
            "total_s": round(prepare_s + train_s, 1), "before": summary["eval_accuracy_initial"],
            "after": summary["eval_accuracy_final"], "gain": summary["eval_accuracy_final"] - summary["eval_accuracy_initial"],
            "curve": curve, "base": answers_breakdown(runs / "eval-base", home / "smol" / "test.jsonl"),
            "final": answers_breakdown(runs / "eval-final", home / "smol" / "test.jsonl")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed of each run.")
    parser.add_argument("--out", type=Path, default=Path("smol-benchmark"), help="Folder for the homes and runs.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        r = run_seed(seed, args.out)
        results.append(r)
        print(f"seed {seed}: prepare {r['prepare_s']:.0f} s, train {r['train_s']:.0f} s (total {r['total_s'] / 60:.1f} min); "
              f"greedy held-out accuracy {r['before']:.1%} -> {r['after']:.1%} ({100 * r['gain']:+.1f} points); "
              f"format {r['base']['format_rate']:.0%} -> {r['final']['format_rate']:.0%}, accuracy among formatted "
              f"{r['base']['accuracy_among_formatted']:.1%} -> {r['final']['accuracy_among_formatted']:.1%}; "
              f"by task {r['base']['by_task']} -> {r['final']['by_task']}", flush=True)
    gains = [100 * r["gain"] for r in results]
    mean = statistics.mean(gains)
    half = T95[len(gains) - 1] * statistics.stdev(gains) / math.sqrt(len(gains)) if len(gains) > 1 else float("nan")
    print(f"gain over {len(gains)} seeds: {mean:+.1f} points, 95% CI [{mean - half:+.1f}, {mean + half:+.1f}]; "
          f"longest prepare + train {max(r['total_s'] for r in results) / 60:.1f} min")
    (args.out / "summary.json").write_text(json.dumps({"seeds": results, "gain_mean": mean, "gain_ci95_half": half}, indent=2))


if __name__ == "__main__":
    main()
