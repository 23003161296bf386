"""Recall@k of the dense retriever next to BM25's, on the toy-search corpus and on HotpotQA's own paragraphs.

No pretrained encoder (e5-base-v2) can be downloaded in a closed environment, so the dense rows are what an honest
tiny encoder gets: the random tiny BERT of `models.tiny.save_tiny_encoder` (a floor), and the same encoder trained
for `--minutes` by `scripts/benchmarks/train_tiny_encoder.py` (in-batch negatives) on data that never contains an evaluation
question. Every dense index is FAISS Flat (exact), built and queried through `retrieval/dense.py`.

  * toy-search (the preset's world, seed 0): 3,400 passages. Queries: the gold searches of the 300 test questions
    (`Doka city`, and for two hops `Doka boss` then `Mipe city`), each with one gold passage (`Doka-city`).
    Training pairs: the gold searches of the 2,000 train questions (entities disjoint from the test ones).
  * hotpotqa: the 4,858 distinct paragraphs of the 500 IRCoT dev questions ($EMAPG_DATA_DIR/search/
    hotpotqa_dev_ircot500.jsonl); query = the question; recall@k = share of its gold (supporting) paragraphs in the
    top k, as tests/test_retrieval.py::test_hotpotqa_gold_recall. Training pairs come from the corpus alone
    (self-supervised, no question): (title -> paragraph) and (one random sentence -> its paragraph).

    python scripts/benchmarks/dense_recall.py --out dense-recall --minutes 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_tiny_encoder import build, train  # noqa: E402


def toy_search():
    """(corpus rows, training pairs, eval queries, gold id sets per query) of the toy-search world (seed 0)."""
    from emapg_cli.tasks.toy_search.prepare import N_TEST, N_TRAIN, SIZES
    from emapg_cli.tasks.toy_search.task import make_questions, make_world

    world = make_world(0, SIZES)
    corpus = world.corpus()
    text = {d["id"]: d["contents"] for d in corpus}
    gold = lambda q: "-".join(q.split())  # noqa: E731  `Doka city` -> passage id `Doka-city`
    train_q = sorted({q for e in make_questions(world, 0, "train", N_TRAIN) for q in e.meta["queries"]})
    test_q = [q for e in make_questions(world, 0, "test", N_TEST) for q in e.meta["queries"]]
    return corpus, [(q, text[gold(q)]) for q in train_q], test_q, [{gold(q)} for q in test_q]


def hotpotqa(src: Path):
    """(corpus rows, self-supervised training pairs from the corpus, questions, gold id sets per question)."""
    import re

    from emapg_cli.retrieval.base import title_of
    from emapg_cli.retrieval.corpus import hotpotqa_corpus, paragraph_contents

    corpus, _ = hotpotqa_corpus(src)
    by_text = {" ".join(d["contents"].split()): d["id"] for d in corpus}
    rng = random.Random(0)
    pairs = []
    for d in corpus:
        body = d["contents"].partition("\n")[2]
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", body) if len(s.split()) >= 4]
        pairs.append((title_of(d["contents"]), d["contents"]))
        if sentences:
            pairs.append((rng.choice(sentences), d["contents"]))
    rows = [json.loads(line) for line in open(src, encoding="utf-8")]
    gold = [{by_text[" ".join(paragraph_contents(c["title"].strip(), c["paragraph_text"]).split())]
             for c in x["contexts"] if c["is_supporting"]} for x in rows]
    return corpus, pairs, [x["question_text"] for x in rows], gold


def recall(retriever, queries: list[str], gold: list[set[str]], ks=(3, 10)) -> dict[int, float]:
    """Mean over queries of |gold ∩ top-k ids| / |gold|."""
    hits = []
    for s in range(0, len(queries), 256):
        hits += retriever.search(queries[s:s + 256], max(ks))
    return {k: sum(len(g & {h.id for h in hh[:k]}) / len(g) for g, hh in zip(gold, hits)) / len(gold) for k in ks}


def run_task(name: str, corpus, pairs, queries, gold, work: Path, minutes: float, max_length: int,
             vocab_size: int = 4000, batch_size: int = 64) -> list[tuple]:
    from emapg_cli.retrieval.bm25 import BM25Retriever, build_index
    from emapg_cli.retrieval.dense import DenseRetriever, build_dense_index

    work.mkdir(parents=True, exist_ok=True)
    path = work / "corpus.jsonl"
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in corpus), encoding="utf-8")
    rows = []
    build_index(path, work / "bm25")
    r = BM25Retriever.load(work / "bm25")
    rows.append((name, "bm25 (bm25s)", recall(r, queries, gold), "-"))
    print(rows[-1], flush=True)
    enc = build(work / "enc-random", [d["contents"] for d in corpus], vocab_size=vocab_size, hidden=64, layers=2, seed=0)
    for label, folder, note in (("dense, random init", enc, "-"), ("dense, trained", work / "enc-trained", None)):
        if note is None:
            shutil.copytree(enc, folder)
            stats = train(pairs, folder, minutes=minutes, max_length=max_length, batch_size=batch_size)
            note = f"vocab {vocab_size}, batch {batch_size}: {stats['steps']} steps, {stats['seconds']:.0f} s, loss {stats['loss']:.2f}"
        t0 = time.perf_counter()
        build_dense_index(path, work / f"idx-{folder.name}", str(folder), max_length=max_length, batch_size=128)
        r = DenseRetriever.load(work / f"idx-{folder.name}")
        rows.append((name, label, recall(r, queries, gold), f"{note}; index {time.perf_counter() - t0:.0f} s"))
        r.close()
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("dense-recall"), help="work folder (corpora, indexes, encoders)")
    ap.add_argument("--minutes", type=float, default=3.0, help="training time per task")
    ap.add_argument("--tasks", nargs="+", default=["toy-search", "hotpotqa"], choices=["toy-search", "hotpotqa"])
    ap.add_argument("--vocab-size", type=int, default=4000, help="the tiny encoder's WordPiece vocabulary (from the corpus)")
    ap.add_argument("--batch-size", type=int, default=64, help="training batch (in-batch negatives: batch - 1 per query)")
    ap.add_argument("--hotpotqa", type=Path, default=None, help="hotpotqa_dev_ircot500.jsonl (default: $EMAPG_DATA_DIR/search/)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    rows = []
    if "toy-search" in args.tasks:
        corpus, pairs, queries, gold = toy_search()
        print(f"toy-search: {len(corpus)} passages, {len(pairs)} training pairs, {len(queries)} test queries", flush=True)
        rows += run_task("toy-search", corpus, pairs, queries, gold, args.out / "toy-search", args.minutes, 32,
                         args.vocab_size, args.batch_size)
    if "hotpotqa" in args.tasks:
        src = args.hotpotqa or (Path(os.environ.get("EMAPG_DATA_DIR") or "missing").expanduser() / "search" / "hotpotqa_dev_ircot500.jsonl")
        corpus, pairs, queries, gold = hotpotqa(src)
        print(f"hotpotqa: {len(corpus)} passages, {len(pairs)} training pairs (from the corpus), {len(queries)} questions", flush=True)
        rows += run_task("hotpotqa", corpus, pairs, queries, gold, args.out / "hotpotqa", args.minutes, 128,
                         args.vocab_size, args.batch_size)
    print("\n| corpus | retriever | recall@3 | recall@10 | encoder |\n|---|---|---|---|---|")
    for name, label, rec, note in rows:
        print(f"| {name} | {label} | {rec[3]:.3f} | {rec[10]:.3f} | {note} |")


if __name__ == "__main__":
    main()
