"""The documents stay readable and their links lead somewhere.

README is short (at most 160 lines); every relative link and ``#anchor`` in
README, CONTRIBUTING, CHANGELOG and ``docs/*.md`` resolves (anchors as GitHub
writes them: lower case, punctuation dropped, spaces to hyphens, ``-1`` on a
repeat); every ``##`` section of a document under ``docs/`` is listed in its
table of contents; README and the docs carry no dates, since figures and
when they were measured live in BENCHMARKS.md only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))
CHECKED = [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "CHANGELOG.md", *DOCS]
README_MAX_LINES = 160

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the text may hold inline code.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`]*`")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The file's lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(path: Path) -> list[tuple[int, str]]:
    """(level, text) of every heading outside code blocks."""
    found = []
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if match:
            found.append((len(match.group(1)), match.group(2)))
    return found


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, text in headings(path):
        base = slug(text)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path):
        for match in LINK.finditer(INLINE_CODE.sub("``", line)):
            found.append((number, match.group(1)))
    return found


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    broken = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not linked.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{where} (no such section in {linked.name})")
    return broken


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_the_link_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` section: yes\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Intro\n\n"
        "[ok](other.md#a-code-section-yes) [ok](#intro) [web](https://x.org/#y)\n"
        "[bad](other.md#nope) [bad](missing.md) [bad](#outro)\n"
        "```\n[in code](nowhere.md)\n```\n"
    )
    assert [line.split(": ")[1] for line in broken_links(page, tmp_path)] == [
        "other.md#nope (no such section in other.md)",
        "missing.md (no such file)",
        "#outro (no such section in page.md)",
    ]


def test_the_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_section_is_in_the_table_of_contents(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    listed = set(re.findall(r"^\s*- \[[^\]]*\]\(#([^)]+)\)", text, re.MULTILINE))
    sections = {slug(title) for level, title in headings(path) if level == 2}
    assert sections - listed == set()


@pytest.mark.parametrize(
    "path", [REPO / "README.md", *DOCS], ids=lambda p: str(p.relative_to(REPO))
)
def test_no_dates(path: Path) -> None:
    """Dates belong with the figures they date, in BENCHMARKS.md."""
    dated = [
        f"{number}: {line.strip()}"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if DATE.search(line)
    ]
    assert dated == []
