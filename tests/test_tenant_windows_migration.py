"""Migrations 0015 (expand) and 0016 (contract): a tenant's windows become rows
(``messenger.reaper_tenant_windows``), backfilled from the previous release's
``messenger.reaper_tenant_policies`` and kept in step with it both ways while
that release may run beside this one; the contract drops the old table, and
its downgrade makes it again from the rows."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine, create_engine, text

from reaper.db import downgrade, migrate
from tests.conftest import PG_URL

A = "aaaaaaaa-0000-4000-8000-000000000001"
B = "bbbbbbbb-0000-4000-8000-000000000002"


@pytest.fixture
def scratch() -> Iterator[tuple[str, Engine]]:
    name = f"reaper_windows_{uuid.uuid4().hex[:8]}"
    url = f"{PG_URL}/{name}"
    migrate(url, "0014")  # the schema before the expand, with a policy of 0.4.0's shape
    engine = create_engine(url)
    try:
        yield url, engine
    finally:
        engine.dispose()
        admin = create_engine(f"{PG_URL}/postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def windows(engine: Engine) -> set[tuple[str, str, timedelta]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT tenant_id::text, phase, window_length FROM messenger.reaper_tenant_windows"
            )
        )
        return {(r[0], r[1], r[2]) for r in rows}


def policies(engine: Engine) -> dict[str, tuple[object, object, object]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT tenant_id::text, empty_room_grace, provision_timeout, stale_live_timeout"
                " FROM messenger.reaper_tenant_policies"
            )
        )
        return {r[0]: (r[1], r[2], r[3]) for r in rows}


def old_release_sets(engine: Engine, tenant: str, **columns: str | None) -> None:
    """What 0.4.0's ``reaper policy set`` writes: the tenant's row, merged."""
    names = ", ".join(columns)
    values = ", ".join(f"CAST(:{c} AS interval)" for c in columns)
    merged = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns)
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO messenger.reaper_tenant_policies (tenant_id, {names}, updated_at,"
                f" updated_by) VALUES (CAST(:t AS uuid), {values}, now(), 'old')"
                f" ON CONFLICT (tenant_id) DO UPDATE SET {merged}"
            ),
            {"t": tenant, **columns},
        )


def test_the_expand_copies_the_policies_and_keeps_both_tables_in_step(scratch):
    url, engine = scratch
    old_release_sets(engine, A, empty_room_grace="10 min", stale_live_timeout="6 hours")
    migrate(url, "0015")
    assert windows(engine) == {
        (A, "empty_room", timedelta(minutes=10)),
        (A, "stale_live", timedelta(hours=6)),
    }
    # the previous release changes a tenant's policy: the rows follow
    old_release_sets(engine, A, empty_room_grace=None, provision_timeout="5 min")
    old_release_sets(engine, B, stale_live_timeout="1 hour")
    assert windows(engine) == {
        (A, "provision_timeout", timedelta(minutes=5)),
        (A, "stale_live", timedelta(hours=6)),
        (B, "stale_live", timedelta(hours=1)),
    }
    # this release writes rows: the old table follows, its check still holds
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messenger.reaper_tenant_windows VALUES"
                " (CAST(:t AS uuid), 'empty_room', interval '2 min', now(), 'new'),"
                " (CAST(:t AS uuid), 'never_joined', interval '3 min', now(), 'new')"
            ),
            {"t": B},
        )
        conn.execute(
            text(
                "DELETE FROM messenger.reaper_tenant_windows"
                " WHERE tenant_id = CAST(:t AS uuid) AND phase <> 'stale_live'"
            ),
            {"t": A},
        )
    assert policies(engine) == {
        A: (None, None, timedelta(hours=6)),
        B: (timedelta(minutes=2), None, timedelta(hours=1)),
    }
    # a tenant's last window of the three gone: no row of 0.4.0's (ck_policy_some)
    with engine.begin() as conn:
        conn.execute(
            text("DELETE FROM messenger.reaper_tenant_windows WHERE tenant_id = CAST(:t AS uuid)"),
            {"t": A},
        )
    assert A not in policies(engine)
    # the previous release unsets a tenant: its rows of the three phases go, a
    # phase only this release has stays
    with engine.begin() as conn:
        conn.execute(
            text("DELETE FROM messenger.reaper_tenant_policies WHERE tenant_id = CAST(:t AS uuid)"),
            {"t": B},
        )
    assert windows(engine) == {(B, "never_joined", timedelta(minutes=3))}


def test_the_contract_drops_the_old_table_and_its_downgrade_makes_it_again(scratch):
    url, engine = scratch
    old_release_sets(engine, A, provision_timeout="5 min")
    migrate(url, "0016")
    with engine.connect() as conn:
        gone = conn.execute(
            text("SELECT to_regclass('messenger.reaper_tenant_policies')")
        ).scalar_one()
    assert gone is None
    assert windows(engine) == {(A, "provision_timeout", timedelta(minutes=5))}
    downgrade(url, "0015")
    assert policies(engine) == {A: (None, timedelta(minutes=5), None)}
    old_release_sets(engine, A, stale_live_timeout="2 hours")  # in step again
    assert (A, "stale_live", timedelta(hours=2)) in windows(engine)
