"""The recall/speed trade-off of the dense index kinds (FAISS Flat, IVF, HNSW) on synthetic embeddings.

Vectors: `--rows` unit vectors of `--dim` dimensions with a low intrinsic dimension, as text embeddings have: a
32-dimensional latent in 1,000 Gaussian clusters (centre ~ N(0, I), point = centre + N(0, 0.5² I)), mapped by a
fixed random `dim` x 32 matrix, plus N(0, 0.05² I) ambient noise, L2-normalised; queries: `--queries` corpus
vectors' latents plus N(0, 0.3² I), mapped and normalised the same way. (Isotropic noise in all `dim` dimensions
instead makes a cluster's points nearly equidistant, so every approximate index "misses" near-ties.) Indexes are built with retrieval/dense.py's own `faiss_params` (defaults: nlist 4·sqrt(rows), pq_m dim/8,
HNSW M 32 and efConstruction 40), `new_index` and
`set_search_params` (what `emapg retriever index --dense --faiss ...` writes). For each kind and search setting:
recall@3 against Flat's exact top 3 (share of Flat's 3 ids found), recall@1 (Flat's first found first), milliseconds per query in batches of 256 (min
and median over `--rounds` rounds, kinds interleaved within each round: the machine is shared), build seconds and
index bytes.

    python scripts/benchmarks/dense_ann_tradeoff.py --rows 100000 --dim 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def data(rows: int, dim: int, queries: int, seed: int = 0, latent: int = 32):
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((latent, dim)).astype(np.float32) / latent ** 0.5  # [latent, dim]

    def embed(z):  # [n, latent] -> [n, dim], unit rows
        v = z @ mix + 0.05 * rng.standard_normal((len(z), dim)).astype(np.float32)
        return np.ascontiguousarray(v / np.linalg.norm(v, axis=1, keepdims=True), dtype=np.float32)

    centres = rng.standard_normal((1000, latent)).astype(np.float32)  # [1000, latent]
    z = centres[rng.integers(0, 1000, rows)] + 0.5 * rng.standard_normal((rows, latent)).astype(np.float32)  # [rows, latent]
    zq = z[rng.integers(0, rows, queries)] + 0.3 * rng.standard_normal((queries, latent)).astype(np.float32)
    return embed(z), embed(zq)


def main() -> None:
    import faiss

    from emapg_cli.retrieval.dense import faiss_params, new_index, set_search_params, train_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="faiss OpenMP threads")
    args = ap.parse_args()
    faiss.omp_set_num_threads(args.threads)
    x, q = data(args.rows, args.dim, args.queries)
    settings = [("flat", {}, {})]
    settings += [("ivf", {}, {"nprobe": p}) for p in (1, 8, 32, 128)]
    settings += [("ivfpq", {}, {"nprobe": p}) for p in (8, 32, 128)]
    settings += [("hnsw", {}, {"ef_search": e}) for e in (16, 64, 128, 256)]
    built = {}
    for kind in ("flat", "ivf", "ivfpq", "hnsw"):
        params = faiss_params(kind, args.rows, dim=args.dim)
        index = new_index(params, args.dim)
        t0 = time.perf_counter()
        if kind in ("ivf", "ivfpq"):
            sample = np.random.default_rng(0).choice(args.rows, size=train_size(args.rows, params["nlist"]), replace=False)
            index.train(x[np.sort(sample)])
        index.add(x)
        built[kind] = (index, params, time.perf_counter() - t0, faiss.serialize_index(index).nbytes)
        print(f"built {kind} {params} in {built[kind][2]:.1f} s, {built[kind][3] / 2**20:.0f} MiB", flush=True)
    exact = built["flat"][0].search(q, 3)[1]  # [queries, 3]
    times: dict[int, list[float]] = {i: [] for i in range(len(settings))}
    found: dict[int, float] = {}
    first: dict[int, float] = {}
    for _ in range(args.rounds):
        for i, (kind, _, search) in enumerate(settings):
            index, params, _, _ = built[kind]
            set_search_params(index, {**params, **search})
            t0 = time.perf_counter()
            ids = np.concatenate([index.search(q[s:s + 256], 3)[1] for s in range(0, len(q), 256)])  # [queries, 3]
            times[i].append((time.perf_counter() - t0) / len(q) * 1e3)
            found[i] = float(np.mean([len(set(a) & set(b)) / 3 for a, b in zip(exact, ids)]))
            first[i] = float(np.mean(exact[:, 0] == ids[:, 0]))
    print(f"\n{args.rows:,} x {args.dim} synthetic unit vectors, {args.queries} queries, {args.threads} faiss thread(s)\n")
    print("| index | setting | recall@3 vs Flat | recall@1 | ms/query (min / median) | build s | size MiB |\n|---|---|---|---|---|---|---|")
    for i, (kind, _, search) in enumerate(settings):
        _, params, build_s, size = built[kind]
        shown = ", ".join(f"{k} {v}" for k, v in {**params, **search}.items() if k != "kind") or "exact"
        print(f"| {kind} | {shown} | {found[i]:.3f} | {first[i]:.3f} | {min(times[i]):.3f} / {statistics.median(times[i]):.3f} | "
              f"{build_s:.1f} | {size / 2**20:.0f} |")


if __name__ == "__main__":
    main()
