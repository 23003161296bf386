"""A synthetic Wikipedia-like retrieval corpus in the FlashRAG / Search-R1 layout, for index scale tests.

wiki-18 (Search-R1's corpus, DPR's Wikipedia split) is 21M passages of 100 words: every article is cut into
100-word chunks, so most passages have exactly 100 words and each article's last one is shorter. This script
generates articles the same way:

* article length in words ~ lognormal (median 300, sigma 1.0, at least 20), cut into 100-word passages;
* words drawn from a Zipf law (rank r with probability ∝ r^-1.07) over `--vocab` word types: the top ranks are
  English function words (the, of, and, ...: about 40% of running text, as in English prose, removed later as
  stop words), the rest are pronounceable pseudo-words ("kabeto", "lirunavo"), shorter for frequent ranks;
* each article has a title (two or three capitalised pseudo-words) and 8 topic words that make up 10% of its
  text, so terms repeat within an article as they do in Wikipedia;
* each row is `{"id": "<row number>", "contents": "\\"Title\\"\\nTitle text..."}` (wiki-18's `contents`: the quoted
  title, a newline, then the passage, which in wiki-18 starts with the title again).

Deterministic by `--seed` (numpy PCG64), streamed to the output file (written to a temporary name, renamed at
the end), memory independent of `--passages`.

    python scripts/benchmarks/synthetic_corpus.py corpus-1e6.jsonl --passages 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

FUNCTION_WORDS = ("the of and in to was is for on as by with he at from his an that it which were are be or "
                  "has had this its their her not but have after she they been who one").split()
CONSONANTS, VOWELS = "bdfgklnprtvz", "aeiou"
SYLLABLES = [c + v for c in CONSONANTS for v in VOWELS]  # 60
ZIPF_S = 1.07
PASSAGE_WORDS = 100


def pseudo_word(i: int) -> str:
    """The i-th pseudo-word (i >= 0): i written in base 60 with at least two digits, one syllable per digit."""
    digits = []
    i += len(SYLLABLES)  # at least two syllables: never a two-letter word such as "to" or "be"
    while i:
        i, d = divmod(i, len(SYLLABLES))
        digits.append(SYLLABLES[d])
    return "".join(reversed(digits))


def vocabulary(n_types: int) -> list[str]:
    """Rank order: the function words, then pseudo-words (the lower the rank, the shorter)."""
    return FUNCTION_WORDS + [pseudo_word(i) for i in range(n_types - len(FUNCTION_WORDS))]


def zipf_cdf(n_types: int) -> np.ndarray:
    p = np.arange(1, n_types + 1, dtype=np.float64) ** -ZIPF_S
    return np.cumsum(p / p.sum())


def passages(n: int, seed: int = 0, n_types: int = 300_000):
    """Yield `n` rows `{"id", "contents"}` (module doc)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    words = vocabulary(n_types)
    cdf = zipf_cdf(n_types)
    first_content = len(FUNCTION_WORDS)
    row = 0
    while row < n:
        length = max(20, int(rng.lognormal(np.log(300), 1.0)))
        ranks = np.minimum(np.searchsorted(cdf, rng.random(length)), n_types - 1)  # [length]
        topic = rng.integers(first_content + 500, min(n_types, first_content + 50_000), size=8)  # mid-frequency terms
        mask = rng.random(length) < 0.10
        ranks[mask] = topic[rng.integers(0, 8, size=int(mask.sum()))]
        title_ranks = rng.integers(first_content, n_types, size=int(rng.integers(2, 4)))
        title = " ".join(words[r].capitalize() for r in title_ranks)
        text = [words[r] for r in ranks.tolist()]
        for start in range(0, length, PASSAGE_WORDS):
            if row == n:
                return
            body = " ".join(text[start:start + PASSAGE_WORDS])
            yield {"id": str(row), "contents": f'"{title}"\n{title} {body}' if start == 0 else f'"{title}"\n{body}'}
            row += 1


def write_corpus(path: Path, n: int, seed: int = 0, n_types: int = 300_000) -> dict:
    """Write the corpus to `path` (atomically); returns {"passages", "bytes", "seconds"}."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    t0 = time.perf_counter()
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            buf = []
            for r in passages(n, seed, n_types):
                buf.append(json.dumps(r) + "\n")
                if len(buf) == 10_000:
                    f.write("".join(buf))
                    buf = []
            f.write("".join(buf))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return {"passages": n, "bytes": path.stat().st_size, "seconds": round(time.perf_counter() - t0, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="Output JSONL file.")
    ap.add_argument("--passages", type=int, default=100_000, help="Number of passages (rows).")
    ap.add_argument("--seed", type=int, default=0, help="Random seed (the same seed gives the same file).")
    ap.add_argument("--vocab", type=int, default=300_000, help="Word types of the Zipf law (function words included).")
    args = ap.parse_args(argv)
    if args.passages < 1 or args.vocab <= len(FUNCTION_WORDS) + 50_000:
        ap.error(f"--passages must be >= 1 and --vocab > {len(FUNCTION_WORDS) + 50_000}")
    print(json.dumps(write_corpus(args.out, args.passages, args.seed, args.vocab)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
