"""Time grading of adversarial model output against ordinary output (docs/reliability.md).

Builds 1000 ordinary responses (a few hundred characters of reasoning, then a boxed answer: the gold
as written, an equivalent form, or a wrong value) and 1000 adversarial ones (exponent towers, huge
factorials, unclosed braces, NUL bytes, lone surrogates, 1-2 MB strings of text / dots / braces /
boxes, deep nesting, 4000-digit numbers). Each set
is graded by a fresh `MathGrader` (worker start-up included in both), alternating ordinary and
adversarial rounds so a machine shared with other work loads both alike. Prints per round the wall
time and the CPU time (this process and its workers), the ratio adversarial / ordinary, the pool's counts and the peak RSS of any grading worker
(sampled every 20 ms), then the wall time of each adversarial kind graded alone (bounded by the
timeout; two more kinds that are slow inside sympy itself, which only the timeout bounds, are timed
here too), and finally the real CLI on one 2 MB response.

    python scripts/benchmarks/grading_adversarial.py                 # 2 rounds, 2 workers, 1 s timeout
    python scripts/benchmarks/grading_adversarial.py --rounds 3 --workers 4 --timeout 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GOLDS = ["42", "\\frac{3}{4}", "2\\sqrt{5}", "(1, 2)", "x^2+1", "\\frac{\\pi}{6}", "1,3,5", "-7", "0.25", "[0, 1)"]
EQUIVALENT = {"42": "42.0", "\\frac{3}{4}": "0.75", "2\\sqrt{5}": "\\sqrt{20}", "(1, 2)": "(1,2)", "x^2+1": "1+x^2",
              "\\frac{\\pi}{6}": "\\pi/6", "1,3,5": "5,3,1", "-7": "-\\frac{14}{2}", "0.25": "\\frac14", "[0, 1)": "[0,1)"}
REASONING = "We expand the expression, collect terms and check the boundary cases carefully. " * 6

ADVERSARIAL = {
    "tower 2^{2^{40}}": "\\boxed{2^{2^{40}}}",
    "tower 10^{10^{10^{10}}}": "\\boxed{10^{10^{10^{10}}}}",
    "tower 9^{9^{9^{9}}}": "\\boxed{9^{9^{9^{9}}}}",
    "tower in exponent x^{2^{2^{40}}}": "\\boxed{x^{2^{2^{40}}}}",
    "factorial 1000000!": "\\boxed{1000000!}",
    "unclosed braces 100k": "\\boxed{" + "{" * 100_000,
    "unclosed \\frac": REASONING + "\\boxed{\\frac{1}{",
    "NUL bytes": "\x00" * 100_000 + "\\boxed{1\x002}",
    "lone surrogate": "\\boxed{\ud800}",
    "1 MB text then box": "x" * 1_000_000 + "\\boxed{ANSWER}",
    "2 MB of dots in a box": "\\boxed{1" + " ." * 1_000_000 + "}",
    "1 MB sum in a box": "\\boxed{" + "1+" * 500_000 + "1}",
    "1 MB of open braces": "{" * 1_000_000,
    "1 MB of unclosed boxes": "\\boxed{" * 150_000,
    "nested braces 200k": "\\boxed{" + "{" * 200_000 + "1" + "}" * 200_000 + "}",
    "4000-digit integer": "\\boxed{" + "9" * 4000 + "}",
    "nested \\frac x600": "\\boxed{" + "\\frac{1}{" * 600 + "2" + "}" * 600 + "}",
    "many </think>": "</think>" * 100_000 + "\\boxed{ANSWER}",
}
#: Answers that pass every cheap check and are slow inside sympy: only the pool's kill bounds them,
#: so each costs the timeout plus a worker restart. Timed one at a time, not part of the ratio.
NEEDS_THE_TIMEOUT = {
    "sum at the 4096 cap": "\\boxed{" + "1+" * 2047 + "1}",
    "symbolic (x+1)^{1000}": "\\boxed{(x+1)^{1000}}",
}


def ordinary(n: int) -> tuple[list[str], list[str]]:
    responses, golds = [], []
    for i in range(n):
        gold = GOLDS[i % len(GOLDS)]
        kind = i % 10
        answer = gold if kind < 4 else EQUIVALENT[gold] if kind < 7 else f"{gold} + {i % 7 + 1}"
        responses.append(f"<think>{REASONING}</think>{REASONING}So the answer is $\\boxed{{{answer}}}$.")
        golds.append(gold)
    return responses, golds


def adversarial(n: int) -> tuple[list[str], list[str]]:
    """Kinds cycled; where a kind's payload is around an ordinary answer (ANSWER), it is one of the
    ordinary set's wrong answers, so the comparison itself costs what an ordinary one does."""
    kinds = list(ADVERSARIAL.values())
    golds = [GOLDS[i % len(GOLDS)] for i in range(n)]
    return [kinds[i % len(kinds)].replace("ANSWER", f"{golds[i]} + {i % 7 + 1}") for i in range(n)], golds


