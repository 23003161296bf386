"""Every dataset `emapg prepare NAME` knows: one YAML card per dataset in the top-level `data/` folder.

A card says where the dataset lives (hub id, config, split, revision), how to read a row (field
mapping, answer format), how many rows it should have, and its licence. The file name is the
dataset's name; adding a dataset is adding a card (`data/README.md` lists the keys).

`source.revision: null` means the hub's default branch; the commit actually downloaded is resolved
and written to the manifest, so a prepared dataset always records exactly what it came from.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from emapg_cli.errors import UserError
from emapg_cli.paths import shipped_dir

#: How a row holds its final answer: the answer itself (string, number or list of aliases, any one
#: correct), a worked solution whose last \boxed{} is the answer, or an open-domain QA layout whose
#: gold aliases all become accepted answers (`qa.py`: FlashRAG, Search-R1, HotpotQA, IRCoT, 2Wiki, MuSiQue, PopQA).
AnswerFormat = Literal["answer", "boxed_solution", "qa_aliases"]


class Fields(BaseModel):
    """Source column names; None means: detect from the common names (see `convert.py`).

    A dotted path reads a nested value: `answers_objects.0.spans` is row["answers_objects"][0]["spans"].
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    question: Optional[str] = Field(None, description="Column holding the question.")
    answer: Optional[str] = Field(None, description="Column holding the answer (or aliases, or the worked solution).")
    id: Optional[str] = Field(None, description="Column holding the row id (else a common name, else the row index).")
    context: Optional[str] = Field(None, description="Text prepended to the question when present.")
    subset: Optional[str] = Field(None, description="Per-subset breakdown in `emapg eval` (stored as meta.subset).")
    tolerance: Optional[str] = Field(None, description="Absolute error tolerance of the answer (meta.tolerance).")


class Source(BaseModel):
    """Where the dataset comes from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hub: Optional[str] = Field(None, description="Hugging Face dataset id; None: only `prepare NAME --from FILE`.")
    config: Optional[str] = Field(None, description="Hub configuration (subset) name.")
    split: str = Field("", description="Hub split.")
    revision: Optional[str] = Field(None, description="Hub commit or branch; None: the default branch (resolved in the manifest).")
    url: Optional[str] = Field(None, description="Where the canonical file is published (provenance only; never downloaded).")


class DatasetSpec(BaseModel):
    """One dataset card (`data/NAME.yaml`); `name` comes from the file name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The dataset's name: its card's file name without .yaml.")
    role: Literal["train", "eval", "custom"] = Field(description="train or eval; `custom` for an unregistered --from file.")
    description: str = Field("", description="One line shown by `emapg prepare --list`.")
    licence: str = Field("", description="The licence as the source states it (or that it states none).")
    source: Source = Field(default_factory=Source, description="Where the dataset comes from.")
    fields: Fields = Field(default_factory=Fields, description="Source column names (None: detect).")
    answer_format: AnswerFormat = Field("answer", description="answer | boxed_solution | qa_aliases.")
    expected_rows: Optional[int] = Field(None, ge=1, description="Rows a faithful conversion writes; prepare warns on a different count.")

    @property
    def hub_id(self) -> str:
        return self.source.hub or ""

    @property
    def split(self) -> str:
        return self.source.split

    @property
    def config(self) -> Optional[str]:
        return self.source.config

    @property
    def revision(self) -> Optional[str]:
        return self.source.revision


def cards_dir() -> Path:
    """The folder of dataset cards (`data/` in a checkout, `emapg_cli/dataset_cards` in the wheel)."""
    return shipped_dir("data")


def read_card(path: Path) -> DatasetSpec:
    """Validate one card; any problem is a one-line UserError naming the file."""
    from emapg_cli.fileio import read_yaml_mapping

    raw = read_yaml_mapping(path, "dataset card")
    if "name" in raw:
        raise UserError(f"dataset card {path}: remove 'name' (a card's name is its file name)")
    try:
        card = DatasetSpec.model_validate({"name": path.stem, **raw})
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        raise UserError(f"dataset card {path}: {where}: {e['msg']}") from None
    if card.role == "custom":
        raise UserError(f"dataset card {path}: role must be train or eval")
    return card


@lru_cache(maxsize=None)
def _cards(folder: str) -> dict[str, DatasetSpec]:
    return {p.stem: read_card(p) for p in sorted(Path(folder).glob("*.yaml"))}


def datasets() -> dict[str, DatasetSpec]:
    """All registered datasets by name (the cards, read once)."""
    return _cards(str(cards_dir()))


def get_spec(name: str) -> DatasetSpec:
    """The registered dataset `name`; an unknown name is a UserError listing the known ones."""
    known = datasets()
    if name not in known:
        raise UserError(f"unknown dataset '{name}' (known: {', '.join(known)}; or pass --from FILE)")
    return known[name]


def card_for_file(path: Path) -> DatasetSpec:
    """The card whose name starts `path`'s file name (longest match, then `_`, `-`, `.` or the end):
    `olympiadbench_test.jsonl` -> olympiadbench. Else an unregistered card named after the file."""
    stem = Path(path).name
    for name in sorted(datasets(), key=len, reverse=True):
        if stem.startswith(name) and (len(stem) == len(name) or stem[len(name)] in "_-."):
            return datasets()[name]
    return custom_spec(Path(path).stem)


def custom_spec(name: str) -> DatasetSpec:
    """The card of an unregistered dataset converted from a local file (all fields detected)."""
    return DatasetSpec(name=name, role="custom")
