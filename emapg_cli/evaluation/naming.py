"""What `emapg eval` evaluates by default: the built-in toy benches, and the default output folder."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from emapg_cli.paths import emapg_home
from emapg_cli.tasks import TASKS

#: Built-in benches written by `emapg prepare --preset NAME` (the tasks' declared `bench`): name -> file under $EMAPG_HOME.
BUILTIN_BENCHES = {t.name: f"{t.name}/{t.bench}" for t in TASKS.values() if t.bench}


def bench_ref(bench: str) -> str:
    """The data reference of `--bench`: a built-in bench's test file (unless a dataset was prepared
    under that name with `emapg prepare NAME`), else `bench` itself."""
    if bench in BUILTIN_BENCHES and not (emapg_home() / "data" / bench / "data.jsonl").is_file():
        return str(emapg_home() / BUILTIN_BENCHES[bench])
    return bench


def model_tag(model: str) -> str:
    """A short name of a model folder that tells runs apart: `runs/toy-1/final/policy` -> `toy-1`,
    `runs/toy-1/final/anchor` -> `toy-1-anchor`, `runs/toy-1/checkpoints/step_50/policy` -> `toy-1-step_50`;
    `$EMAPG_HOME/smol/model` (a prepared model folder) -> `smol`; any other folder (or hub id) -> its last component."""
    parts = Path(model.rstrip("/")).parts
    if len(parts) >= 3 and parts[-2] == "final" and parts[-1] in ("policy", "anchor"):
        return parts[-3] + ("" if parts[-1] == "policy" else "-anchor")
    if len(parts) >= 4 and parts[-3] == "checkpoints" and parts[-1] in ("policy", "anchor"):
        return f"{parts[-4]}-{parts[-2]}" + ("" if parts[-1] == "policy" else "-anchor")
    if len(parts) >= 2 and parts[-1] == "model":
        return parts[-2]
    return parts[-1] if parts else "model"


def bench_name(bench: str) -> str:
    """The bench's short name: `olympiadbench`, `toy`; a file -> its stem, or its folder's name for a `test.jsonl` or
    `data.jsonl` (`$EMAPG_HOME/smol/test.jsonl` -> `smol`); a folder -> its name."""
    path = Path(bench.rstrip("/"))
    return path.parent.name if path.stem in ("test", "data") and path.parent.name else path.stem or bench


def default_out(bench: str, model: Optional[str], responses: Optional[Path]) -> Path:
    """runs/eval/<bench>-<model tag> (or -<responses file stem>); the tag alone when it already starts with the bench's
    name (bench `toy`, run `toy-20260101-120000`: `runs/eval/toy-20260101-120000`, not `toy-toy-...`)."""
    tag, name = model_tag(model) if model else Path(responses).stem, bench_name(bench)  # type: ignore[arg-type]
    return Path("runs") / "eval" / (tag if tag == name or tag.startswith(f"{name}-") else f"{name}-{tag}")
