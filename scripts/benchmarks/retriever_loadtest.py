"""Load test of `emapg retriever serve` on loopback, side by side with bm25s called in-process (issue 24).

Starts the real `emapg retriever serve INDEX --port 0` (127.0.0.1 only) and, for each cell of clients x batch
(default 1, 8, 64 concurrent clients x 1 and 256 queries per request), has every client send its requests on
one keep-alive connection and measures queries/s (answered queries / the cell's wall time) and the p50/p99
latency of a request. Side by side: bm25s itself in this process on the same index (`bm25s.BM25.load(...,
mmap=True)`, the same tokenizer settings, one thread: tokenise + retrieve, in calls of the same batch size)
on the same queries; the ratio server / in-process is the server's overhead (HTTP, JSON, fetching and encoding
the passages). The compared variants are interleaved in rounds (a shared machine is noisy): min and median.

Every response is counted by class (2xx / 4xx / 5xx / connection error); a last cell sends requests over the
server's limits (4xx expected). The server's peak RSS (VmHWM) and peak anonymous RSS (RssAnon, the part an
mmap'd index does not account for) are sampled from /proc. Bounded: `--queries` per cell (each client sends
at least one request), `--max-seconds` in all (cells not started by then are skipped), a timeout per request.

    python scripts/benchmarks/retriever_loadtest.py                        # a synthetic 20,000-passage index, built here
    python scripts/benchmarks/retriever_loadtest.py --index DIR --rounds 2 # an index of `emapg retriever index`
    python scripts/benchmarks/retriever_loadtest.py --docs 100000 --keep-index idx-1e5

The server runs without its reply cache (`--cache-mb 0`: every query is searched, as in-process) unless
`--cache-mb` says otherwise; queries are passages' own words (2 to 5 of them), distinct within a cell.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's emapg_cli (the doc store reader)
SYLLABLES = ("ka ri to mu sen da vel or an ith ba lo que ster mon gal pre dis tor ven lim "
             "sa no ru be che pol tra xi fen gor hu win ly zed ma kor ul ep").split()


# ------------------------------------------------------------------------------ a synthetic index

def synthetic_corpus(path: Path, n: int, seed: int = 0) -> None:
    """`n` Wikipedia-like passages: a title line + ~100 words (normal, sd 15) from a Zipf vocabulary of 50,000."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = sorted({"".join(rng.choice(SYLLABLES, size=rng.integers(2, 5))) for _ in range(80_000)})[:50_000]
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.07
    p /= p.sum()
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, n, 10_000):
            rows = min(10_000, n - start)
            lengths = np.clip(rng.normal(100, 15, size=rows).astype(int), 20, 200)
            words = rng.choice(len(vocab), size=int(lengths.sum()), p=p)
            at = 0
            for i, k in enumerate(lengths):
                text = " ".join(vocab[w] for w in words[at:at + k])
                at += k
                title = " ".join(vocab[w] for w in words[at - k:at - k + 2]).title()
                f.write(json.dumps({"id": str(start + i), "contents": f'"{title}"\n{text}'}) + "\n")


def build_index(docs: int, out: Path) -> None:
    corpus = out.parent / "corpus.jsonl"
    t0 = time.perf_counter()
    synthetic_corpus(corpus, docs)
    subprocess.run([sys.executable, "-m", "emapg_cli", "retriever", "index", str(corpus), "--out", str(out)],
                   check=True, stdout=subprocess.DEVNULL, env=_env())
    print(f"built a synthetic index of {docs:,} passages in {time.perf_counter() - t0:.0f} s", flush=True)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


# ------------------------------------------------------------------------------ queries

def sample_passages(index: Path, n: int, seed: int = 0) -> list[str]:
    """The `contents` of `n` random rows (the doc store when the index has one, else docs.jsonl, streamed)."""
    rng = random.Random(seed)
    for folder in (index, index / "docs"):
        if (folder / "docs.offsets.npy").is_file():
            from emapg_cli.retrieval.docstore import DocStore

            store = DocStore.open(folder)
            try:
                return [d["contents"] for d in store.get_many([rng.randrange(len(store)) for _ in range(n)])]
            finally:
                store.close()
    kept: list[str] = []
    with open(index / "docs.jsonl", encoding="utf-8") as f:  # reservoir sample
        for i, line in enumerate(f):
            if len(kept) < n:
                kept.append(line)
            elif (j := rng.randrange(i + 1)) < n:
                kept[j] = line
    return [json.loads(line)["contents"] for line in kept]


