"""The schema: migrations are idempotent and reversible."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text

from reaper.db import downgrade, migrate
from reaper.release import SCHEMA_KNOWN
from tests.conftest import PG_URL


def _schema(url: str) -> str:
    target = make_url(url)
    host, user, database = target.host, target.username, target.database
    assert host and user and database, url  # the test databases' URLs name all three
    dump = subprocess.run(
        [
            shutil.which("pg_dump") or "pg_dump",
            "--schema-only",
            "--no-owner",
            "--schema=messenger",
            "-h",
            host,
            "-p",
            str(target.port or 5432),
            "-U",
            user,
            database,
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # \restrict / \unrestrict carry a random token per dump
    return "\n".join(
        line
        for line in dump.splitlines()
        if not line.startswith(("--", "\\restrict", "\\unrestrict"))
    )


@pytest.mark.process
def test_upgrade_downgrade_upgrade_gives_the_same_schema():
    name = f"reaper_migrations_{uuid.uuid4().hex[:8]}"
    url = f"{PG_URL}/{name}"
    try:
        migrate(url)  # creates the database too
        migrate(url)  # idempotent
        first = _schema(url)
        assert "ix_conf_active" in first and "WHERE (status = ANY" in first
        downgrade(url, "base")
        engine = create_engine(url)
        with engine.connect() as conn:
            tables = conn.execute(
                text(
                    "SELECT count(*) FROM information_schema.tables"
                    " WHERE table_schema = 'messenger'"
                )
            ).scalar()
        engine.dispose()
        assert tables == 0
        migrate(url)
        assert _schema(url) == first
    finally:
        admin = create_engine(f"{PG_URL}/postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_partial_index_covers_only_live_rows(engine):
    with engine.connect() as conn:
        definition = conn.execute(
            text("SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_conf_active'")
        ).scalar_one()
    assert "status = ANY (ARRAY['Provisioning'::text, 'Active'::text])" in definition


@pytest.mark.process
def test_reaper_migrate_cli_creates_the_database(tmp_path):
    name = f"reaper_cli_{uuid.uuid4().hex[:8]}"
    url = f"{PG_URL}/{name}"
    env = {"REAPER_DATABASE_URL": url}
    try:
        reaper_bin = str(Path(sys.executable).parent / "reaper")
        for _ in range(2):
            done = subprocess.run(
                [reaper_bin, "migrate"],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr
        engine = create_engine(url)
        with engine.connect() as conn:
            version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        engine.dispose()
        # a new database: the whole chain, contract migrations included (no older
        # release runs on it, so its roles never hold what a contract takes back)
        assert version == SCHEMA_KNOWN
    finally:
        admin = create_engine(f"{PG_URL}/postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
