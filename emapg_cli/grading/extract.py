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


def _last_open(text: str, tries: int = 64) -> Optional[int]:
    """Index of the last box's open brace, found from the end (-1: gave up after `tries` look-alikes
    such as `\\boxedx`; None: no box)."""
    end = len(text)
    for _ in range(tries):
        i = max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))
        if i < 0:
            return None
        m = _BOX_OPEN.match(text, i)
        if m:
            return m.end() - 1
        end = i
    return -1


_SPACE = b" \t\n\r\f\v"


def _spelled(a, ends, word: bytes):
    """Boolean [len(ends)]: the bytes of `a` ending at each index of `ends` spell `word`."""
    import numpy as np

    ok = np.zeros(ends.shape, dtype=bool)
    room = np.flatnonzero(ends >= len(word) - 1)
    starts = ends[room] - (len(word) - 1)
    hit = a[starts] == word[0]
    for j in range(1, len(word)):
        hit &= a[starts + j] == word[j]
    ok[room] = hit
    return ok


def _last_balanced(text: str, max_chars: int) -> Optional[str]:
    """Vectorised: the content of the last box that closes at all; None when no box closes or the
    one that does holds more than `max_chars` characters.

    Works on the UTF-8 bytes (braces and backslashes are ASCII, never part of a multi-byte
    character) and only on the positions of backslashes and braces. A brace is escaped when an odd
    run of backslashes precedes it. Over the braces in order, the depth is a raw running sum (an
    unmatched `}` lowers it too): the brace closing an open one at event e is the first later event
    with a lower depth, since nothing between them closes more than it opens.
    """
    import numpy as np

    data = text.encode("utf-8", "surrogatepass")
    a = np.frombuffer(data, dtype=np.uint8)  # [L]
    backslash = np.flatnonzero(a == ord("\\"))  # [S]
    run_start = np.maximum.accumulate(np.where(np.diff(backslash, prepend=-2) != 1, backslash, 0))  # [S]
    escaped = backslash[(backslash - run_start) % 2 == 0] + 1  # positions a backslash escapes
    events = np.flatnonzero((a == ord("{")) | (a == ord("}")))  # [E] brace positions, in order
    events = events[~np.isin(events, escaped, assume_unique=True)]
    is_open = a[events] == ord("{")  # [E]
    depth = np.cumsum(is_open.astype(np.int32) * 2 - 1, dtype=np.int32)  # [E]: depth after each brace
    opens = np.flatnonzero(is_open)
    opens = opens[events[opens] > 0]  # [B] event indices of open braces
    before = events[opens] - 1  # [B] the byte before each open brace
    if np.isin(a[before], np.frombuffer(_SPACE, dtype=np.uint8)).any():  # `\boxed {`: skip the spaces
        idx = np.arange(a.size)
        before = np.maximum.accumulate(np.where(np.isin(a, np.frombuffer(_SPACE, dtype=np.uint8)), -1, idx))[before]
    maybe = np.flatnonzero((a[before] == ord("d")) | (a[before] == ord("x")))  # box-ends only: few checks
    opens, before = opens[maybe], before[maybe]
    opens = opens[_spelled(a, before, b"\\boxed") | _spelled(a, before, b"\\fbox")]
    if opens.size == 0:
        return None
    rest_min = np.full(depth.size + 1, np.iinfo(np.int32).max, dtype=np.int32)  # [E + 1]: min of depth[i:]
    rest_min[:-1] = np.minimum.accumulate(depth[::-1])[::-1]
    closing = opens[rest_min[opens + 1] < depth[opens]]  # boxes that close somewhere
    if closing.size == 0:
        return None
    e = int(closing[-1])
    f = e + 1 + int(np.argmax(depth[e + 1 :] < depth[e]))
    p, q = int(events[e]), int(events[f])
    if q - p - 1 > 4 * max_chars:  # more bytes than max_chars characters can take
        return None
    content = data[p + 1 : q].decode("utf-8", "surrogatepass")
    return content if len(content) <= max_chars else None


def last_boxed(text: str, max_chars: int = MAX_ANSWER_CHARS) -> Optional[str]:
    """Content of the last balanced `\\boxed{...}` or `\\fbox{...}` in `text`; None when there is
    none, or when that content is longer than `max_chars`.

    The last box is found from the end and checked first (the common case, cost at most
    `max_chars`); when it does not close within that, one vectorised pass finds the last box that
    closes (a truncated response falls back to its previous box; an over-long last box is no answer).
    """
    last = _last_open(text)
    if last is None:
        return None
    if last >= 0:
        close = _close_within(text, last, max_chars)
        if close is not None:
            return text[last + 1 : close]
    first = _BOX_OPEN.search(text)
    if first is None or text.find("}", first.end()) < 0:  # no brace after the first box ever closes
        return None
    return _last_balanced(text, max_chars)


def extract_answer(response: str) -> Optional[str]:
    """The final answer of a model response: its last balanced box after `</think>`, stripped
    (None when there is none or it is longer than `MAX_ANSWER_CHARS`)."""
    content = last_boxed(answer_region(response))
    return None if content is None else content.strip()
