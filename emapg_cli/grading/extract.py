"""Find a response's final answer: the content of its last balanced `\\boxed{}` / `\\fbox{}`.

Where the answer is looked for (`think`):
  * `emapg` (default): after the last `</think>` when the response has one, else the whole response
    (an answer boxed while thinking is not the final answer);
  * `paper`: after `</think>` only when there is exactly one, else the whole response (the paper's
    rllm reward; two `</think>` tags, e.g. a model that reopens its thinking, are searched whole).
Escaped braces (`\\{`, `\\}`) do not count towards the balance. An answer longer than
`MAX_ANSWER_CHARS` is no answer: it is never parsed or compared (no real final answer is that long,
and everything after extraction then handles a bounded string).

The last box decides, as in the paper's grader (rllm, after the MATH repository): when it does not
close within `MAX_ANSWER_CHARS` characters (a response cut inside its box, or an over-long answer)
the response has no answer, even when an earlier box closed. Finding it costs a reverse search and a
scan of at most `MAX_ANSWER_CHARS` characters: a megabyte of text, of nested braces or of unclosed
boxes costs well under a millisecond of scanning.

The search agent's answers are tagged instead (`<answer> a </answer>`, Search-R1's protocol): `last_answer`
finds the last one. It lives here, below both the agents (which write the protocol) and the rewards (which
score it), so neither package imports the other for it.
"""

from __future__ import annotations

import re
from typing import Optional

THINK_END = "</think>"
#: Search-R1's answer tags (agents/protocol.py's actions; rewards/qa.py scores the content of the last pair).
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

#: The longest final answer that is graded (characters inside the box). Longer ones score wrong.
MAX_ANSWER_CHARS = 4096

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


def _close_within(text: str, open_pos: int, limit: int) -> Optional[int]:
    """Index of the brace closing the one at `open_pos` when it lies within `limit` characters of
    content, else None (a bounded scan: at most `limit + 2` characters)."""
    if text.find("}", open_pos, open_pos + limit + 2) < 0:  # nothing closes within reach (e.g. a run of `{`)
        return None
    depth = 0
    for m in _BRACE.finditer(text, open_pos, open_pos + limit + 2):
        tok = m.group()
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            if depth == 0:
                return m.start()
    return None


def _last_open(text: str, tries: int = 64) -> Optional[int]:
    """Index of the last box's open brace, found from the end (-1: gave up after `tries` look-alikes
    such as `\\boxedx`; None: no box)."""
    end = len(text)
    for _ in range(tries):
        i = text.rfind("\\boxed", 0, end)
        i = max(i, text.rfind("\\fbox", max(i, 0), end))  # an \fbox only counts after the last \boxed
        if i < 0:
            return None
        m = _BOX_OPEN.match(text, i)
        if m:
            return m.end() - 1
        end = i
    return -1


def last_boxed(text: str, max_chars: int = MAX_ANSWER_CHARS) -> Optional[str]:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` in `text`; None when there is none, when it
    does not close (a response cut inside its box), or when its content is longer than `max_chars`.

    The paper's rule (rllm's `last_boxed_only_string`, from the MATH repository): the last box
    decides, and an unclosed last box is no answer; there is no fall-back to an earlier box. The
    last box is found from the end and its brace matched with a scan of at most `max_chars`
    characters, so the cost is bounded whatever the text holds.
    """
    last = _last_open(text)
    if last is None or last < 0:
        return None
    close = _close_within(text, last, max_chars)
    return None if close is None else text[last + 1 : close]


def extract_answer(response: str, think: str = "emapg") -> Optional[str]:
    """The final answer of a model response: its last balanced box in its answer region, stripped
    (None when there is none or it is longer than `MAX_ANSWER_CHARS`)."""
    content = last_boxed(answer_region(response, think))
    return None if content is None else content.strip()


def last_answer(text: str) -> Optional[str]:
    """Content of the last complete `<answer>...</answer>` in `text` (stripped), None when there is none."""
    end = text.rfind(ANSWER_CLOSE)
    start = text.rfind(ANSWER_OPEN, 0, end) if end >= 0 else -1
    return text[start + len(ANSWER_OPEN):end].strip() if start >= 0 else None
