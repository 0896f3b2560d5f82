"""Releases that say what they need (docs/design.md#releases-and-the-schema): the
range rules as functions, the migrations held to their record and to
CHANGELOG.md, and the schema read as each role's own login, on a database
from before the record and on one newer than this release knows."""

from __future__ import annotations

import tomllib
import uuid
from collections.abc import Iterator
from importlib.metadata import version as installed_version
from types import ModuleType

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, text

from reaper import release, schema
from reaper.db import alembic_config, dispose_engines, migrate
from reaper.release import (
    SCHEMA_KNOWN,
    SCHEMA_NEEDED,
    MigratePlan,
    Migration,
    SchemaState,
    judge,
    migrate_plan,
)
from tests.conftest import PG_URL, ROOT
from tests.support import releases
from tests.support.roles import login

# The messages are built from this release's own range, so a migration that moves
# it (SCHEMA_NEEDED, SCHEMA_KNOWN) changes no string here.
V = release.version()
RANGE = f"release {V} runs on {SCHEMA_NEEDED} to {SCHEMA_KNOWN}"


def rev(base: str, offset: int) -> str:
    """The revision ``offset`` steps from ``base``."""
    return f"{int(base) + offset:04d}"


BELOW = rev(SCHEMA_NEEDED, -1)  # older than this release needs
K1, K2, K3 = (rev(SCHEMA_KNOWN, n) for n in (1, 2, 3))  # a later release's


def row(revision: str, compatible_from: str, kind: str = "expand") -> Migration:
    return Migration(revision, kind, "9.9.9", compatible_from)


# -- the range, as functions ------------------------------------------------------


def test_within_the_range_the_release_runs() -> None:
    for revision in (SCHEMA_NEEDED, SCHEMA_KNOWN):
        verdict = judge(revision, [], version=V)
        assert (verdict.state, verdict.runs) == (SchemaState.SUPPORTED, True)


def test_older_than_needed_or_unreadable_is_refused_with_the_migrate_line() -> None:
    older = judge(BELOW, [], version=V)
    assert (older.state, older.runs) == (SchemaState.OLDER, False)
    assert older.message() == (
        f"schema {BELOW} is older than this release needs ({RANGE}): run reaper migrate"
    )
    unreadable = judge(None, [], version=V)
    assert (unreadable.state, unreadable.runs) == (SchemaState.OLDER, False)
    assert unreadable.message() == (
        f"schema before {SCHEMA_NEEDED} (no revision readable by this login) is older than"
        f" this release needs ({RANGE}): run reaper migrate"
    )


def test_newer_runs_when_every_newer_migration_is_compatible() -> None:
    newer = judge(K2, [row(K1, SCHEMA_KNOWN), row(K2, BELOW)], version=V)
    assert (newer.state, newer.runs) == (SchemaState.NEWER_COMPATIBLE, True)
    assert newer.message() == (
        f"schema {K2} is newer than this release knows ({RANGE});"
        " its newer migrations are all compatible with it: running"
    )


def test_newer_is_refused_when_one_newer_migration_breaks_it_or_says_nothing() -> None:
    breaking = judge(
        K3,
        [row(K1, SCHEMA_KNOWN), row(K2, K1, "contract"), row(K3, SCHEMA_KNOWN)],
        version=V,
    )
    assert (breaking.state, breaking.runs, breaking.breaking) == (
        SchemaState.NEWER_BREAKING,
        False,
        (K2,),
    )
    assert breaking.message() == (
        f"schema {K3} is newer than this release knows ({RANGE})"
        f" and {K2} breaks it: run a release that knows {K3}"
    )
    # a newer migration without a row (the record unreadable, or not written)
    silent = judge(K2, [row(K2, SCHEMA_KNOWN)], version=V)
    assert (silent.state, silent.breaking) == (SchemaState.NEWER_BREAKING, (K1,))
    # a revision that is not one of this project's
    stranger = judge("ae1027a6acf", [], version=V)
    assert (stranger.state, stranger.runs) == (SchemaState.NEWER_BREAKING, False)


def test_migrate_applies_expand_and_contract_only_after_it() -> None:
    expand, contract = (
        lambda at: migrate_plan(at, contract=False, version=V),
        lambda at: migrate_plan(at, contract=True, version=V),
    )
    # reaper migrate: up to this release's expand head, from anywhere below it
    for at in ("0001", "0008", BELOW):
        assert expand(at) == MigratePlan(SCHEMA_NEEDED), at
    for at in (SCHEMA_NEEDED, SCHEMA_KNOWN, K1):
        assert expand(at) == MigratePlan(None), at
    # a new database: no release runs on it, so the whole chain at once
    assert expand(None) == contract(None) == MigratePlan(SCHEMA_KNOWN)
    # reaper migrate --contract: only once the expand migrations are in
    for at in ("0001", "0008", BELOW):
        refused = contract(at)
        assert refused.target is None and refused.refusal is not None
        assert f"run reaper migrate, roll every worker to {V}, then reaper migrate --contract" in (
            refused.refusal
        )
    # then its contract migrations, if it has any (none: nothing to apply)
    has_contract = int(SCHEMA_KNOWN) > int(SCHEMA_NEEDED)
    assert contract(SCHEMA_NEEDED) == MigratePlan(SCHEMA_KNOWN if has_contract else None)
    assert contract(SCHEMA_KNOWN) == MigratePlan(None)
    assert contract(K1) == MigratePlan(None)