class PeakRSS:
    """Samples the resident memory of the grader's worker processes every 20 ms."""

    def __init__(self, grader) -> None:
        self.grader, self.peak, self._stop = grader, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            pool = self.grader._pool
            for w in list(pool._workers) if pool else []:
                try:
                    with open(f"/proc/{w.proc.pid}/status") as f:
                        for line in f:
                            if line.startswith(("VmRSS:", "VmHWM:")):
                                self.peak = max(self.peak, int(line.split()[1]) * 1024)
                except (OSError, ValueError):
                    pass

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def grade_set(responses: list[str], golds: list[str], workers: int, timeout: float) -> dict:
    from emapg_cli.grading import Gold, MathGrader

    import resource

    def cpu() -> float:  # this process plus its reaped children (the workers, once closed)
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    t0, c0 = time.perf_counter(), cpu()
    with MathGrader(workers=workers, timeout=timeout) as grader, PeakRSS(grader) as rss:
        grades = grader.grade(responses, [Gold((g,)) for g in golds])
        stats = grader.pool_stats
        refused = grader.refused
    return {
        "wall_s": time.perf_counter() - t0,
        "cpu_s": cpu() - c0,
        "correct": sum(g.correct for g in grades),
        "refused": refused,
        "timeouts": stats.timeouts,
        "errors": stats.errors,
        "out_of_memory": stats.out_of_memory,
        "crashes": stats.crashes,
        "worker_peak_rss_mib": rss.peak / 2**20,
    }


def each_kind_alone(workers: int, timeout: float) -> None:
    from emapg_cli.grading import Gold, MathGrader

    print(f"\nadversarial kinds graded one at a time (warm pool, timeout {timeout:g} s):")
    with MathGrader(workers=workers, timeout=timeout) as grader:
        grader.grade(["\\boxed{x+1}"], [Gold(("y",))])  # start the workers first
        for name, response in {**ADVERSARIAL, **NEEDS_THE_TIMEOUT}.items():
            t0 = time.perf_counter()
            (grade,) = grader.grade([response.replace("ANSWER", "5")], [Gold(("5",))])
            print(f"  {name:36s} {time.perf_counter() - t0:6.3f} s  correct={grade.correct}")
        stats = grader.pool_stats
        print(f"  pool: {stats.timeouts} timeouts, {stats.errors} errors, {stats.crashes} crashes; {grader.refused} refused")


def cli_two_megabytes(timeout: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "bench.jsonl").write_text(json.dumps({"id": "a", "question": "1?", "answers": ["1"]}) + "\n")
        response = "\\boxed{1" + " ." * 1_000_000 + "}"
        (tmp / "given.jsonl").write_text(json.dumps({"id": "a", "responses": [response]}) + "\n")
        import resource

        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        c0 = kids.ru_utime + kids.ru_stime
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-m", "emapg_cli", "eval", "--bench", str(tmp / "bench.jsonl"), "--responses", str(tmp / "given.jsonl"),
             "--grader-timeout", str(timeout), "--out", str(tmp / "out")],
            capture_output=True, text=True,
        )
        wall = time.perf_counter() - t0
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = kids.ru_utime + kids.ru_stime - c0  # the whole CLI process: start-up, imports, reading, grading
        summary = json.loads((tmp / "out" / "summary.json").read_text()) if r.returncode == 0 else {}
        print(f"\nCLI, one 2 MB response, --grader-timeout {timeout:g}: exit {r.returncode}, {wall:.2f} s wall, {cpu:.2f} s CPU, "
              f"avg@n {summary.get('avg@n')}, grading_time_s {summary.get('grading_time_s', float('nan')):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000, help="responses per set")
    ap.add_argument("--rounds", type=int, default=2, help="ordinary/adversarial pairs, interleaved")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1.0, help="grader timeout per answer (s)")
    args = ap.parse_args()

    sets = {"ordinary": ordinary(args.n), "adversarial": adversarial(args.n)}
    print(f"{args.n} responses per set, {args.workers} workers, timeout {args.timeout:g} s; "
          f"adversarial set: {len(ADVERSARIAL)} kinds cycled, {sum(map(len, sets['adversarial'][0])) / 2**20:.0f} MiB in all")
    ratios, cpu_ratios = [], []
    for r in range(args.rounds):
        order = ("ordinary", "adversarial") if r % 2 == 0 else ("adversarial", "ordinary")
        walls, cpus = {}, {}
        for name in order:
            res = grade_set(*sets[name], args.workers, args.timeout)
            walls[name], cpus[name] = res["wall_s"], res["cpu_s"]
            print(f"round {r + 1} {name:11s} " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()))
        ratios.append(walls["adversarial"] / walls["ordinary"])
        cpu_ratios.append(cpus["adversarial"] / cpus["ordinary"])
        print(f"round {r + 1} ratio adversarial / ordinary: wall {ratios[-1]:.2f}, cpu {cpu_ratios[-1]:.2f}")
    print(f"wall ratios: {', '.join(f'{x:.2f}' for x in ratios)} (max {max(ratios):.2f}); "
          f"cpu ratios: {', '.join(f'{x:.2f}' for x in cpu_ratios)} (max {max(cpu_ratios):.2f})")
    each_kind_alone(args.workers, args.timeout)
    cli_two_megabytes(args.timeout)


if __name__ == "__main__":
    main()
