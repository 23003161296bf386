"""Find a response's final answer: the content of its last balanced `\\boxed{}` / `\\fbox{}`.

Where the answer is looked for (`think`):
  * `emapg` (default): after the last `</think>` when the response has one, else the whole response
    (an answer boxed while thinking is not the final answer);
  * `paper`: after `</think>` only when there is exactly one, else the whole response (the paper's
    rllm reward; two `</think>` tags, e.g. a model that reopens its thinking, are searched whole). Escaped braces (`\\{`, `\\}`) do not count towards the
balance. The scan is linear in the response length, so a megabyte of text or of nested braces
costs milliseconds, not minutes.
"""

from __future__ import annotations

import re
from typing import Optional

THINK_END = "</think>"

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")  # ends on the opening brace
_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)  # an escape pair (skipped) or a brace


THINK_RULES = ("emapg", "paper")


def answer_region(response: str, think: str = "emapg") -> str:
    """The part of `response` that may hold the final answer (see the module docstring for `think`)."""
    cut = response.rfind(THINK_END)
    if cut < 0:
        return response
    if think == "paper" and response.find(THINK_END) != cut:  # more than one </think>
        return response
    if think not in THINK_RULES:
        raise ValueError(f"unknown think rule '{think}' ({', '.join(THINK_RULES)})")
    return response[cut + len(THINK_END) :]


def _close_of(text: str, open_pos: int) -> Optional[int]:
    """Index of the brace closing the one at `open_pos`, or None when the text ends first."""
    depth = 0
    for m in _BRACE.finditer(text, open_pos):
        tok = m.group()
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            if depth == 0:
                return m.start()
    return None


def _all_closes(text: str) -> dict[int, int]:
    """open-brace index -> matching close-brace index, for every balanced pair (one pass)."""
    stack: list[int] = []
    match: dict[int, int] = {}
    for m in _BRACE.finditer(text):
        tok = m.group()
        if tok == "{":
            stack.append(m.start())
        elif tok == "}" and stack:
            match[stack.pop()] = m.start()
    return match


def last_boxed(text: str) -> Optional[str]:
    """Content of the last balanced `\\boxed{...}` or `\\fbox{...}` in `text` (None if there is none).

    The last box is checked first (the common case, cost proportional to its length); only when
    it is unbalanced (a truncated response) is one pass over all braces made to find the last
    balanced one.
    """
    opens = [m.end() - 1 for m in _BOX_OPEN.finditer(text)]
    if not opens:
        return None
    close = _close_of(text, opens[-1])
    if close is not None:
        return text[opens[-1] + 1 : close]
    closes = _all_closes(text)
    for pos in reversed(opens[:-1]):
        if pos in closes:
            return text[pos + 1 : closes[pos]]
    return None


def extract_answer(response: str, think: str = "emapg") -> Optional[str]:
    """The final answer of a model response: its last balanced box in its answer region, stripped."""
    content = last_boxed(answer_region(response, think))
    return None if content is None else content.strip()