def make_queries(index: Path, n: int, seed: int = 0) -> list[str]:
    """`n` distinct queries: 2-5 words of one random passage each (lower-cased, words of 3+ letters)."""
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < n:
        for text in sample_passages(index, min(n, 20_000), seed=rng.randrange(1 << 30)):
            words = re.findall(r"[a-z]{3,}", text.lower())
            if words:
                out[" ".join(rng.sample(words, min(len(words), rng.randint(2, 5))))] = None
    return list(out)[:n]


# ------------------------------------------------------------------------------ the server

class Server:
    """`emapg retriever serve INDEX --port 0 ...` in a subprocess, its RSS sampled every 0.1 s."""

    def __init__(self, index: Path, options: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "emapg_cli", "retriever", "serve", str(index), "--port", "0",
                                      *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        t0 = time.perf_counter()
        line = self.proc.stdout.readline()
        m = re.search(r"http://([\d.]+):(\d+)/retrieve", line)
        if not m:
            raise SystemExit(f"the server did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.load_s = time.perf_counter() - t0
        self.port = int(m.group(2))
        self.peak_rss = self.peak_anon = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _status(self) -> dict[str, int]:
        out = {}
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in ("VmRSS", "VmHWM", "RssAnon"):
                        out[key] = int(value.split()[0]) << 10
        except OSError:
            pass
        return out

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server process so far (/proc/PID/stat)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            s = self._status()
            self.peak_rss = max(self.peak_rss, s.get("VmHWM", 0), s.get("VmRSS", 0))
            self.peak_anon = max(self.peak_anon, s.get("RssAnon", 0))

    def stop(self) -> int | None:
        """The exit status if the server died on its own (a crash), else None; then it is stopped."""
        self._sample_once()
        crashed = self.proc.poll()
        self._stop.set()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return crashed

    def _sample_once(self) -> None:
        s = self._status()
        self.peak_rss = max(self.peak_rss, s.get("VmHWM", 0))
        self.peak_anon = max(self.peak_anon, s.get("RssAnon", 0))


def _request(conn: http.client.HTTPConnection, body: bytes) -> tuple[int, bytes]:
    conn.request("POST", "/retrieve", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read()


def run_cell(port: int, clients: int, batches: list[list[list[str]]], topk: int, timeout_s: float,
             counts: dict[str, int]) -> tuple[float, list[float], int]:
    """Each client sends its batches in turn on one connection; (wall s, latencies s, queries answered)."""
    latencies: list[float] = []
    answered = [0]
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(mine: list[list[str]]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        start.wait()
        for batch in mine:
            body = json.dumps({"queries": batch, "topk": topk, "return_scores": True}).encode()
            t0 = time.perf_counter()
            try:
                status, data = _request(conn, body)
                kind = f"{status // 100}xx"
                # the first reply of each client is parsed and checked whole; the others by their start (decoding
                # every reply here would take the CPU the server runs on: client and server share this machine)
                ok = status == 200 and (len(json.loads(data)["result"]) == len(batch) if batch is mine[0]
                                        else data.startswith(b'{"result": [[{"document": '))
            except (OSError, http.client.HTTPException, ValueError):
                kind, ok = "conn", False
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
            dt = time.perf_counter() - t0
            with lock:
                counts[kind] = counts.get(kind, 0) + 1
                if ok:
                    latencies.append(dt)
                    answered[0] += len(batch)
        conn.close()

    threads = [threading.Thread(target=client, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, latencies, answered[0]


def run_refusals(port: int, clients: int, counts: dict[str, int]) -> None:
    """`clients` concurrent requests over the server's limits: topk 0, 1,000 or 5,000 queries, not JSON."""
    bodies = [json.dumps({"queries": ["a"], "topk": 0}).encode(), json.dumps({"queries": ["a"] * 5000, "topk": 3}).encode(),
              json.dumps({"queries": ["a b"] * 1000, "topk": 100}).encode(), b"{not json"]

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            status, _ = _request(conn, bodies[i % len(bodies)])
            kind = f"{status // 100}xx"
        except (OSError, http.client.HTTPException):
            kind = "conn"
        finally:
            conn.close()
        counts[kind] = counts.get(kind, 0) + 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ------------------------------------------------------------------------------ in-process bm25s

class InProcess:
    """bm25s on the same index, memory-mapped, one thread; the tokenizer settings of emapg's bm25 retriever."""

    def __init__(self, index: Path):
        import bm25s

        self.bm25s = bm25s
        t0 = time.perf_counter()
        self.model = bm25s.BM25.load(str(index / "bm25"), mmap=True)
        self.load_s = time.perf_counter() - t0

    def run(self, batches: list[list[str]], topk: int) -> tuple[float, int, float]:
        """(wall s, queries, CPU s of this process: its other threads are idle meanwhile)."""
        t0, c0 = time.perf_counter(), time.process_time()
        for batch in batches:
            tokens = self.bm25s.tokenize(batch, stopwords="en", return_ids=False, show_progress=False)
            self.model.retrieve(tokens, k=topk, show_progress=False, n_threads=1)
        return time.perf_counter() - t0, sum(map(len, batches)), time.process_time() - c0


# ------------------------------------------------------------------------------ main

def _ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return 1000 * values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index", type=Path, help="index folder (`emapg retriever index`); default: build a synthetic one")
    ap.add_argument("--docs", type=int, default=20_000, help="passages of the synthetic index (without --index)")
    ap.add_argument("--keep-index", type=Path, help="build the synthetic index here and keep it")
    ap.add_argument("--clients", default="1,8,64", help="concurrent clients per cell, comma-separated")
    ap.add_argument("--batches", default="1,256", help="queries per request, comma-separated")
    ap.add_argument("--queries", type=int, default=1024, help="queries per cell (each client sends at least one request)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each runs every cell, server and in-process interleaved")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=1200, help="no cell starts after this many seconds")
    ap.add_argument("--max-cell-queries", type=int, default=1 << 20,
                    help="skip the cells that need more queries than this (64 clients x 256 need 16,384)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--serve-option", action="append", default=[], metavar="OPT",
                    help="extra option of `emapg retriever serve`, e.g. --serve-option=--workers=2 (repeatable)")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    args = ap.parse_args()
    clients_list = [int(x) for x in args.clients.split(",")]
    batch_list = [int(x) for x in args.batches.split(",")]
    t_start = time.perf_counter()

    tmp = None
    index = args.index
    if index is None:
        if args.keep_index and (args.keep_index / "manifest.json").is_file():
            index = args.keep_index
        else:
            tmp = Path(tempfile.mkdtemp(prefix="emapg-loadtest-"))
            index = args.keep_index or tmp / "index"
            index.parent.mkdir(parents=True, exist_ok=True)
            build_index(args.docs, index)
    rows = json.loads((index / "manifest.json").read_text())["rows"]

    # every cell's queries are distinct; the pool is cycled across rounds (the server's cache is off)
    need = max(max(args.queries, c * b) for c in clients_list for b in batch_list)
    t0 = time.perf_counter()
    pool = make_queries(index, need)
    print(f"{len(pool):,} distinct queries in {time.perf_counter() - t0:.1f} s", flush=True)

    inproc = InProcess(index)
    options = ["--cache-mb", "0", "--max-connections", str(max(clients_list) + 8)]
    for opt in args.serve_option:
        options += opt.split("=", 1)
    server = Server(index, options)
    print(f"index of {rows:,} passages; server up in {server.load_s:.1f} s (pid {server.proc.pid}, options "
          f"{' '.join(options)}); bm25s mmap load in-process {inproc.load_s:.1f} s", flush=True)

    counts: dict[str, int] = {}
    results = []
    offset = 0
    warm = pool[:64]
    inproc.run([warm], args.topk)
    run_cell(server.port, 1, [[warm]], args.topk, args.timeout, {})
    header = (f"{'round':>5} {'clients':>7} {'batch':>5} {'reqs':>5} {'queries':>7} {'server q/s':>10} "
              f"{'p50 ms':>8} {'p99 ms':>8} {'in-proc q/s':>11} {'ratio':>6} {'srv cpu ms/q':>9} {'in cpu ms/q':>9} "
              f"{'cpu ratio':>6}")
    print(header, flush=True)
    skipped = 0
    for r in range(args.rounds):
        for batch in (batch_list if r % 2 == 0 else batch_list[::-1]):
            # in-process on this batch size's own queries, half before the server's cells and half after them
            n_in = max(batch, (args.queries // batch) * batch)
            in_batches = [pool[(offset + i) % len(pool):(offset + i) % len(pool) + batch] for i in range(0, n_in, batch)]
            offset += n_in
            in_s, in_n, in_cpu = inproc.run(in_batches[:(len(in_batches) + 1) // 2], args.topk)
            rows_here = []
            for clients in (clients_list if r % 2 == 0 else clients_list[::-1]):
                per_client = max(1, args.queries // (clients * batch))
                if time.perf_counter() - t_start > args.max_seconds or clients * per_client * batch > args.max_cell_queries:
                    skipped += 1
                    continue
                total = clients * per_client * batch
                qs = [pool[(offset + i) % len(pool)] for i in range(total)]
                offset += total
                mine = [[qs[(c * per_client + j) * batch:(c * per_client + j + 1) * batch] for j in range(per_client)]
                        for c in range(clients)]
                cpu0 = server.cpu_s()
                wall, lat, answered = run_cell(server.port, clients, mine, args.topk, args.timeout, counts)
                rows_here.append({"round": r, "clients": clients, "batch": batch, "requests": clients * per_client,
                                  "queries": answered, "server_qps": answered / wall, "p50_ms": _ms(lat, 0.5),
                                  "p99_ms": _ms(lat, 0.99), "server_cpu_ms": 1000 * (server.cpu_s() - cpu0) / max(answered, 1)})
            s2, n2, cpu2 = inproc.run(in_batches[(len(in_batches) + 1) // 2:], args.topk)
            in_qps, in_cpu_ms = (in_n + n2) / (in_s + s2), 1000 * (in_cpu + cpu2) / (in_n + n2)
            for row in rows_here:
                row.update(inproc_qps=in_qps, ratio=row["server_qps"] / in_qps, inproc_cpu_ms=in_cpu_ms,
                           cpu_ratio=in_cpu_ms / row["server_cpu_ms"] if row["server_cpu_ms"] > 0 else float("nan"))
                results.append(row)
                print(f"{r:>5} {row['clients']:>7} {batch:>5} {row['requests']:>5} {row['queries']:>7} "
                      f"{row['server_qps']:>10.1f} {row['p50_ms']:>8.1f} {row['p99_ms']:>8.1f} {in_qps:>11.1f} "
                      f"{row['ratio']:>6.2f} {row['server_cpu_ms']:>9.2f} {in_cpu_ms:>9.2f} {row['cpu_ratio']:>6.2f}", flush=True)
    if time.perf_counter() - t_start <= args.max_seconds:
        run_refusals(server.port, max(clients_list), counts)
        refusals = max(clients_list)
    else:
        refusals = 0
    crashed = server.stop()

    print("\nsummary per cell over rounds (server q/s min / median; ratio server / in-process median):")
    for batch in batch_list:
        for clients in clients_list:
            cell = [x for x in results if x["clients"] == clients and x["batch"] == batch]
            if cell:
                q = [x["server_qps"] for x in cell]
                print(f"  {clients:>3} clients x batch {batch:>3}: {min(q):8.1f} / {statistics.median(q):8.1f} q/s, "
                      f"p50 {statistics.median(x['p50_ms'] for x in cell):7.1f} ms, p99 "
                      f"{statistics.median(x['p99_ms'] for x in cell):7.1f} ms, in-process "
                      f"{statistics.median(x['inproc_qps'] for x in cell):8.1f} q/s, ratio "
                      f"{statistics.median(x['ratio'] for x in cell):.2f}; CPU ms/query server "
                      f"{statistics.median(x['server_cpu_ms'] for x in cell):.2f} vs in-process "
                      f"{statistics.median(x['inproc_cpu_ms'] for x in cell):.2f} (ratio "
                      f"{statistics.median(x['cpu_ratio'] for x in cell):.2f})")
    print(f"responses: {', '.join(f'{k} {v}' for k, v in sorted(counts.items()))} (the last {refusals} requests were "
          f"over the server's limits on purpose); cells skipped (--max-seconds, --max-cell-queries): {skipped}")
    print(f"server: peak RSS {server.peak_rss / 2**20:.0f} MiB (anonymous {server.peak_anon / 2**20:.0f} MiB), "
          f"{'CRASHED with exit ' + str(crashed) if crashed is not None else 'alive at the end'}; "
          f"wall {time.perf_counter() - t_start:.0f} s")
    big = [x["ratio"] for x in results if x["batch"] == max(batch_list)]
    if big:
        ok = statistics.median(big) >= 0.8 and counts.get("5xx", 0) == 0 and counts.get("conn", 0) == 0 and crashed is None
        print(f"acceptance (batch {max(batch_list)}: median ratio {statistics.median(big):.2f} >= 0.8, no 5xx, no "
              f"connection error, no crash): {'PASS' if ok else 'FAIL'}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "results": results, "counts": counts, "peak_rss": server.peak_rss,
                                         "peak_anon": server.peak_anon, "crashed": crashed}, indent=2))
    if tmp is not None and args.keep_index is None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
