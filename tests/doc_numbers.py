"""Numbers in the docs that the code computes, generated from the code so they cannot drift.

A doc holds each generated block between two marker lines,

    <!-- BEGIN generated:NAME (python tests/doc_numbers.py --write) -->
    ...
    <!-- END generated:NAME -->

and `GENERATORS[NAME]` writes what goes between them. `tests/test_doc_numbers.py` regenerates every block and
fails when a doc differs from the code; after a change to the code, `python tests/doc_numbers.py --write` updates
the docs (and `python tests/doc_numbers.py` alone prints what differs).

    python tests/doc_numbers.py            # check: exit 1 and name the stale blocks
    python tests/doc_numbers.py --write    # rewrite the blocks in place
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 2**30


def _gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.1f}"


def dry_run_olympiad() -> str:
    """`emapg train --preset olympiad --dry-run` (make_plan, one 80 GiB device unless said): T, the update and rollout
    peaks and the largest micro_batch_size that fits, for the 8k stage and the full length, with and without master
    weights, and per GPU on 8 GPUs."""
    from emapg_cli.config import load_config
    from emapg_cli.train.plan import make_plan

    stage_8k = ["data.max_prompt_tokens=1024", "rollout.max_new_tokens=8192"]
    rows = [  # (what, --set overrides, processes)
        ("8k stage, master weights", stage_8k, 1),
        ("8k stage, `model.master_weights=false`", [*stage_8k, "model.master_weights=false"], 1),
        ("full length, master weights", [], 1),
        ("full length, `model.master_weights=false`", ["model.master_weights=false"], 1),
        ("8k stage, 8 GPUs, `train.parallel=fsdp`, master weights", [*stage_8k, "train.parallel=fsdp"], 8),
        ("8k stage, 8 GPUs, fsdp, `model.master_weights=false`", [*stage_8k, "train.parallel=fsdp", "model.master_weights=false"], 8),
        ("8k stage, 8 GPUs, `train.parallel=ddp`, master weights", [*stage_8k, "train.parallel=ddp"], 8),
    ]
    out = ["| olympiad preset (`--set ...`, `--processes`) | T | update peak (GiB per GPU) | rollout peak (GiB) | largest `micro_batch_size` that fits |",
           "|---|---:|---:|---:|---:|"]
    for what, overrides, processes in rows:
        plan = make_plan(load_config("olympiad", None, overrides), None, processes=processes)
        out.append(f"| {what} | {plan.seq_len:,} | {_gib(plan.update_peak_bytes)} | {_gib(plan.rollout_peak_bytes)} | "
                   f"{plan.max_micro_batch_fit if plan.max_micro_batch_fit is not None else '-'} |")
    return "\n".join(out)


def auto_threads_table() -> str:
    """`train.threads.auto_threads`: the torch threads `emapg train` and `emapg eval` choose on CPU when nothing is
    set (EMAPG_TORCH_THREADS, train.torch_threads, OMP_NUM_THREADS), for a few machines."""
    from emapg_cli.train.threads import auto_threads

    cases = [(2, 1, 0.0), (2, 1, 0.3), (2, 1, 1.0), (2, 1, 2.0), (8, 1, 0.0), (8, 1, 3.0), (8, 2, 0.0), (8, 2, 5.0)]
    out = ["| cores | processes on the machine | cores busy as the run starts | torch threads each |", "|---:|---:|---:|---:|"]
    out += [f"| {c} | {p} | {load:.1f} | {auto_threads(c, p, load)} |" for c, p, load in cases]
    return "\n".join(out)


#: name -> (the doc that holds the block, the function that writes it)
GENERATORS: dict[str, tuple[str, Callable[[], str]]] = {
    "dry-run-olympiad": ("docs/dry_run.md", dry_run_olympiad),
    "auto-threads": ("docs/toy.md", auto_threads_table),
}


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- BEGIN generated:{re.escape(name)}[^\n]*-->\n)(.*?)(<!-- END generated:{re.escape(name)} -->)", re.S)


def stale(write: bool = False) -> list[str]:
    """The blocks whose text differs from what the code generates (rewritten in place with `write`)."""
    bad = []
    for name, (doc, generate) in GENERATORS.items():
        path = ROOT / doc
        text = path.read_text()
        match = _pattern(name).search(text)
        if match is None:
            bad.append(f"{doc}: no block generated:{name}")
            continue
        body = generate().rstrip("\n") + "\n"
        if match.group(2) != body:
            bad.append(f"{doc}: block generated:{name} differs from the code")
            if write:
                tmp = path.with_name(path.name + ".tmp-doc-numbers")
                tmp.write_text(text[: match.start(2)] + body + text[match.end(2):])
                tmp.replace(path)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale blocks in place")
    args = parser.parse_args()
    bad = stale(write=args.write)
    for line in bad:
        print(("updated " if args.write else "stale: ") + line)
    return 0 if args.write or not bad else 1


if __name__ == "__main__":
    sys.exit(main())
