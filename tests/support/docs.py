"""Reading the Markdown docs as tests need them: the anchors of a page (as
GitHub makes them from its headings), its links, and the table under a
heading."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pages() -> list[Path]:
    """README.md and every page under docs/ (the ones a reader follows links in)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, markup and punctuation
    dropped (letters, digits, ``_`` and ``-`` stay), lower case, a space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def headings(text: str) -> list[tuple[int, str]]:
    """(level, text) of every ATX heading outside fenced code blocks."""
    found: list[tuple[int, str]] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        match = re.match(r"(#{1,6})\s+(.+?)\s*#*\s*$", line)
        if match and not fenced:
            found.append((len(match.group(1)), match.group(2)))
    return found


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a page; a repeated heading gets ``-1``, ``-2``... as on GitHub."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for _, heading in headings(path.read_text()):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return frozenset(result)


def links(text: str) -> list[str]:
    """The targets of the inline links ``[text](target)`` outside fenced code."""
    body = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    body = re.sub(r"`[^`\n]*`", "", body)  # code spans hold no links
    return re.findall(r"\]\(([^)\s]+)\)", body)


def table(path: Path, heading: str, *, header: bool = False) -> list[list[str]]:
    """The body rows (header and rule left out, or the header kept first) of the
    first table under the heading whose text is ``heading``, at any level,
    before the next heading."""
    lines = path.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if re.fullmatch(rf"#+ {re.escape(heading)}", line)]
    assert len(starts) == 1, f"{len(starts)} headings '{heading}' in {path}"
    rows: list[list[str]] = []
    for line in lines[starts[0] + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            # a cell may hold an escaped pipe (\|)
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
        elif rows:
            break
    assert len(rows) > 2, f"no table under '{heading}' in {path}"
    return [rows[0], *rows[2:]] if header else rows[2:]


def names(cell: str) -> list[str]:
    """The code spans of a cell, in order."""
    return re.findall(r"`([^`]+)`", cell)
