"""Search-R1's text protocol (Jin et al. 2025, `search_r1/llm_agent/generation.py`): prompt, actions, observations.

  prompt       the packaged template `prompts/search_r1.txt` (Search-R1's `make_prefix`, template
               `base`, verbatim), `{question}` replaced by the stripped question with a `?` appended
               when it has none
  action       the first `<search> q </search>` or `<answer> a </answer>` of a turn (DOTALL, content
               stripped); anything else is an invalid action
  observation  `\\n\\n<information>Doc 1(Title: t) text\\nDoc 2(...) ...</information>\\n\\n` (passages
               stripped), or the invalid-action message
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Optional

from emapg_cli.errors import UserError
from emapg_cli.grading.extract import ANSWER_CLOSE, ANSWER_OPEN, last_answer  # noqa: F401 - the protocol's answer tags
from emapg_cli.retrieval.base import Hit

PACKAGED_TEMPLATE = Path(__file__).parent / "prompts" / "search_r1.txt"
SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
#: Each turn stops at the first closing tag (the engines keep the token that completes it).
STOP = (SEARCH_CLOSE, ANSWER_CLOSE)
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


@lru_cache(maxsize=8)
def load_template(path: Optional[str] = None) -> str:
    """The user-message template (the packaged Search-R1 prompt when `path` is None); needs `{question}`."""
    from emapg_cli.fileio import read_text_file
    from emapg_cli.paths import expand

    file = expand(path) if path else PACKAGED_TEMPLATE
    if not file.is_file():
        raise UserError(f"search.prompt_template: {file}: no such file")
    text = read_text_file(file, "search.prompt_template")
    if "{question}" not in text:
        raise UserError(f"search.prompt_template: {file} has no {{question}} placeholder")
    return text


def format_question(question: str, template: str) -> str:
    """The user message for `question` (Search-R1: stripped, `?` appended unless it ends with one)."""
    q = question.strip()
    if not q.endswith("?"):
        q += "?"
    return template.replace("{question}", q)


def parse_action(text: str) -> tuple[Optional[str], str]:
    """(`search` | `answer` | None, stripped content) of a turn's text: the first complete tag pair wins."""
    m = _ACTION.search(text)
    return (m.group(1), m.group(2).strip()) if m else (None, "")


def cut_after_action(text: str) -> str:
    """Search-R1's `_postprocess_responses`: the text up to the first `</search>`, else the first `</answer>`."""
    for tag in STOP:
        if tag in text:
            return text.split(tag, 1)[0] + tag
    return text


def information(hits: list[Hit]) -> str:
    """The observation after a search: `Doc {i}(Title: {first line}) {other lines}\\n` per hit (Search-R1's
    `_passages2string`; wiki-18's quotes kept), stripped, inside `<information>`."""
    out = []
    for i, h in enumerate(hits, 1):
        title, _, text = h.contents.partition("\n")
        out.append(f"Doc {i}(Title: {title}) {text}\n")
    return f"\n\n<information>{''.join(out).strip()}</information>\n\n"

