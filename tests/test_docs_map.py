"""docs/README.md is the map of the docs: every docs/*.md page is linked from it, and every local link in it and in
the README resolves (to a file, and to a heading when the link names one)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def local_links(page: Path) -> list[str]:
    """The link targets of a markdown page that point into the repository (no scheme, no mail)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def unresolved(page: Path) -> list[str]:
    bad = []
    for target in local_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return bad


def missing_from_map(docs: Path) -> list[str]:
    listed = {(docs / t.partition("#")[0]).resolve() for t in local_links(docs / "README.md")}
    return sorted(p.name for p in docs.glob("*.md") if p.name != "README.md" and p.resolve() not in listed)


def test_every_docs_page_is_on_the_map():
    assert missing_from_map(DOCS) == [], "add a line for each to docs/README.md"


def test_every_page_on_the_map_has_one_line():
    lines = [line for line in (DOCS / "README.md").read_text().splitlines() if line.startswith("- [")]
    pages = [LINK.search(line).group(1) for line in lines]
    assert len(pages) == len(set(pages)), "a page listed twice"


def test_every_local_link_of_the_readme_and_the_map_resolves():
    assert unresolved(ROOT / "README.md") + unresolved(DOCS / "README.md") == []


def test_the_checks_can_fail(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\n## Some `code`: here\n")
    (docs / "b.md").write_text("# B\n")
    (docs / "README.md").write_text("- [a.md](a.md#some-code-here): a\n- [c.md](c.md): c\n- [a.md](a.md#nope): a\n")
    assert missing_from_map(docs) == ["b.md"]
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert unresolved(docs / "README.md") == ["docs/README.md: c.md (no such file)",
                                                  "docs/README.md: a.md#nope (no such heading)"]
    finally:
        ROOT = old
