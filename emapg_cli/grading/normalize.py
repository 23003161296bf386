"""Answer strings -> the forms graders compare: LaTeX for math-verify, a key for exact matching.

Gold answers come in many spellings (`$\\frac{41}{12}$`, `\\$18.90`, `1,3,5`, `$69$,$84$`, `7.`).
`clean_answer` removes what is not part of the value; `as_math` wraps the result in `$...$` so
math-verify reads it as one LaTeX expression (a bare `1,3,5` is otherwise read as the decimal 1.3;
wrapped, a comma list becomes a set, so the order of a multi-answer list does not matter).
The same cleaning is applied to the extracted model answer, so both sides are treated alike.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_ESCAPED_DOLLAR = re.compile(r"\\\$")  # currency: \$18.90
_SPACES = re.compile(r"\s+")
_TRAILING_SPACING = ("\\quad", "\\qquad", "\\,", "\\;", "\\:", "\\!", "\\ ")
_STRICT_DROP = re.compile(r"\\left|\\right|\\[,;:! ]|\\quad|\\qquad|\\displaystyle|\s+")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_DEGREE = re.compile(r"\^\{?\\circ\}?")

_OPEN, _CLOSE = "([{", ")]}"


def clean_answer(answer: str) -> str:
    """Strip dollars (math delimiters and escaped currency), outer whitespace and a trailing period.

    `clean_answer("$69$,$84$") == "69,84"`, `clean_answer("\\\\$18.90.") == "18.90"`.
    """
    s = _ESCAPED_DOLLAR.sub("", str(answer))
    s = s.replace("$", "")
    s = _SPACES.sub(" ", s).strip()
    return _strip_trailing(s)


def _strip_trailing(s: str) -> str:
    """Drop a sentence's final period and LaTeX spacing at the end (an ellipsis is kept).

    An end index moved left, never a copy per step and never an end-anchored regex (either would
    be quadratic on a long run of dots or spaces): linear in the length of what is dropped.
    """
    end = len(s)
    while True:
        while end and s[end - 1].isspace():
            end -= 1
        if end and s[end - 1] == "." and not s.endswith("...", 0, end):
            end -= 1
            continue
        cut = next((t for t in _TRAILING_SPACING if s.endswith(t, 0, end)), None)
        if cut is None:
            return s[:end]
        end -= len(cut)


def as_math(answer: str) -> str:
    """The cleaned answer as one inline-math expression for math-verify's LaTeX parser."""
    return f"${clean_answer(answer)}$"


def split_top_level(s: str, sep: str = ",") -> list[str]:
    """Split at separators outside any (), [] or {} (brackets counted by depth, so `[1,2)` works)."""
    if sep not in s:  # the common case, and a long separator-free answer costs one C scan
        return [s.strip()]
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        ch = s[i]
        if ch == "\\":  # an escaped character (\{, \,) never splits or nests
            i += 2
            continue
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(depth - 1, 0)
        elif ch == sep and depth == 0:
            parts.append(s[start:i])
            start = i + 1
        i += 1
    parts.append(s[start:])
    return [p.strip() for p in parts]


def strict_key(answer: str) -> str:
    """A canonical string for exact matching and majority voting.

    Cleaned, then LaTeX spacing, `\\left`/`\\right`, degree signs and `\\text{}` wrappers removed,
    `\\dfrac`/`\\tfrac` read as `\\frac`; a top-level comma list is sorted (a set of answers).
    """
    s = clean_answer(answer)
    s = _TEXT.sub(r"\1", s)
    s = _DEGREE.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _STRICT_DROP.sub("", s)
    parts = split_top_level(s)
    return ",".join(sorted(parts)) if len(parts) > 1 else s


_PLAIN_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def plain_number(key: str) -> Optional[Fraction]:
    """The exact value of a `strict_key` that is a plain decimal number ("-12", "3.50"), else None.

    Two plain numbers are equivalent exactly when their values are equal, which settles most
    answers of numeric tasks without a math-verify call.
    """
    return Fraction(key) if _PLAIN_NUMBER.match(key) else None
