"""Refuse answers whose evaluation would not finish: huge integer powers and factorials.

sympy evaluates `2^{2^{40}}` or `10^{10^{10}}` to an exact integer with billions of digits: C code
that no signal interrupts, minutes of CPU and gigabytes of memory before the pool's kill. Such an
answer is never a real final answer, so it is refused (scored wrong, counted) before it reaches a
worker. The rule, applied to every `^` and `!` of an (already length-capped) answer:

  * an exponent that reads as a number (digits, `+ - * /`, `\\cdot`, `\\times`, `\\frac`, braces,
    parentheses and nested `^`) with absolute value above `MAX_EXPONENT` is refused;
  * a factorial of such a number above `MAX_FACTORIAL` is refused.

Anything symbolic (`2^{n}`, `e^{x^2}`) passes; small towers (`2^{2^{3}}`) pass. Magnitudes are
estimated in floating point (an overflow is infinity), so the check itself is cheap and linear.
"""

from __future__ import annotations

import math
import re
from typing import Optional

#: Largest |exponent| of a numeric power that is evaluated (10^5: a 100 000-digit power of 10).
MAX_EXPONENT = 1e5
#: Largest numeric argument of a factorial that is evaluated (100 000! has 456 574 digits).
MAX_FACTORIAL = 1e5

_TOKEN = re.compile(r"\s+|\d+(?:\.\d*)?|\.\d+|\\(?:cdot|times|frac|dfrac|tfrac|left|right)(?![a-zA-Z])|[-+*/^(){}]|.", re.DOTALL)


class _Symbolic(Exception):
    """The expression is not a plain number."""


class _Numeric:
    """Recursive-descent reader of a numeric LaTeX expression to a float (inf on overflow)."""

    def __init__(self, text: str) -> None:
        self.toks = [t for t in _TOKEN.findall(text) if not t.isspace() and t not in ("\\left", "\\right")]
        self.i = 0

    def peek(self) -> Optional[str]:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise _Symbolic
        self.i += 1
        return tok

    def value(self) -> float:
        v = self.sum()
        if self.peek() is not None:
            raise _Symbolic
        return v

    def sum(self) -> float:
        v = self.product()
        while self.peek() in ("+", "-"):
            v = v + self.product() if self.take() == "+" else v - self.product()
        return v

    def product(self) -> float:
        v = self.power()
        while True:
            tok = self.peek()
            if tok in ("*", "\\cdot", "\\times", "/"):
                self.take()
                rhs = self.power()
                v = v / rhs if tok == "/" and rhs else v * rhs
            elif tok is not None and (tok[0].isdigit() or tok in ("(", "{", "\\frac", "\\dfrac", "\\tfrac")):
                v = v * self.power()  # implicit product: 2(3)
            else:
                return v

    def power(self) -> float:
        base = self.atom()
        if self.peek() == "^":
            self.take()
            exp = self.power()  # right-associative
            try:
                return math.pow(abs(base), exp) if base else 0.0
            except OverflowError:
                return math.inf
        return base

    def atom(self) -> float:
        tok = self.take()
        if tok == "-":
            return -self.atom()
        if tok in ("(", "{"):
            v = self.sum()
            if self.take() not in (")", "}"):
                raise _Symbolic
            return v
        if tok in ("\\frac", "\\dfrac", "\\tfrac"):
            num, den = self.atom(), self.atom()
            return num / den if den else math.inf
        if tok[0].isdigit() or tok[0] == ".":
            return float(tok)
        raise _Symbolic


_NUMBER = re.compile(r"\d+(?:\.\d*)?|\\[a-zA-Z]+|.", re.DOTALL)
_COMMANDS = re.compile(r"\\(?:cdot|times|frac|dfrac|tfrac|left|right)(?![a-zA-Z])")
_SYMBOL = re.compile(r"[^\d\s+\-*/^(){}.]")  # any character a plain number never has


def _pairs(text: str) -> dict[int, int]:
    """Open-brace index -> its closing brace's index, one pass; unmatched ones are absent."""
    stack: list[int] = []
    pairs: dict[int, int] = {}
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
    return pairs


def _operand_after(text: str, pos: int, pairs: dict[int, int]) -> tuple[str, int]:
    """The operand starting at `pos` (after spaces): a `{...}` group's content, else one number or
    one command or character; returns (operand, end index)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos < len(text) and text[pos] == "{":
        end = pairs.get(pos, len(text))
        return text[pos + 1 : end], end + 1
    m = _NUMBER.match(text, pos)
    return (m.group(), m.end()) if m else ("", pos)


def _factorial_argument(text: str, end: int) -> str:
    """The numeric run ending just before the `!` at `end` (`12`, `(10^{6})`, `10^{10}`): digits,
    dots, braces, parentheses and `^`, at most 64 characters back."""
    m = re.search(r"[\d.^{}()]+$", text[max(0, end - 64) : end].rstrip())
    return m.group() if m else ""


def _magnitude(expr: str) -> Optional[float]:
    """|value| of a plain numeric expression; None when it is symbolic (or empty); infinity when
    it overflows or nests deeper than the reader goes."""
    if not expr or _SYMBOL.search(_COMMANDS.sub("", expr)):
        return None
    try:
        return abs(_Numeric(expr).value())
    except RecursionError:
        return math.inf
    except (_Symbolic, ValueError, ZeroDivisionError):
        return None


def too_costly(answer: str) -> Optional[str]:
    """Why evaluating `answer` would not finish (a short reason), or None when it is safe to try.

    Each numeric exponent is read once, outermost first (its inner powers are part of its value);
    the `^` inside a symbolic exponent are checked on their own.
    """
    pairs = _pairs(answer)
    read_up_to = -1
    for m in re.finditer(r"\^", answer):
        if m.start() < read_up_to:
            continue
        exponent, end = _operand_after(answer, m.end(), pairs)
        size = _magnitude(exponent)
        if size is None:
            continue
        read_up_to = end
        if size > MAX_EXPONENT:
            return f"exponent of magnitude {size:.3g} > {MAX_EXPONENT:g}"
    for m in re.finditer(r"!", answer):
        arg = _magnitude(_factorial_argument(answer, m.start()))
        if arg is not None and arg > MAX_FACTORIAL:
            return f"factorial of {arg:.3g} > {MAX_FACTORIAL:g}"
    return None
