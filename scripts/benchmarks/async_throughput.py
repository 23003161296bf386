"""Asynchronous rollouts on the toy: RL-step throughput of rollout.max_staleness 1 against 0, with the engine in
another process (a rollout server), and the final accuracy over seeds. docs/async_rollouts.md quotes its output.

Needs a prepared toy (`emapg prepare --preset toy` into EMAPG_HOME). Every run gets a fresh rollout server
(`emapg rollout serve --model $EMAPG_HOME/toy/model --engine hf --threads 1`, on a free port) and a trainer
(`emapg train --preset toy --set rollout.engine_url=http://127.0.0.1:PORT --set rollout.max_staleness=K`, one
torch thread): on a 2-core machine each side has one core.

    python scripts/benchmarks/async_throughput.py --steps 12 --rounds 3              # throughput, interleaved rounds
    python scripts/benchmarks/async_throughput.py --accuracy --seeds 0 1 2           # final accuracy, 3 seeds x {0, 1}
    python scripts/benchmarks/async_throughput.py --print-commands                   # what it would run, nothing started

Throughput: the two variants alternate within every round (0 then 1, then 1 then 0, ...), so a change of the
machine's load hits both. A run's steps/s is (steps - 1) / the sum over steps 2..N of time/rollout + time/update
(metrics.jsonl: the step's wall time without evaluation, logging and checkpoints; step 1 is synchronous in both
and pays the warm-up). Printed per round with the ratio k=1 / k=0, then the min and median of the ratios.
Accuracy: the preset's full run (or --steps) per seed and variant; summary.json's eval_accuracy_final.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

EMAPG = [sys.executable, "-m", "emapg_cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(home: Path, port: int) -> list[str]:
    """The rollout server of one run (the contract's `emapg rollout serve` options), one torch thread."""
    return [*EMAPG, "rollout", "serve", "--model", str(home / "toy" / "model"), "--engine", "hf", "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--seed", "0", "--threads", "1"]


def train_cmd(port: int, k: int, seed: int, steps: int | None, out: Path, throughput: bool) -> list[str]:
    """`emapg train --preset toy` through the server at `port` with rollout.max_staleness=k. Throughput runs
    evaluate only before and after training and save only at the end (neither is in the timed phases anyway)."""
    sets = [f"rollout.engine_url=http://127.0.0.1:{port}", f"rollout.max_staleness={k}", f"train.seed={seed}"]
    if steps is not None:
        sets.append(f"train.steps={steps}")
    if throughput:
        sets += ["eval.every=0", "train.save_every=0"]
    return [*EMAPG, "train", "--preset", "toy", *(x for s in sets for x in ("--set", s)), "--out", str(out)]


def wait_healthy(port: int, server: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """Poll GET /health until the server answers (it loads the model first); stop if it exited."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the rollout server exited with {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the rollout server on port {port} was not healthy after {timeout_s:.0f} s")


def steps_per_s(run_dir: Path) -> tuple[float, dict[str, float]]:
    """(steps per second over steps 2..N, medians of the async metrics over those steps) from metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted((r for r in rows if r.get("step", 0) >= 2 and "time/rollout" in r), key=lambda r: r["step"])
    if not steps:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no step after the first: run more steps")
    seconds = sum(r["time/rollout"] + r["time/update"] for r in steps)
    extra = {key: statistics.median(r[key] for r in steps if key in r) for key in
             ("rollout/staleness", "rollout/trainer_wait_s", "rollout/engine_wait_s") if any(key in r for r in steps)}
    return len(steps) / seconds, extra


def one_run(home: Path, k: int, seed: int, steps: int | None, out: Path, throughput: bool, log) -> Path:
    """Start a server, train through it, stop the server; returns the run folder."""
    port = free_port()
    env = {**os.environ, "EMAPG_HOME": str(home), "EMAPG_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.server.log", "w") as server_log:
        server = subprocess.Popen(server_cmd(home, port), env=env, stdout=server_log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(port, server)
            t0 = time.time()
            done = subprocess.run(train_cmd(port, k, seed, steps, out, throughput), env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"train k={k} seed={seed} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
            log(f"  {out.name}: {time.time() - t0:.0f} s")
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return out


def ratio_table(results: list[tuple[int, float, float, dict, dict]]) -> str:
    """Markdown table: per round steps/s of k=0 and k=1 and their ratio, the async run's median staleness and
    waits, then the min and median ratio."""
    lines = ["| round | k=0 steps/s | k=1 steps/s | ratio k=1/k=0 | k=1 staleness | k=1 trainer wait s | k=1 engine wait s |",
             "|---|---|---|---|---|---|---|"]
    for rnd, s0, s1, _, m1 in results:
        lines.append(f"| {rnd} | {s0:.3f} | {s1:.3f} | {s1 / s0:.3f} | {m1.get('rollout/staleness', float('nan')):.2f} | "
                     f"{m1.get('rollout/trainer_wait_s', float('nan')):.3f} | {m1.get('rollout/engine_wait_s', float('nan')):.3f} |")
    ratios = [s1 / s0 for _, s0, s1, _, _ in results]
    lines.append(f"\nratio k=1 / k=0 over {len(ratios)} rounds: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}; "
                 f"steps/s median k=0 {statistics.median(r[1] for r in results):.3f}, k=1 {statistics.median(r[2] for r in results):.3f}")
    return "\n".join(lines)


def accuracy_table(acc: dict[int, dict[int, float]]) -> str:
    """Markdown table of the final accuracy per seed and variant, the spread, and whether every k=1 accuracy lies
    within the k=0 runs' range over the seeds."""
    seeds = sorted(acc[0])
    lines = ["| seed | k=0 final accuracy | k=1 final accuracy |", "|---|---|---|"]
    lines += [f"| {s} | {acc[0][s]:.4f} | {acc[1][s]:.4f} |" for s in seeds]
    lo, hi = min(acc[0].values()), max(acc[0].values())
    for k in (0, 1):
        v = list(acc[k].values())
        lines.append(f"k={k}: mean {statistics.mean(v):.4f}, min {min(v):.4f}, max {max(v):.4f}")
    inside = all(lo <= a <= hi for a in acc[1].values())
    mean1 = statistics.mean(acc[1].values())
    lines.append(f"k=1 within the k=0 seed range [{lo:.4f}, {hi:.4f}]: every seed {inside}, mean {lo <= mean1 <= hi}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--home", type=Path, default=Path(os.environ.get("EMAPG_HOME", "~/.emapg")).expanduser(),
                   help="EMAPG_HOME holding the prepared toy (default: $EMAPG_HOME)")
    p.add_argument("--out", type=Path, default=Path(time.strftime("async-throughput-%Y%m%d-%H%M%S")),
                   help="a new folder for the runs and the server logs")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (throughput default 12; accuracy: the preset's)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of {0, 1} (throughput, at least 3)")
    p.add_argument("--accuracy", action="store_true", help="final accuracy over --seeds x {0, 1} instead of throughput")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed values (accuracy)")
    p.add_argument("--print-commands", action="store_true", help="print the server and train commands, run nothing")
    a = p.parse_args()
    if not (a.home / "toy" / "model").is_dir() and not a.print_commands:
        raise SystemExit(f"{a.home}/toy/model: no prepared toy (run `emapg prepare --preset toy` with EMAPG_HOME={a.home})")
    if a.rounds < 3 and not a.accuracy:
        raise SystemExit("--rounds: at least 3 (the median of 3 ratios)")
    steps = a.steps if (a.steps is not None or a.accuracy) else 12
    if a.print_commands:
        print(" ".join(server_cmd(a.home, 8100)))
        for k in (0, 1):
            print(" ".join(train_cmd(8100, k, 0, steps, a.out / f"k{k}", not a.accuracy)))
        return
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if a.accuracy:
        acc: dict[int, dict[int, float]] = {0: {}, 1: {}}
        for seed in a.seeds:
            for k in ((0, 1) if seed % 2 == 0 else (1, 0)):
                run = one_run(a.home, k, seed, steps, a.out / f"acc-seed{seed}-k{k}", False, log)
                acc[k][seed] = json.loads((run / "summary.json").read_text())["eval_accuracy_final"]
        print(accuracy_table(acc))
        return
    results = []
    for rnd in range(1, a.rounds + 1):
        log(f"round {rnd}")
        got: dict[int, tuple[float, dict]] = {}
        for k in ((0, 1) if rnd % 2 else (1, 0)):
            got[k] = steps_per_s(one_run(a.home, k, 0, steps, a.out / f"round{rnd}-k{k}", True, log))
        results.append((rnd, got[0][0], got[1][0], got[0][1], got[1][1]))
    print(ratio_table(results))


if __name__ == "__main__":
    main()