# -- the version, the migrations, CHANGELOG.md -----------------------------------------


def test_the_version_is_the_package_s_and_the_changelog_s_newest() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert release.version() == installed_version("conference-room-reaper") == declared
    newest = releases.releases()[0]
    assert (newest.version, newest.commit) == (declared, None)  # this one, unreleased


def migration_modules() -> list[ModuleType]:
    """Every revision's module, from the first to the head."""
    scripts = ScriptDirectory.from_config(alembic_config("postgresql://unused/x"))
    return [script.module for script in reversed(list(scripts.walk_revisions()))]


def test_each_migration_says_its_kind_and_follows_the_one_before() -> None:
    modules = migration_modules()
    previous: str | None = None
    for module in modules:
        assert module.down_revision == previous, module.revision
        expected = f"{int(previous) + 1:04d}" if previous else "0001"
        assert module.revision == expected, "revisions are numbered one after the other"
        assert module.kind in ("expand", "contract"), module.revision
        assert release.order(module.compatible_from) is not None, module.revision
        previous = module.revision
    assert modules[-1].revision == SCHEMA_KNOWN
    # SCHEMA_NEEDED is where this release's contract migrations begin: after it
    # only they come, and none of them before it
    mine = [m for m in modules if m.release == release.version()]
    after = [m.revision for m in modules if int(m.revision) > int(SCHEMA_NEEDED)]
    assert after == [m.revision for m in mine if m.kind == "contract"]
    assert all(m.kind == "expand" for m in mine if int(m.revision) <= int(SCHEMA_NEEDED))


def test_the_changelog_names_every_migration_with_its_kind() -> None:
    listed = {
        revision: (entry.version, kind)
        for entry in releases.releases()
        for revision, kind in entry.migrations.items()
    }
    in_files = {m.revision: (m.release, m.kind) for m in migration_modules()}
    assert listed == in_files
    previous = releases.previous()
    assert previous.version == "0.4.0" and previous.commit == "f900179"


def test_the_record_holds_every_migration_as_its_file_says(engine: Engine) -> None:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT revision, kind, release, compatible_from FROM messenger.reaper_migrations")
        ).all()
    assert sorted(tuple(r) for r in rows) == [
        (m.revision, m.kind, m.release, m.compatible_from) for m in migration_modules()
    ]


# -- the schema read as the roles' own logins ---------------------------------------------


@pytest.fixture(scope="module")
def scratch(services: None) -> Iterator[str]:
    """A database of its own, at 0009 (release 0.2.0's head, from before the record
    of 0010) to begin with."""
    name = f"reaper_release_{uuid.uuid4().hex[:8]}"
    url = f"{PG_URL}/{name}"
    migrate(url, "0009")
    try:
        yield url
    finally:
        dispose_engines()
        admin = create_engine(f"{PG_URL}/postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def read_as(url: str, settings_url: str | None = None) -> release.Verdict:
    from reaper.config import Settings

    engine = create_engine(url)
    try:
        return schema.check(engine, Settings(database_url=settings_url or url))
    finally:
        engine.dispose()


def test_a_database_before_the_record_reads_as_older_for_every_login(scratch: str) -> None:
    owner = create_engine(scratch)
    try:
        assert read_as(scratch).revision == "0009"  # the owner reads the revision
        assert read_as(scratch).state is SchemaState.OLDER
        for role in ("reaper_worker", "reaper_operator"):
            with login(owner, scratch, role) as url:
                verdict = read_as(url)  # no grant on alembic_version yet: not an error
                assert (verdict.state, verdict.revision) == (SchemaState.OLDER, None), role
        migrate(scratch, SCHEMA_NEEDED)
        for role in ("reaper_worker", "reaper_operator"):
            with login(owner, scratch, role) as url:
                verdict = read_as(url)
                assert (verdict.state, verdict.revision) == (
                    SchemaState.SUPPORTED,
                    SCHEMA_NEEDED,
                ), role
    finally:
        owner.dispose()


def test_a_newer_schema_is_read_through_its_record(scratch: str) -> None:
    """A later release's migrations, as its record would say them: this release
    runs beside a compatible one and refuses a breaking one."""
    migrate(scratch, SCHEMA_KNOWN)
    owner = create_engine(scratch)
    try:
        later = text(
            "INSERT INTO messenger.reaper_migrations (revision, kind, release, compatible_from)"
            " VALUES (:r, :k, '9.9.9', :c)"
        )
        head = text("UPDATE alembic_version SET version_num = :v")
        with owner.begin() as conn:
            conn.execute(later, {"r": K1, "k": "expand", "c": SCHEMA_KNOWN})
            conn.execute(head, {"v": K1})
        with login(owner, scratch, "reaper_worker") as url:
            assert read_as(url).state is SchemaState.NEWER_COMPATIBLE
            with owner.begin() as conn:
                conn.execute(later, {"r": K2, "k": "contract", "c": K1})
                conn.execute(head, {"v": K2})
            verdict = read_as(url)
            assert (verdict.state, verdict.breaking) == (SchemaState.NEWER_BREAKING, (K2,))
    finally:
        with owner.begin() as conn:
            conn.execute(
                text("DELETE FROM messenger.reaper_migrations WHERE revision > :k"),
                {"k": SCHEMA_KNOWN},
            )
            conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": SCHEMA_KNOWN})
        owner.dispose()
