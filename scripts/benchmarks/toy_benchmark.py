"""Prepare a toy task and train on it for several seeds; print the table the docs quote.

For each seed s: the preset's prepare (seed s) into its own EMAPG_HOME, then the real CLI
`emapg train --preset PRESET --set train.seed=s` in a subprocess. Prints, per seed, the warm start's
wall time and greedy test accuracy, the RL wall time and the final accuracy, then the mean gain.
For `toy-search`, the final policy is also evaluated with search disabled (`emapg eval
--retriever ... --max-turns 0`: only the final turn, no search).

    python scripts/benchmarks/toy_benchmark.py                 # seeds 0 1 2, under ./toy-benchmark
    python scripts/benchmarks/toy_benchmark.py --seeds 0 --out bench-seed0
    python scripts/benchmarks/toy_benchmark.py --prepare-only --out ws-avx512   # the warm start alone
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python scripts/benchmarks/toy_benchmark.py --prepare-only --out ws-avx2  # ... as on a CPU without AVX-512
    python scripts/benchmarks/toy_benchmark.py --preset toy-search --seeds 0 1 2 --out toy-search-benchmark
    python scripts/benchmarks/toy_benchmark.py --preset toy-tools --seeds 0 1 2 --out toy-tools-benchmark

For `toy-tools`, the final policy is also evaluated in the `calc` environment (`emapg eval --env calc`, greedy)
for its calculator calls per episode; the table adds calls before (the warm start's, greedy, from its manifest)
and after, and the sampled calls per episode of the first and last RL steps (`env/calls` in metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def no_search_accuracy(home: Path, run_dir: Path) -> float:
    """Greedy test exact match of the final toy-search policy with search disabled (`--max-turns 0`)."""
    out = run_dir / "eval-no-search"
    subprocess.run(
        [sys.executable, "-m", "emapg_cli", "eval", "--preset", "toy-search", "--model", str(run_dir / "final" / "policy"),
         "--max-turns", "0", "--out", str(out)],  # the run's own evaluation settings, search disabled
        env={**os.environ, "EMAPG_HOME": str(home)}, check=True,
    )
    return json.loads((out / "summary.json").read_text())["search"]["exact_match"]


def preset_eval_accuracy(home: Path, run_dir: Path, preset: str) -> float:
    """`emapg eval --preset PRESET --model RUN/final/policy` (the run's own evaluation settings), checked against the
    run's final eval/accuracy: the documented eval line must reproduce the training run's final score exactly."""
    out = run_dir / "eval-preset"
    subprocess.run([sys.executable, "-m", "emapg_cli", "eval", "--preset", preset, "--model", str(run_dir / "final" / "policy"),
                    "--out", str(out)], env={**os.environ, "EMAPG_HOME": str(home)}, check=True)
    score = json.loads((out / "summary.json").read_text())["pass@1"]
    final = json.loads((run_dir / "summary.json").read_text())["eval_accuracy_final"]
    if abs(score - final) > 1e-6:  # eval/accuracy is a float32 ratio: 214/300 -> 0.71333331; pass@1 is float64
        raise SystemExit(f"{run_dir}: `emapg eval --preset {preset}` scored {score:.6f}, the run's final evaluation {final:.6f}")
    return score


def tools_calls(home: Path, run_dir: Path) -> dict:
    """Greedy test accuracy and calculator calls per episode of the final toy-tools policy (`emapg eval --env calc`),
    and the sampled calls per episode of the first and last RL steps."""
    out = run_dir / "eval-calc"
    subprocess.run(
        [sys.executable, "-m", "emapg_cli", "eval", "--bench", str(home / "toy-tools" / "test.jsonl"), "--model",
         str(run_dir / "final" / "policy"), "--backend", "hf", "--env", "calc", "--n", "1", "--temperature", "0",
         "--max-tokens", "24", "--out", str(out)],
        env={**os.environ, "EMAPG_HOME": str(home)}, check=True,
    )
    summary = json.loads((out / "summary.json").read_text())
    sampled = [r["env/calls"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "env/calls" in r]
    return {"eval_final": summary["pass@1"], "calls_final": summary["env"]["calls"], "sampled_calls_first": sampled[0],
            "sampled_calls_last": sampled[-1]}


def run_seed(seed: int, out: Path, preset: str, prepare_only: bool = False) -> dict:
    home = out / f"home-{seed}"
    if preset == "toy":
        from emapg_cli.tasks.toy.prepare import prepare_toy

        manifest = prepare_toy(home, seed, progress=True)
    elif preset == "toy-tools":
        from emapg_cli.tasks.toy_tools.prepare import prepare_toy_tools

        manifest = prepare_toy_tools(home, seed, progress=True)
    else:
        from emapg_cli.tasks.toy_search.prepare import prepare_toy_search

        manifest = prepare_toy_search(home, seed, progress=True)
    if prepare_only:
        return {"seed": seed, "sft_s": manifest["sft_wall_s"], "sft_steps": manifest["sft_steps"],
                "initial": manifest["sft_test_accuracy"]}
    run_dir = out / f"run-{seed}"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "emapg_cli", "train", "--preset", preset, "--set", f"train.seed={seed}", "--out", str(run_dir)],
        env={**os.environ, "EMAPG_HOME": str(home)}, check=True,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    extra = {"final_no_search": no_search_accuracy(home, run_dir)} if preset == "toy-search" else {}
    if preset in ("toy", "toy-search"):  # the documented eval line reproduces the run's final score (issue 20)
        extra["final_eval_preset"] = preset_eval_accuracy(home, run_dir, preset)
    if preset == "toy-tools":
        extra = {"sft_steps": manifest["sft_steps"], "calls_initial": manifest["sft_test_calls"],
                 "call_probability_initial": manifest["sft_call_probability"], **tools_calls(home, run_dir)}
    return {**extra,
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
    parser.add_argument("--preset", choices=("toy", "toy-search", "toy-tools"), default="toy", help="Which toy task.")
    parser.add_argument("--prepare-only", action="store_true", help="Only the warm start: its steps, time and initial accuracy.")
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"{args.out} is not empty; pass another --out")
    rows = [run_seed(s, args.out, args.preset, args.prepare_only) for s in args.seeds]
    if args.prepare_only:
        import torch

        print(f"\ntorch CPU kernels: {torch.backends.cpu.get_cpu_capability()}\n| seed | warm start (s) | steps | initial acc |\n|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['seed']} | {r['sft_s']:.0f} | {r['sft_steps']} | {r['initial']:.1%} |")
        (args.out / "benchmark.json").write_text(json.dumps(rows, indent=2) + "\n")
        return
    print("\n| seed | warm start (s) | initial acc | RL wall (s) | final acc | gain |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seed']} | {r['sft_s']:.0f} | {r['initial']:.1%} | {r['rl_s']:.0f} | {r['final']:.1%} "
              f"| {100 * (r['final'] - r['initial']):+.1f} pts |")
    if args.preset == "toy-tools":
        print("\n| seed | warm start | p(call) | greedy acc, calls: before | after | sampled calls: step 1 | last step |"
              " RL wall (s) |\n|---:|---|---:|---|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['seed']} | {r['sft_steps']} steps, {r['sft_s']:.0f} s | {r['call_probability_initial']:.2f} "
                  f"| {r['initial']:.1%}, {r['calls_initial']:.2f} | {r['final']:.1%}, {r['calls_final']:.2f} "
                  f"| {r['sampled_calls_first']:.2f} | {r['sampled_calls_last']:.2f} | {r['rl_s']:.0f} |")
    if args.preset == "toy-search":
        print("\nsearch disabled, final policy: " + ", ".join(f"seed {r['seed']} {r['final_no_search']:.1%}" for r in rows))
    gains = [r["final"] - r["initial"] for r in rows]
    print(f"\nmean gain over {len(rows)} seeds: {100 * sum(gains) / len(gains):+.1f} points")
    (args.out / "benchmark.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
