"""`emapg prepare`: build a canonical dataset (hub or local file), a built-in task, or a decontamination report."""

from __future__ import annotations

import contextlib
from pathlib import Path
from pkgutil import resolve_name  # a task's declared prepare step, `module:function`
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from emapg_cli.cli.common import console, counting_bar, err_console
from emapg_cli.errors import UserError
from emapg_cli.outputs import claim_folder, claim_prepare
from emapg_cli.tasks import REASONING_GYM, get_task


def _prepare_hotpotqa_corpus(from_file: Optional[Path], out: Optional[Path]) -> None:
    """HotpotQA-style context paragraphs -> a retrieval corpus (corpus.jsonl + manifest.json)."""
    import json

    from emapg_cli.data.schema import write_jsonl
    from emapg_cli.paths import emapg_home, write_text_atomic
    from emapg_cli.fileio import sha256_file
    from emapg_cli.retrieval.corpus import hotpotqa_corpus

    if from_file is None:
        raise UserError("hotpotqa-corpus needs --from FILE (HotpotQA JSONL rows with their context paragraphs)")
    out_dir = out or emapg_home() / "data" / "hotpotqa-corpus"
    docs, dups = hotpotqa_corpus(from_file)
    path = out_dir / "corpus.jsonl"
    with claim_prepare(out_dir, "hotpotqa-corpus"):
        write_jsonl(path, docs)
        manifest = {"name": "hotpotqa-corpus", "source": str(from_file), "source_sha256": sha256_file(from_file),
                    "rows": len(docs), "duplicates_dropped": dups, "sha256": sha256_file(path)}
        write_text_atomic(out_dir / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    console.print(f"{len(docs):,} paragraphs ({dups:,} duplicates dropped) -> {path}", markup=False, highlight=False)
    console.print(f"next: emapg retriever index {path} --out DIR", markup=False, highlight=False)


def _prepare_reasoning_gym(name: str, size: Optional[int], seed: int, task_config: Optional[str], out: Optional[Path]) -> None:
    from emapg_cli.datasets.prepare import dataset_dir
    from emapg_cli.datasets.reasoning_gym_data import DEFAULT_SIZE, parse_reference

    parse_reference(name)  # an unknown task: one line before any folder is made
    out_dir = dataset_dir(name, out)
    with claim_prepare(out_dir, name):
        manifest = resolve_name(REASONING_GYM.prepare)(name, size or DEFAULT_SIZE, seed, task_config, out_dir)
    _show_manifest(out_dir, manifest)
    console.print(f"train on it with rollout.reward={REASONING_GYM.reward} (data.train: {escape(str(out_dir))})", highlight=False)


def _show_manifest(out_dir: Path, manifest: dict) -> None:
    # every string from the data or the user is escaped: `[/bold]` in an id is text, not Rich markup
    table = Table(title=escape(f"prepared {manifest['name']}"), show_header=False)
    table.add_row("folder", escape(str(out_dir)))
    table.add_row("source", escape(f"{manifest['source']}" + (f" @ {manifest['revision']}" if manifest.get("revision") else "")))
    expected = manifest.get("expected_rows")
    note = f" (expected {expected})" if expected and expected != manifest["rows"] else ""
    table.add_row("rows", f"{manifest['rows']}{note}")
    table.add_row("dropped", escape(", ".join(f"{k}: {v}" for k, v in manifest["dropped_by_reason"].items()) or "0"))
    for d in manifest["dropped_rows"][:5]:
        table.add_row("", escape(f"row {d['index']} (id {d['id']}): {d['reason']}"))
    if manifest["dropped"] > 5:
        table.add_row("", f"... all {manifest['dropped']} in manifest.json")
    table.add_row("sha256", manifest["sha256"])
    console.print(table)
    if note:
        err_console.print(
            f"[yellow]warning:[/] wrote {manifest['rows']} rows but the dataset card of '{manifest['name']}' expects {expected}: "
            "a different copy, version or split of the dataset? (results will not be comparable)", markup=True, highlight=False)


def _decontaminate(names: list[str], ngram: int, remove: bool) -> None:
    from emapg_cli.datasets.prepare import dataset_dir, decontaminate

    if len(names) < 2:
        raise UserError("--decontaminate needs a training set and at least one evaluation set: TRAIN EVAL...")

    # --remove rewrites the prepared training set: hold its folder (a prepared dataset) while doing so;
    # anything else (a file path, a name never prepared) is refused by decontaminate itself
    folder = dataset_dir(names[0]) if remove and "/" not in names[0] and not names[0].startswith(".") else None
    claim = claim_folder(folder, "prepare") if folder is not None and folder.is_dir() else contextlib.nullcontext()
    with claim:
        overlaps, rewritten = decontaminate(names[0], names[1:], n=ngram, remove=remove)
    table = Table(title=escape(f"{names[0]} vs {', '.join(names[1:])}: {len(overlaps)} overlapping training items"))
    for col in ("train id", "eval set", "eval id", "match"):
        table.add_column(col)
    for o in overlaps[:50]:
        table.add_row(*(escape(x) for x in (o.train_id, o.eval_set, o.eval_id, o.kind)))
    console.print(table)
    if len(overlaps) > 50:
        console.print(f"... {len(overlaps) - 50} more")
    if rewritten is not None:
        console.print(escape(f"removed {len(overlaps)} items from {rewritten / 'data.jsonl'} (recorded in its manifest)"))
    elif overlaps and not remove:
        console.print("pass --remove to drop them from the training set")


def prepare(
    names: Annotated[Optional[list[str]], typer.Argument(metavar="NAME [EVAL...]", help="Dataset to prepare (a registered name, or any name with --from; `hotpotqa-corpus --from FILE` turns HotpotQA context paragraphs into a retrieval corpus); with --decontaminate: TRAIN EVAL...")] = None,
    from_file: Annotated[Optional[Path], typer.Option("--from", help="Convert this local .json / .jsonl / .parquet file instead of downloading.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Output folder (default: $EMAPG_HOME/data/NAME).")] = None,
    preset: Annotated[Optional[str], typer.Option("--preset", help="Prepare a built-in task instead of a dataset (`toy`: the addition task and its warm-started model; `toy-search`: the toy search task, its corpus, BM25 index and warm-started model; `toy-tools`: the multiplication task with a calculator and its warm-started model; `toy-distill`: the addition task with a teacher and a weaker student; `smol`: SmolLM2-135M-Instruct and easy reasoning-gym tasks, docs/smol.md).")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of generated tasks (--preset toy | toy-search | toy-tools | toy-distill; reasoning-gym:TASK).")] = 0,
    size: Annotated[Optional[int], typer.Option("--size", min=1, help="reasoning-gym:TASK[,TASK...] only: rows per task (default 500; each task's reasoning_gym.create_dataset(TASK, size=N, seed=S)).")] = None,
    task_config: Annotated[Optional[str], typer.Option("--task-config", metavar="JSON", help="reasoning-gym:TASK[,TASK...] only: the task's config arguments as a JSON object, e.g. '{\"min_terms\": 2, \"max_terms\": 2}'; with several tasks {\"TASK\": {...}, ...}.")] = None,
    decontaminate: Annotated[bool, typer.Option("--decontaminate", help="Report training items (first NAME) that overlap the evaluation sets (the other NAMEs).")] = False,
    remove: Annotated[bool, typer.Option("--remove", help="With --decontaminate: also drop the overlapping items from the prepared training set.")] = False,
    ngram: Annotated[int, typer.Option("--ngram", min=1, help="With --decontaminate: word n-gram length of a partial match.")] = 13,
    list_: Annotated[bool, typer.Option("--list", help="List the registered datasets and exit.")] = False,
) -> None:
    """Prepare a dataset in the canonical schema {id, question, answers, source, meta} with a manifest."""
    names = names or []
    if list_:
        from emapg_cli.datasets import datasets
        from emapg_cli.datasets.registry import cards_dir

        table = Table(title=f"registered datasets (cards in {cards_dir()})")
        for col in ("name", "role", "source", "rows", "licence", "description"):
            table.add_column(col)
        for s in datasets().values():
            src = (s.hub_id or "local file (--from)") + (f" ({s.config})" if s.config else "") + (f", split {s.split}" if s.split else "")
            table.add_row(*(escape(x) for x in (s.name, s.role, src, str(s.expected_rows or "?"), s.licence, s.description)))
        console.print(table)
        return
    if preset is not None:
        task = get_task(preset)
        if names or from_file:
            raise UserError(f"--preset {preset} takes no NAME or --from")
        from emapg_cli.hf_quiet import quiet_transformers
        from emapg_cli.paths import emapg_home

        quiet_transformers()  # every task saves and loads models: transformers' own bars stay out of the output
        title, m, rows = resolve_name(task.prepare)(emapg_home(), seed, lambda line: console.print(line, markup=False, highlight=False))
        table = Table(title=title, show_header=False)  # the folder, row counts, then the task's own rows
        for label, value in [("folder", escape(str(emapg_home() / task.name))),
                             ("rows", ", ".join(f"{split} {n}" for split, n in m["rows"].items())), *rows]:
            table.add_row(label, value)
        console.print(table)
        console.print(f"next: emapg train --preset {task.name}")
        return
    if decontaminate:
        _decontaminate(names, ngram, remove)
        return
    if remove:
        raise UserError("--remove only applies with --decontaminate")
    if len(names) != 1:
        raise UserError("give exactly one dataset NAME (see `emapg prepare --list`)")
    if names[0].startswith(REASONING_GYM.name):
        if from_file is not None:
            raise UserError("reasoning-gym tasks are generated: --from does not apply")
        _prepare_reasoning_gym(names[0], size, seed, task_config, out)
        return
    if size is not None or task_config is not None:
        raise UserError("--size and --task-config only apply to reasoning-gym:TASK[,TASK...]")
    if names[0] == "hotpotqa-corpus":
        _prepare_hotpotqa_corpus(from_file, out)
        return
    from emapg_cli.datasets.prepare import dataset_dir, prepare_dataset

    bar, start = counting_bar(f"converting {names[0]}")  # counting_bar escapes its label
    with claim_prepare(dataset_dir(names[0], out), names[0]), bar:
        out_dir, manifest = prepare_dataset(names[0], from_file, out, progress=start)
    _show_manifest(out_dir, manifest)
