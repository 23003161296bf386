"""Every dataset `emapg prepare NAME` knows, described once: where it lives and how to read it.

`revision: None` means the hub's default branch; the commit actually downloaded is resolved and
written to the manifest, so a prepared dataset always records exactly what it came from. Pin a
commit here (or prepare from a local file) for a reproducible build.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from emapg_cli.errors import UserError

#: How a row holds its final answer: the answer itself (string, number or list of alternatives),
#: a worked solution whose last \boxed{} is the answer, or an open-domain QA layout whose gold
#: aliases all become accepted answers (`qa.py`: FlashRAG, Search-R1, HotpotQA, IRCoT, 2Wiki, MuSiQue).
AnswerFormat = Literal["answer", "boxed_solution", "qa_aliases"]

#: The FlashRAG collection every search benchmark below is published in (one config per dataset).
FLASHRAG = "RUC-NLPIR/FlashRAG_datasets"


@dataclass(frozen=True)
class Fields:
    """Source column names; None means: detect from the common names (see `convert.py`)."""

    question: Optional[str] = None
    answer: Optional[str] = None
    id: Optional[str] = None
    context: Optional[str] = None  # text prepended to the question when present
    subset: Optional[str] = None  # per-subset breakdown in `emapg eval` (stored as meta.subset)
    tolerance: Optional[str] = None  # absolute error tolerance of the answer (meta.tolerance)


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: hub source, split, field mapping and answer format."""

    name: str
    role: Literal["train", "eval", "custom"]
    hub_id: str
    split: str
    config: Optional[str] = None
    revision: Optional[str] = None
    fields: Fields = field(default_factory=Fields)
    answer_format: AnswerFormat = "answer"
    expected_rows: Optional[int] = None  # a different count is reported in the manifest
    description: str = ""


DATASETS: dict[str, DatasetSpec] = {
    s.name: s
    for s in [
        DatasetSpec(
            "deepscaler", "train", "agentica-org/DeepScaleR-Preview-Dataset", "train",
            expected_rows=40315,
            description="DeepScaleR-Preview: AIME/AMC/Omni-MATH/STILL problems with final answers (the paper's training set).",
        ),
        DatasetSpec(
            "math", "train", "DigitalLearningGmbH/MATH-lighteval", "train", config="default",
            fields=Fields(answer="solution", subset="type"), answer_format="boxed_solution",
            expected_rows=7500,
            description="MATH training split (Hendrycks et al. 2021); the answer is the solution's last \\boxed{}.",
        ),
        DatasetSpec(
            "olympiadbench", "eval", "Hothan/OlympiadBench", "train", config="OE_TO_maths_en_COMP",
            fields=Fields(answer="final_answer", context="context", subset="subfield", tolerance="error"),
            expected_rows=675,
            description="OlympiadBench, text-only English open-ended competition maths.",
        ),
        DatasetSpec(
            "aime24", "eval", "HuggingFaceH4/aime_2024", "train", expected_rows=30,
            description="AIME 2024 (I and II).",
        ),
        DatasetSpec(
            "aime25", "eval", "math-ai/aime25", "test", expected_rows=30,
            description="AIME 2025 (I and II).",
        ),
        DatasetSpec(
            "amc23", "eval", "math-ai/amc23", "test", expected_rows=40,
            description="AMC 2023.",
        ),
        DatasetSpec(
            "math500", "eval", "HuggingFaceH4/MATH-500", "test",
            fields=Fields(answer="answer", subset="subject"), expected_rows=500,
            description="MATH-500, the PRM800K subset of the MATH test split.",
        ),
        DatasetSpec(
            "minerva", "eval", "math-ai/minervamath", "test", expected_rows=272,
            description="Minerva Math (OCWCourses): undergraduate science and maths problems.",
        ),
        # Search QA (the paper's seven test sets, as Search-R1 builds them: FlashRAG `test`, else `dev`)
        DatasetSpec(
            "nq", "eval", FLASHRAG, "test", config="nq", answer_format="qa_aliases", expected_rows=3610,
            description="Natural Questions (open), single-hop; every gold alias accepted.",
        ),
        DatasetSpec(
            "triviaqa", "eval", FLASHRAG, "test", config="triviaqa", answer_format="qa_aliases", expected_rows=11313,
            description="TriviaQA, single-hop trivia with many aliases per answer.",
        ),
        DatasetSpec(
            "popqa", "eval", FLASHRAG, "test", config="popqa", answer_format="qa_aliases", expected_rows=14267,
            description="PopQA, single-hop questions about long-tail entities.",
        ),
        DatasetSpec(
            "hotpotqa", "eval", FLASHRAG, "dev", config="hotpotqa", answer_format="qa_aliases", expected_rows=7405,
            description="HotpotQA dev, multi-hop (bridge and comparison questions).",
        ),
        DatasetSpec(
            "2wikimultihopqa", "eval", FLASHRAG, "dev", config="2wikimultihopqa", answer_format="qa_aliases",
            expected_rows=12576, description="2WikiMultihopQA dev, multi-hop over Wikipedia and Wikidata.",
        ),
        DatasetSpec(
            "musique", "eval", FLASHRAG, "dev", config="musique", answer_format="qa_aliases", expected_rows=2417,
            description="MuSiQue dev (answerable), 2-4 hop composed questions.",
        ),
        DatasetSpec(
            "bamboogle", "eval", FLASHRAG, "test", config="bamboogle", answer_format="qa_aliases", expected_rows=125,
            description="Bamboogle, 2-hop questions Google answered wrongly.",
        ),
        DatasetSpec(
            "nq_hotpotqa_train", "train", "PeterJinGo/nq_hotpotqa_train", "train", answer_format="qa_aliases",
            expected_rows=169615,
            description="Search-R1's training set: NQ train + HotpotQA train (per-row data_source kept as source).",
        ),
    ]
}


def get_spec(name: str) -> DatasetSpec:
    """The registered dataset `name`; an unknown name is a UserError listing the known ones."""
    if name not in DATASETS:
        raise UserError(f"unknown dataset '{name}' (known: {', '.join(DATASETS)}; or pass --from FILE)")
    return DATASETS[name]
