"""Math answer grading: extract the final boxed answer, normalise, verify with math-verify safely."""

from emapg_cli.grading.extract import MAX_ANSWER_CHARS, extract_answer
from emapg_cli.grading.normalize import as_math, clean_answer, strict_key
from emapg_cli.grading.verify import Gold, Grade, MathGrader, grader_version

__all__ = ["MAX_ANSWER_CHARS", "Gold", "Grade", "MathGrader", "as_math", "clean_answer", "extract_answer", "grader_version", "strict_key"]
