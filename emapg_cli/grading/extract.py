"""Find a response's final answer: the content of its last balanced `\\boxed{}` / `\\fbox{}`.

Only the text after the last `</think>` is searched when the response has one (an answer boxed
while thinking is not the final answer). Escaped braces (`\\{`, `\\}`) do not count towards the
balance. An answer longer than `MAX_ANSWER_CHARS` is no answer: it is never parsed or compared
(no real final answer is that long, and everything after extraction then handles a bounded string).

The scan is linear in the response length with a small constant: the last box is checked with a
scan of at most `MAX_ANSWER_CHARS` characters; only when it does not close there (a truncated
response, or an over-long box) is one vectorised pass made over the rest of the text. A megabyte
of text, of nested braces or of unclosed boxes costs milliseconds.
"""

from __future__ import annotations

import re
from typing import Optional

THINK_END = "</think>"

#: The longest final answer that is graded (characters inside the box). Longer ones score wrong.
MAX_ANSWER_CHARS = 4096

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")  # ends on the opening brace
_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)  # an escape pair (skipped) or a brace
_ESCAPE = re.compile(r"\\.", re.DOTALL)


def answer_region(response: str) -> str:
    """The part of `response` that may hold the final answer: after the last `</think>`, if any."""
    cut = response.rfind(THINK_END)
    return response if cut < 0 else response[cut + len(THINK_END) :]


def _close_within(text: str, open_pos: int, limit: int) -> Optional[int]:
    """Index of the brace closing the one at `open_pos` when it lies within `limit` characters of
    content, else None (a bounded scan: at most `limit + 2` characters)."""
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


def _depth_after(text: str):
    """Brace depth after each character, int64 [len(text)] (escape pairs count as no brace).

    A raw running sum (an unmatched `}` lowers it too): the brace closing an open `{` at p is the
    first q > p with depth[q] < depth[p], because nothing between them closes more than it opens.
    """
    import numpy as np

    plain = _ESCAPE.sub("  ", text)  # same length: positions are kept
    codes = np.frombuffer(plain.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)  # [len]
    return np.cumsum((codes == ord("{")).astype(np.int64) - (codes == ord("}")))  # [len]


def _last_balanced(text: str, opens: list[int], max_chars: int) -> Optional[str]:
    """The last box (by its open brace in `opens`) that closes at all; its content, or None when
    none closes or the one that does holds more than `max_chars` characters."""
    import numpy as np

    base = opens[0]
    depth = _depth_after(text[base:])  # [L]
    rest_min = np.minimum.accumulate(depth[::-1])[::-1]  # [L]: min of depth[i:]
    rel = np.asarray(opens) - base  # [B]
    after = np.append(rest_min, np.iinfo(np.int64).max)[rel + 1]  # [B]: min depth after each open
    closing = np.nonzero(after < depth[rel])[0]  # boxes that close somewhere
    if closing.size == 0:
        return None
    p = int(rel[closing[-1]])
    q = p + 1 + int(np.argmax(depth[p + 1 :] < depth[p]))
    return text[base + p + 1 : base + q] if q - p - 1 <= max_chars else None


def last_boxed(text: str, max_chars: int = MAX_ANSWER_CHARS) -> Optional[str]:
    """Content of the last balanced `\\boxed{...}` or `\\fbox{...}` in `text`; None when there is
    none, or when that content is longer than `max_chars`.

    The last box is checked first (the common case, cost at most `max_chars`); when it does not
    close within that, one vectorised pass finds the last box that closes (a truncated response
    falls back to its previous box; an over-long last box is no answer).
    """
    opens = [m.end() - 1 for m in _BOX_OPEN.finditer(text)]
    if not opens:
        return None
    close = _close_within(text, opens[-1], max_chars)
    if close is not None:
        return text[opens[-1] + 1 : close]
    return _last_balanced(text, opens, max_chars)


def extract_answer(response: str) -> Optional[str]:
    """The final answer of a model response: its last balanced box after `</think>`, stripped
    (None when there is none or it is longer than `MAX_ANSWER_CHARS`)."""
    content = last_boxed(answer_region(response))
    return None if content is None else content.strip()
