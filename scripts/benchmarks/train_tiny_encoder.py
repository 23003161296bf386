"""Train a tiny dual encoder (one shared BERT, e5-style) on (query, passage) pairs with in-batch negatives.

No pretrained encoder can be downloaded in a closed environment; this gives the dense retriever an honest small
encoder to be measured with (`scripts/benchmarks/dense_recall.py`). The model is `models.tiny.save_tiny_encoder` (a random
BERT and a WordPiece vocabulary of the corpus's characters and most frequent words); training follows e5/DPR:
queries encoded as "query: " + q, passages as "passage: " + p, mean pooling, L2 normalisation, and the InfoNCE loss
over a batch of distinct passages

    L = -1/B * sum_i log softmax_j(q_i . p_j / tau)_i,   tau = 0.05,

each query's positive its own passage, the other B-1 passages of the batch its negatives (DPR's in-batch negatives).
AdamW, constant learning rate, for `--minutes` of wall time or `--steps` steps, whichever ends first. The saved
folder loads with `emapg retriever index CORPUS --out DIR --dense FOLDER`.

    python scripts/benchmarks/train_tiny_encoder.py --pairs pairs.jsonl --corpus corpus.jsonl --out enc --minutes 3

pairs.jsonl: one {"query", "passage"} per line (the passage's text as in the corpus).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

QUERY_PREFIX, PASSAGE_PREFIX = "query: ", "passage: "


def build(out: Path, texts: list[str], vocab_size: int, hidden: int, layers: int, seed: int) -> Path:
    """The random tiny encoder (the 'random init' floor of dense_recall.py, and the start of training)."""
    from emapg_cli.models.tiny import save_tiny_encoder

    return save_tiny_encoder(out, [*texts, QUERY_PREFIX, PASSAGE_PREFIX], vocab_size=vocab_size, hidden=hidden,
                             layers=layers, heads=max(1, hidden // 32), max_positions=256, seed=seed)


def embed(model, tok, texts: list[str], max_length: int):
    """Mean-pooled, L2-normalised embeddings [B, hidden] (as the dense retriever encodes)."""
    import torch.nn.functional as F

    batch = tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    hidden = model(**batch).last_hidden_state  # [B, T, H]
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)  # [B, H]


def train(pairs: list[tuple[str, str]], folder: Path, *, minutes: float = 3.0, steps: int = 100000, batch_size: int = 64,
          lr: float = 5e-4, tau: float = 0.05, max_length: int = 128, seed: int = 0, log=print) -> dict:
    """Train the encoder saved in `folder` in place on `pairs`; returns {"steps", "seconds", "loss"} (last 20 steps' mean)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, tok = AutoModel.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    by_passage: dict[str, list[str]] = {}
    for q, p in pairs:
        by_passage.setdefault(p, []).append(q)
    passages = sorted(by_passage)
    t0, step, losses = time.perf_counter(), 0, []
    while step < steps and time.perf_counter() - t0 < minutes * 60:
        batch = rng.sample(passages, min(batch_size, len(passages)))  # distinct passages: no false negatives
        queries = [rng.choice(by_passage[p]) for p in batch]
        q = embed(model, tok, [QUERY_PREFIX + x for x in queries], max_length)  # [B, H]
        p = embed(model, tok, [PASSAGE_PREFIX + x for x in batch], max_length)  # [B, H]
        loss = torch.nn.functional.cross_entropy(q @ p.T / tau, torch.arange(len(batch)))  # InfoNCE, in-batch negatives
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        losses = (losses + [loss.item()])[-20:]
        if step % 50 == 0:
            log(f"  step {step}  loss {sum(losses) / len(losses):.3f}  {time.perf_counter() - t0:.0f} s")
    model.eval()
    model.save_pretrained(folder)
    return {"steps": step, "seconds": time.perf_counter() - t0, "loss": sum(losses) / max(1, len(losses))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=Path, required=True, help="JSONL of {query, passage}")
    ap.add_argument("--corpus", type=Path, required=True, help="the corpus (JSONL {id, contents}): the vocabulary's texts")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--vocab-size", type=int, default=4000)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    texts = [json.loads(line)["contents"] for line in open(args.corpus, encoding="utf-8")]
    pairs = [(r["query"], r["passage"]) for r in map(json.loads, open(args.pairs, encoding="utf-8"))]
    build(args.out, texts, args.vocab_size, args.hidden, args.layers, args.seed)
    print(train(pairs, args.out, minutes=args.minutes, steps=args.steps, batch_size=args.batch_size, seed=args.seed))


if __name__ == "__main__":
    main()
