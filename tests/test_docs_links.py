"""Every link between the docs resolves, and so does every page and anchor the
code points to (``docs/design.md#time`` in a docstring, a comment, an alert's
runbook link). A section moved or renamed without its links fails here.

Anchors are made from headings as GitHub makes them (tests/support/docs.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.support.docs import ROOT, anchors, headings, links, pages, slug

# Where the code and the project's files name a page of docs/ (vendored files apart).
SOURCES = ("reaper", "tests", "bench", "scripts", "ops", ".ci", "docs")
TOP_LEVEL = (
    "README.md",
    "CHANGELOG.md",
    "pyproject.toml",
    "Dockerfile",
    "Procfile",
    "docker-compose.yml",
    "celeryconfig.py",
)
SKIPPED = ("tests/compose-spec",)
REFERENCE = re.compile(r"docs/[A-Za-z0-9_./-]+?\.md(?:#[\w-]+)?")


def broken(target: str, page: Path) -> str | None:
    """Why a link from ``page`` does not resolve, or None when it does."""
    path, _, anchor = target.partition("#")
    if re.match(r"[a-z][a-z0-9+.-]*:", path):  # http:, https:, mailto:
        return None
    file = (page.parent / unquote(path)).resolve() if path else page
    if not file.exists():
        return f"no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"no heading for #{anchor} in {file.relative_to(ROOT)}"
    return None


def test_every_link_between_the_docs_resolves():
    wrong = [
        f"{page.relative_to(ROOT)}: ({target}): {why}"
        for page in pages()
        for target in links(page.read_text())
        if (why := broken(target, page))
    ]
    assert not wrong, "\n".join(wrong)


def source_files() -> list[Path]:
    files = [ROOT / name for name in TOP_LEVEL if (ROOT / name).exists()]
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            where = str(path.relative_to(ROOT))
            if path.is_file() and not where.startswith(SKIPPED) and "__pycache__" not in where:
                files.append(path)
    return files


def test_every_page_and_anchor_the_files_name_exists():
    """A page of docs/ and its anchor, written anywhere (code, tests, alert rules, the docs'
    own prose) names a page that exists and a heading it has."""
    wrong = []
    for path in source_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # a chart, a binary
        for reference in sorted(set(REFERENCE.findall(text))):
            why = broken(reference, ROOT / "README.md")  # relative to the root
            if why:
                wrong.append(f"{path.relative_to(ROOT)}: {reference}: {why}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("The Kafka event", "the-kafka-event"),
        ("After the commit: facts and subscribers", "after-the-commit-facts-and-subscribers"),
        ("The outbox's levers", "the-outboxs-levers"),
        ("`reaper_runs` and REAPER_RUN_LEASE", "reaper_runs-and-reaper_run_lease"),
        ("The [runbook](x.md) (7 December, later)", "the-runbook-7-december-later"),
    ],
)
def test_anchors_are_made_as_github_makes_them(heading: str, anchor: str):
    assert slug(heading) == anchor


def test_headings_in_code_blocks_are_not_headings():
    text = "# Page\n\n```sh\n# a comment\n```\n\n## Part\n"
    assert headings(text) == [(1, "Page"), (2, "Part")]


def first_block(heading: str) -> list[str]:
    """The lines of the first fenced block under README's ``## heading``."""
    text = (ROOT / "README.md").read_text().split(f"\n## {heading}\n", 1)[1]
    return text.split("```", 2)[1].splitlines()[1:]


def test_the_readme_runs_and_tests_as_the_scripts_and_ci_do():
    """A newcomer's two commands: the README's test command is what CI runs."""
    ci = [
        line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("exec ")
    ]
    assert first_block("Test it") == [ci[0].removeprefix("exec ")]
    assert first_block("Run it") == ["scripts/run"]
    assert (ROOT / "scripts" / "run").exists()
