"""The releases named in CHANGELOG.md, and the previous one's code from the
repository's own history (``git archive``, no network)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = ROOT / "CHANGELOG.md"
_HEADING = re.compile(
    r"^## (?P<version>\d+\.\d+\.\d+) "
    r"\((?:unreleased|(?P<date>\d{4}-\d\d-\d\d), commit (?P<commit>[0-9a-f]{7,40}))\)$"
)
_MIGRATION = re.compile(r"^- `(?P<revision>\d{4})` (?P<kind>expand|contract): ")


@dataclass
class Release:
    version: str
    commit: str | None  # None: unreleased (this one)
    migrations: dict[str, str] = field(default_factory=dict)  # revision -> kind


def releases() -> list[Release]:
    """Every entry of CHANGELOG.md, newest first."""
    found: list[Release] = []
    for line in CHANGELOG.read_text().splitlines():
        heading = _HEADING.match(line)
        if heading:
            found.append(Release(heading["version"], heading["commit"]))
            continue
        if line.startswith("## "):
            raise AssertionError(f"a CHANGELOG heading not in the form of the others: {line!r}")
        migration = _MIGRATION.match(line)
        if migration and found:
            found[-1].migrations[migration["revision"]] = migration["kind"]
    return found


def previous() -> Release:
    """The newest release with a commit: the one running before this one."""
    return next(r for r in releases() if r.commit is not None)


def extract(commit: str, into: Path) -> Path:
    """The tree of ``commit`` in ``into``, from this repository's history (a
    fresh clone has it; a shallow one fails here, saying so)."""
    known = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if known.returncode != 0:
        raise AssertionError(
            f"commit {commit} (CHANGELOG.md) is not in this clone's history: "
            f"clone with full history (git fetch --unshallow): {known.stderr.strip()}"
        )
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit], stdout=subprocess.PIPE)
    try:
        subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    finally:
        assert archive.stdout is not None
        archive.stdout.close()
        assert archive.wait(timeout=60) == 0, f"git archive {commit} failed"
    return into
