"""The calculator environment: `<calc>EXPR</calc>` returns `<result>VALUE</result>`, for the toy-tools task.

A built-in environment written exactly to the user-environment contract (docs/environments.md): a class
with `stop`, `max_turns`, `__init__(example)` and `step(text)`; it has no `reward`, so the run's
`rollout.reward` (the toy's `math` reward) grades the final text. Each policy turn ends at `</calc>` or at
the end of the response:

  * a turn with `<calc>EXPR</calc>` gets the observation `<result>VALUE</result>` (a *call*), or
    `<result>error</result>` when EXPR is not an expression this calculator evaluates (an *invalid* call);
  * any other turn ends the episode (the answer is the last `\\boxed{}` of the policy's text).

`evaluate` is the calculator: it parses EXPR with `ast` and walks the tree itself (never `eval`), over
integers and `+ - * / // % **` with parentheses and unary signs. Values are exact fractions; `/` of
integers that do not divide shows 6 decimals. Sizes are bounded (expression length, literal digits,
every intermediate numerator and denominator, exponents), so no input can make it slow.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction
from typing import Optional

MAX_CHARS = 64  # longest expression evaluated
MAX_DIGITS = 15  # largest |numerator| or denominator of a literal, an intermediate value or the result: < 10**MAX_DIGITS
MAX_EXPONENT = 32  # `a ** n` needs an integer 0 <= n <= MAX_EXPONENT
_LIMIT = 10**MAX_DIGITS

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression the calculator refuses (syntax, a name or call, a size bound, division by zero)."""


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) >= _LIMIT or value.denominator >= _LIMIT:
        raise CalcError(f"a value has more than {MAX_DIGITS} digits")
    return value


def _walk(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is an int subclass: refused
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalcError("division by zero")
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or not 0 <= right <= MAX_EXPONENT:
                raise CalcError(f"exponents must be integers from 0 to {MAX_EXPONENT}")
            if left == 0 and right == 0:
                raise CalcError("0 ** 0")
        # Bounded operands (< 10**15) and exponents (<= 32) keep this exact step under ~500 digits.
        return _bounded(Fraction(_BINARY[type(node.op)](left, right)))
    raise CalcError(f"not allowed: {type(node).__name__}")


def format_value(value: Fraction) -> str:
    """An integer as is (`-42`); any other value rounded to 6 decimals, trailing zeros removed (`0.333333`, `2.5`,
    `2` for 2.0000001, `0` for -0.0000001)."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.6f}".rstrip("0").rstrip(".")  # |value| < 10**15: a float keeps 6 decimals
    return "0" if text == "-0" else text


def evaluate(expr: str) -> str:
    """The value of the integer expression `expr` (see the module docstring), formatted by `format_value`.

    Raises `CalcError` on anything else: a syntax error, a name, a call, a float or string literal, an
    attribute, a comparison, a too-long expression, a too-large value, a bad exponent, division by zero.
    """
    expr = expr.strip()
    if not expr:
        raise CalcError("empty expression")
    if len(expr) > MAX_CHARS:
        raise CalcError(f"longer than {MAX_CHARS} characters")
    if any(ch not in "0123456789+-*/%() " for ch in expr):  # before parsing: no names, dots, quotes or brackets
        raise CalcError("only digits, + - * / // % ** and parentheses")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalcError("syntax error") from e
    return format_value(_walk(tree))


class CalculatorEnv:
    """One episode of the toy-tools task with a calculator (the user-environment contract).

    Counters, read by the runner as `env/...` metrics: `calls` (turns with a `<calc>` call),
    `invalid` (calls the calculator refused).
    """

    stop = ["</calc>"]
    max_turns = 4

    def __init__(self, example: dict):
        self.example = example
        self.calls = 0
        self.invalid = 0

    def step(self, text: str) -> Optional[str]:
        """The observation for a turn that calls the calculator; None (end) for any other turn."""
        m = _CALL.search(text)
        if m is None:
            return None
        self.calls += 1
        try:
            return f"<result>{evaluate(m.group(1))}</result>"
        except CalcError:
            self.invalid += 1
            return "<result>error</result>"
