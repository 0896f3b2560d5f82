"""This release: its version, the schema revisions it runs on, and what it makes
of the schema it finds (docs/design.md#releases-and-the-schema).

Pure: nothing here reads the database (:mod:`reaper.schema` does), so the
rules are tested as functions.

Revisions are four digits, each the one before plus one (a test holds the
migrations to it), so they are ordered as numbers, even one this release has
never seen. A release runs on ``SCHEMA_NEEDED`` (its expand migrations, which
``reaper migrate`` applies) to ``SCHEMA_KNOWN`` (its contract migrations too,
``reaper migrate --contract``). On a newer schema it runs when every migration
above ``SCHEMA_KNOWN`` says, in ``messenger.reaper_migrations``, that a release
whose head is ``SCHEMA_KNOWN`` still works with it applied; otherwise it
refuses, as it does on an older schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

DISTRIBUTION = "conference-room-reaper"
# The oldest schema this release runs on: its expand migrations applied.
SCHEMA_NEEDED = "0015"
# The newest it knows: its contract migrations applied too (the migrations' head).
SCHEMA_KNOWN = "0016"
# The exit status of a process that refuses the schema it found (the CLI, the
# worker, beat): apart from 1 (the database failed) and 2 (configuration, usage).
EXIT_SCHEMA = 3


def version() -> str:
    """The installed package's version (pyproject.toml, CHANGELOG.md)."""
    try:
        return _distribution_version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a tree that was never installed
        return "unknown"


def order(revision: str) -> int | None:
    """A revision's place in the chain; None for a name that is not a revision."""
    return int(revision) if len(revision) == 4 and revision.isdigit() else None


class SchemaState(StrEnum):
    SUPPORTED = "supported"  # within SCHEMA_NEEDED..SCHEMA_KNOWN: run
    OLDER = "older"  # refuse: run `reaper migrate`
    NEWER_COMPATIBLE = "newer_compatible"  # run, with a warning
    NEWER_BREAKING = "newer_breaking"  # refuse: run a release that knows it


@dataclass(frozen=True)
class Migration:
    """A row of messenger.reaper_migrations."""

    revision: str
    kind: str
    release: str
    compatible_from: str


@dataclass(frozen=True)
class Verdict:
    """What this release makes of the schema it found."""

    state: SchemaState
    revision: str | None  # None: no revision this login can read (before 0010)
    version: str
    needed: str = SCHEMA_NEEDED
    known: str = SCHEMA_KNOWN
    breaking: tuple[str, ...] = ()  # newer revisions that break this release

    @property
    def runs(self) -> bool:
        return self.state in (SchemaState.SUPPORTED, SchemaState.NEWER_COMPATIBLE)

    @property
    def found(self) -> str:
        """The revision as a line names it."""
        if self.revision is None:
            return f"before {self.needed} (no revision readable by this login)"
        return self.revision

    @property
    def range(self) -> str:
        return f"release {self.version} runs on {self.needed} to {self.known}"

    def message(self) -> str:
        """One line: what was found, the range, what to do."""
        if self.state is SchemaState.OLDER:
            return (
                f"schema {self.found} is older than this release needs ({self.range}): "
                "run reaper migrate"
            )
        if self.state is SchemaState.NEWER_BREAKING:
            return (
                f"schema {self.found} is newer than this release knows ({self.range}) and "
                f"{', '.join(self.breaking)} breaks it: run a release that knows {self.found}"
            )
        if self.state is SchemaState.NEWER_COMPATIBLE:
            return (
                f"schema {self.found} is newer than this release knows ({self.range}); "
                "its newer migrations are all compatible with it: running"
            )
        return f"schema {self.found} ({self.range})"

    def to_json(self) -> dict[str, str | None]:
        return {
            "revision": self.revision,
            "state": self.state.value,
            "release": self.version,
            "needs": self.needed,
            "knows": self.known,
        }


def judge(
    revision: str | None,
    record: Sequence[Migration],
    *,
    version: str,
    needed: str = SCHEMA_NEEDED,
    known: str = SCHEMA_KNOWN,
) -> Verdict:
    """The verdict on ``revision`` (None: none readable), given the record's rows."""

    def verdict(state: SchemaState, breaking: tuple[str, ...] = ()) -> Verdict:
        return Verdict(state, revision, version, needed, known, breaking)

    if revision is None:
        return verdict(SchemaState.OLDER)
    found, low, high = order(revision), order(needed), order(known)
    assert low is not None and high is not None, (needed, known)
    if found is None:  # not a revision of this project's chain: nothing says it is safe
        return verdict(SchemaState.NEWER_BREAKING, (revision,))
    if found < low:
        return verdict(SchemaState.OLDER)
    if found <= high:
        return verdict(SchemaState.SUPPORTED)
    rows = {m.revision: m for m in record}
    breaking: list[str] = []
    for step in range(high + 1, found + 1):
        name = f"{step:04d}"
        row = rows.get(name)
        # No row: nothing says the migration is safe for this release.
        oldest = order(row.compatible_from) if row is not None else None
        if oldest is None or oldest > high:
            breaking.append(name)
    if breaking:
        return verdict(SchemaState.NEWER_BREAKING, tuple(breaking))
    return verdict(SchemaState.NEWER_COMPATIBLE)


@dataclass(frozen=True)
class MigratePlan:
    """What ``reaper migrate`` does: upgrade to ``target`` (None: nothing to
    apply), or refuse with ``refusal``."""

    target: str | None
    refusal: str | None = None


def migrate_plan(current: str | None, *, contract: bool, version: str) -> MigratePlan:
    """``reaper migrate`` applies up to SCHEMA_NEEDED: the expand migrations of
    this release and every migration of earlier releases, contracts included
    (the chain is linear, and a release's contract migrations come after its
    expand ones). ``--contract`` applies this release's contract migrations,
    once its expand ones are in (the workers can only run it then).
    ``current`` is the database's revision (None: none yet). A database with
    no schema yet gets the whole chain either way: no release runs on it, so
    there is nothing to keep working, and its roles get no right that a
    contract migration would take back later."""
    if current is None:
        return MigratePlan(SCHEMA_KNOWN)
    at = order(current)
    if at is None:
        return MigratePlan(None, f"schema {current} is not a revision of this project")
    if at > int(SCHEMA_KNOWN):
        return MigratePlan(None)  # a later release's: nothing here is newer
    if not contract:
        return MigratePlan(SCHEMA_NEEDED if at < int(SCHEMA_NEEDED) else None)
    if at < int(SCHEMA_NEEDED):
        return MigratePlan(
            None,
            f"schema {current} lacks the expand migrations of release {version} "
            f"(up to {SCHEMA_NEEDED}): run reaper migrate, roll every worker to {version}, "
            "then reaper migrate --contract",
        )
    return MigratePlan(SCHEMA_KNOWN if at < int(SCHEMA_KNOWN) else None)
