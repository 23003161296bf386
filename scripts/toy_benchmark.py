"""Prepare the toy task and train on it for several seeds; print the table the README quotes.

For each seed s: `prepare_toy` (seed s) into its own EMAPG_HOME, then the real CLI
`emapg train --preset toy --set train.seed=s` in a subprocess. Prints, per seed, the warm start's
wall time and greedy test accuracy, the RL wall time and the final accuracy, then the mean gain.

    python scripts/toy_benchmark.py                 # seeds 0 1 2, under ./toy-benchmark
    python scripts/toy_benchmark.py --seeds 0 --out bench-seed0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def run_seed(seed: int, out: Path) -> dict:
    from emapg_cli.toy.prepare import prepare_toy

    home = out / f"home-{seed}"
    manifest = prepare_toy(home, seed, progress=True)
    run_dir = out / f"run-{seed}"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "emapg_cli", "train", "--preset", "toy", "--set", f"train.seed={seed}", "--out", str(run_dir)],
        env={**os.environ, "EMAPG_HOME": str(home)}, check=True,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "seed": seed,
        "sft_s": manifest["sft_wall_s"],
        "initial": summary["eval_accuracy_initial"],
        "rl_s": summary["wall_time_s"],
        "process_s": time.perf_counter() - start,
        "final": summary["eval_accuracy_final"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="Seeds for prepare and train.")
    parser.add_argument("--out", type=Path, default=Path("toy-benchmark"), help="Folder for the homes and runs.")
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"{args.out} is not empty; pass another --out")
    rows = [run_seed(s, args.out) for s in args.seeds]
    print("\n| seed | warm start (s) | initial acc | RL wall (s) | final acc | gain |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seed']} | {r['sft_s']:.0f} | {r['initial']:.1%} | {r['rl_s']:.0f} | {r['final']:.1%} "
              f"| {100 * (r['final'] - r['initial']):+.1f} pts |")
    gains = [r["final"] - r["initial"] for r in rows]
    print(f"\nmean gain over {len(rows)} seeds: {100 * sum(gains) / len(gains):+.1f} points")
    (args.out / "benchmark.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
