"""Measure `emapg retriever index` (the streamed bm25 build) at growing corpus sizes and extrapolate to wiki-18.

For each size N (synthetic Wikipedia-like passages, scripts/benchmarks/synthetic_corpus.py, generated once into --work):
  * build: `emapg retriever index` in a subprocess: wall time and the child's peak RSS (os.wait4's ru_maxrss);
  * on-disk size of the index folder (score matrix, vocabulary, doc store);
  * load: a fresh process times `BM25Retriever.load` (memory-mapped, with its checks) and its RSS after loading;
  * queries: 3-6 words of random passages, one query at a time (p50/p99 latency) and batches of 64 (queries/s).
Then least-squares lines a + b·N for build time and disk size (both linear in the passages: every passage is
tokenised once and stores its (term, score) pairs once) extrapolated to 2·10^7 passages (wiki-18: 21,015,324).
Peak RSS is bounded independently of N: the build holds the vocabulary (term -> id dict and df array), one chunk
of rows (--chunk-rows) and, when it writes the matrix, one spill bucket (~64 MiB of corpus each, so a bucket's
size varies a little with N); the script measures the per-term cost of the vocabulary so the peak can be stated
for a larger vocabulary than the synthetic one (the largest measured peak + that cost per further term).
Optionally (--in-memory-max) the previous in-memory build (the whole corpus in a list + bm25s.index) is measured for comparison.

    python scripts/benchmarks/bm25_scale.py --sizes 100000 1000000 --work scale-work --json bm25-scale.json

The machine's other load makes wall times noisy; RSS and sizes are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
WIKI18 = 21_015_324  # wiki-18 passages (DPR's Wikipedia split, Search-R1's corpus)
TARGET = 20_000_000
#: The build's one per-row memory: the 8-byte id hashes of the duplicate-id check, twice while they are concatenated.
ROW_BYTES = 16


def tag(n: int) -> str:
    e = len(str(n)) - 1
    return f"1e{e}" if n == 10 ** e else str(n)


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd`; its wall time, CPU time (user + system: steadier than wall time on a shared machine), peak RSS
    (MiB) and exit code (os.wait4 gives this child's own rusage)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"seconds": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_mib": usage.ru_maxrss / 1024, "rc": proc.returncode,
            "stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace")}


def folder_bytes(folder: Path) -> dict:
    groups = {"matrix": 0, "vocab": 0, "docs": 0, "other": 0}
    for p in folder.rglob("*"):
        if p.is_file():
            name = p.name
            key = ("matrix" if name.endswith(".csc.index.npy") else "vocab" if name == "vocab.index.json"
                   else "docs" if name.startswith("docs.") else "other")
            groups[key] += p.stat().st_size
    groups["total"] = sum(groups.values())
    return groups


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def probe(index: Path, n_queries: int, seed: int) -> dict:
    """In this (fresh) process: load time, RSS after load, and query latency over the index."""
    import numpy as np

    from emapg_cli.retrieval.bm25 import BM25Retriever

    rss0 = rss_mib()
    t0 = time.perf_counter()
    r = BM25Retriever.load(index)
    load_s = time.perf_counter() - t0
    rss_loaded = rss_mib()
    rng = random.Random(seed)
    queries = []
    for i in rng.sample(range(len(r.docs)), n_queries):
        words = r.docs[i]["contents"].split("\n", 1)[1].split()
        k = rng.randint(3, 6)
        s = rng.randrange(max(1, len(words) - k))
        queries.append(" ".join(words[s:s + k]))
    r.search(queries[:4], 3)  # warm up
    single = []
    for q in queries:
        t = time.perf_counter()
        r.search([q], 3)
        single.append(time.perf_counter() - t)
    t = time.perf_counter()
    for s in range(0, len(queries), 64):
        r.search(queries[s:s + 64], 3)
    batch_qps = len(queries) / (time.perf_counter() - t)
    ms = np.array(single) * 1000
    return {"load_s": load_s, "rss_before_load_mib": rss0, "rss_after_load_mib": rss_loaded,
            "rss_after_queries_mib": rss_mib(), "vocab": len(r.model.vocab_dict) - 1,
            "nnz": int(len(r.model.scores["data"])), "rows": len(r.docs),
            "query_p50_ms": float(np.percentile(ms, 50)), "query_p99_ms": float(np.percentile(ms, 99)),
            "single_qps": float(1000 / ms.mean()), "batch64_qps": batch_qps}


def in_memory_build(corpus: Path, out: Path) -> dict:
    """The previous build, for comparison: every row and its tokens in memory, bm25s.BM25.index, save."""
    import bm25s

    from emapg_cli.retrieval.bm25 import _tokens
    from emapg_cli.retrieval.corpus import iter_corpus

    docs = list(iter_corpus(corpus))
    tokens = []
    for s in range(0, len(docs), 2000):
        tokens.extend(_tokens([d["contents"] for d in docs[s:s + 2000]]))
    m = bm25s.BM25()
    m.index(tokens, show_progress=False)
    m.save(str(out), show_progress=False)
    return {"rows": len(docs)}


def term_cost(n: int = 1_000_000) -> dict:
    """Bytes per vocabulary entry of the build (a str -> int dict entry and an int64 df slot), measured by RSS."""
    import numpy as np

    from synthetic_corpus import pseudo_word

    base = rss_mib()
    vocab = {}
    for i in range(n):  # the token strings are kept by the dict, so they count: 10-12 letters, as rare words are
        vocab.setdefault(pseudo_word(i + 10_000_000), len(vocab))
    df = np.zeros(2 * n, np.int64)  # the df array doubles as it grows
    df[:] = 1
    with_words = rss_mib()
    return {"terms": n, "bytes_per_term": (with_words - base) * 2 ** 20 / n}


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else my / mx
    return my - b * mx, b


def measure(n: int, work: Path, chunk_rows: int, queries: int, seed: int, in_memory_max: int) -> dict:
    from synthetic_corpus import write_corpus

    from emapg_cli.retrieval.bm25 import remove_index

    corpus = work / f"corpus-{tag(n)}.jsonl"
    gen = None
    if not corpus.is_file():
        gen = write_corpus(corpus, n, seed=seed)
    index = work / f"bm25-{tag(n)}"
    remove_index(index)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    build = run_measured([sys.executable, "-m", "emapg_cli", "retriever", "index", str(corpus), "--out", str(index),
                          "--chunk-rows", str(chunk_rows)], env)
    if build["rc"]:
        raise SystemExit(f"build of {n} passages failed: {build['stderr'][-2000:]}")
    manifest = json.loads((index / "manifest.json").read_text())
    pr = run_measured([sys.executable, __file__, "--probe", str(index), "--queries", str(queries), "--seed", str(seed)], env)
    if pr["rc"]:
        raise SystemExit(f"probe failed: {pr['stderr'][-2000:]}")
    row = {"passages": n, "corpus_bytes": corpus.stat().st_size, "generate": gen, "build_s": build["seconds"], "build_cpu_s": build["cpu_s"],
           "index_s": manifest["index_s"], "build_peak_rss_mib": build["peak_rss_mib"], "disk": folder_bytes(index),
           "chunk_rows": chunk_rows, **json.loads(pr["stdout"].strip().splitlines()[-1]), "probe_peak_rss_mib": pr["peak_rss_mib"]}
    if n <= in_memory_max:
        old = work / f"inmem-{tag(n)}"
        shutil.rmtree(old, ignore_errors=True)
        m = run_measured([sys.executable, __file__, "--in-memory", str(corpus), str(old)], env)
        row["in_memory_build"] = {"seconds": m["seconds"], "cpu_s": m["cpu_s"], "peak_rss_mib": m["peak_rss_mib"], "rc": m["rc"]}
        shutil.rmtree(old, ignore_errors=True)
    return row


def report(rows: list[dict], cost: dict, vocab_assumed: int) -> dict:
    ns = [r["passages"] for r in rows]
    t_fit = fit(ns, [r["build_s"] for r in rows])
    c_fit = fit(ns, [r["build_cpu_s"] for r in rows])
    d_fit = fit(ns, [r["disk"]["total"] for r in rows])
    peak = max(r["build_peak_rss_mib"] for r in rows)
    biggest = max(rows, key=lambda r: r["passages"])
    extra_terms = max(0, vocab_assumed - biggest["vocab"])
    rss_2e7 = peak + (extra_terms * cost["bytes_per_term"] + ROW_BYTES * (TARGET - biggest["passages"])) / 2 ** 20
    ext = {"passages": TARGET, "build_s": t_fit[0] + t_fit[1] * TARGET, "build_cpu_s": c_fit[0] + c_fit[1] * TARGET,
           "disk_bytes": d_fit[0] + d_fit[1] * TARGET, "fit_build_cpu_s": {"a": c_fit[0], "b_per_passage": c_fit[1]},
           "build_peak_rss_mib": rss_2e7, "vocab_assumed": vocab_assumed,
           "fit_build_s": {"a": t_fit[0], "b_per_passage": t_fit[1]}, "fit_disk_bytes": {"a": d_fit[0], "b_per_passage": d_fit[1]},
           "rss_rule": f"peak RSS = largest measured peak ({peak:.0f} MiB, at vocab {biggest['vocab']:,}) + "
                       f"{cost['bytes_per_term']:.0f} B per further vocabulary term + {ROW_BYTES} B per further passage"}
    print(f"\n{'passages':>11} {'build s':>8} {'CPU s':>7} {'peak RSS':>9} {'disk':>9} {'matrix':>8} {'docs':>8} {'vocab':>9} "
          f"{'load s':>7} {'p50 ms':>7} {'p99 ms':>7} {'q/s b64':>8}")
    for r in rows:
        print(f"{r['passages']:>11,} {r['build_s']:>8.1f} {r['build_cpu_s']:>7.1f} {r['build_peak_rss_mib']:>6.0f} MiB {r['disk']['total'] / 2**30:>5.2f} GiB "
              f"{r['disk']['matrix'] / 2**30:>5.2f} G {r['disk']['docs'] / 2**30:>5.2f} G {r['vocab']:>9,} {r['load_s']:>7.2f} "
              f"{r['query_p50_ms']:>7.1f} {r['query_p99_ms']:>7.1f} {r['batch64_qps']:>8.1f}")
    print(f"{TARGET:>11,} {ext['build_s']:>8.0f} {ext['build_cpu_s']:>7.0f} {ext['build_peak_rss_mib']:>6.0f} MiB {ext['disk_bytes'] / 2**30:>5.1f} GiB "
          f"  (extrapolated: time and disk a + b·N least squares; RSS for a vocabulary of {vocab_assumed:,} terms)")
    print(f"fit: build_s = {t_fit[0]:.2f} + {t_fit[1] * 1e6:.2f}e-6 · N; CPU s = {c_fit[0]:.2f} + {c_fit[1] * 1e6:.2f}e-6 · N; disk = {d_fit[0] / 2**20:.1f} MiB + {d_fit[1]:.0f} B · N")
    print(ext["rss_rule"])
    for r in rows:
        if "in_memory_build" in r:
            print(f"in-memory build (before): {r['passages']:,} passages: {r['in_memory_build']['seconds']:.1f} s "
                  f"({r['in_memory_build']['cpu_s']:.1f} s CPU), "
                  f"peak RSS {r['in_memory_build']['peak_rss_mib']:.0f} MiB")
    return ext


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000], help="Passages per measured corpus.")
    ap.add_argument("--work", type=Path, default=Path("bm25-scale"), help="Folder for the corpora and the indexes (kept).")
    ap.add_argument("--chunk-rows", type=int, default=10_000, help="`retriever index --chunk-rows`.")
    ap.add_argument("--queries", type=int, default=500, help="Queries timed per index.")
    ap.add_argument("--seed", type=int, default=0, help="Corpus and query seed.")
    ap.add_argument("--in-memory-max", type=int, default=100_000, help="Also measure the in-memory bm25s build up to this size (0: never).")
    ap.add_argument("--vocab-2e7", type=int, default=20_000_000,
                    help="Vocabulary assumed for the 2e7 extrapolation of peak RSS (wiki-18's is not measured here; a "
                         "pessimistic default).")
    ap.add_argument("--json", type=Path, default=None, help="Write the measurements and the extrapolation here.")
    ap.add_argument("--with", dest="earlier", type=Path, nargs="*", default=[],
                    help="JSON files of earlier runs whose rows join this run's in the table and the fit (sizes measured here win).")
    ap.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--in-memory", nargs=2, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--term-cost", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.probe, args.queries, args.seed)))
        return 0
    if args.in_memory:
        print(json.dumps(in_memory_build(*args.in_memory)))
        return 0
    if args.term_cost:
        print(json.dumps(term_cost()))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in sorted(args.sizes):
        rows.append(measure(n, args.work, args.chunk_rows, args.queries, args.seed, args.in_memory_max))
        print(json.dumps({k: v for k, v in rows[-1].items()}), flush=True)
    measured = {r["passages"] for r in rows}
    for path in args.earlier:
        rows += [r for r in json.loads(path.read_text())["rows"] if r["passages"] not in measured]
    rows.sort(key=lambda r: r["passages"])
    if len({r["passages"] for r in rows}) < 2:
        print("one size only: no fit (give two sizes, or --with an earlier run's JSON)")
        if args.json:
            args.json.write_text(json.dumps({"rows": rows}, indent=2))
        return 0
    tc = run_measured([sys.executable, __file__, "--term-cost"])
    cost = json.loads(tc["stdout"].strip().splitlines()[-1])
    ext = report(rows, cost, args.vocab_2e7)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "term_cost": cost, "extrapolated": ext,
                                         "cpus": os.cpu_count(), "ru_maxrss_unit": "KiB (Linux)",
                                         "self_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
