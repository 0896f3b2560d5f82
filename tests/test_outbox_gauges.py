"""What a snapshot held elsewhere does to the outbox, as the relay's gauges show it
(messenger_outbox_dead_rows, messenger_outbox_oldest_snapshot_age_seconds;
docs/design.md#the-outbox-relay), against real PostgreSQL: a second session holds
a REPEATABLE READ snapshot as another role, and the relay measures as a worker
login, which may not read that session in pg_stat_activity itself."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text

from reaper import metrics
from reaper.config import Settings
from reaper.kafka import ProducerSlot
from reaper.relay import Relay
from tests.support.processes import wait_until
from tests.support.roles import login

DEAD = 500
HELD_FOR = 1.5  # seconds the snapshot is held before the relay measures


@pytest.fixture
def worker_url(engine: Engine, database_url: str) -> Iterator[str]:
    with login(engine, database_url, "reaper_worker") as url:
        yield url


def relay_pass(url: str) -> tuple[Relay, Engine, ProducerSlot]:
    """A relay as the worker's login, with a producer slot of its own (nothing is
    pending here, so it never connects to Kafka)."""
    settings = Settings(database_url=url)
    worker = create_engine(url)
    slot = ProducerSlot(settings)
    return Relay(settings, engine=worker, producers=slot), worker, slot


def leave_dead_rows(engine: Engine, count: int) -> None:
    """``count`` outbox rows written and deleted (as the relay's acknowledgements
    leave them), their counts flushed to the statistics at once."""
    with engine.connect() as conn:
        with conn.begin():
            conn.execute(
                text(
                    "INSERT INTO messenger.integration_outbox (event_id, topic, message_key,"
                    " payload) SELECT gen_random_uuid(), 't', 'deal-' || g, '{}'"
                    " FROM generate_series(1, :n) g"
                ),
                {"n": count},
            )
        with conn.begin():
            conn.execute(text("DELETE FROM messenger.integration_outbox"))
        conn.execute(text("SELECT pg_stat_force_next_flush()"))
        conn.commit()


def test_a_held_snapshot_shows_in_the_relay_s_gauges_as_a_worker_login(engine, worker_url):
    relay, worker, slot = relay_pass(worker_url)
    holder = engine.connect()
    try:
        # a long report elsewhere, as another role: a snapshot taken, held open
        holder.execute(text("BEGIN ISOLATION LEVEL REPEATABLE READ"))
        holder.execute(text("SELECT count(*) FROM messenger.integration_outbox")).scalar_one()
        holder_pid = holder.execute(text("SELECT pg_backend_pid()")).scalar_one()
        leave_dead_rows(engine, DEAD)
        time.sleep(HELD_FOR)

        # the worker's own view of that session: that it holds the horizon back, but
        # not since when (hence the function)
        with worker.connect() as conn:
            seen = conn.execute(
                text("SELECT backend_xmin, xact_start FROM pg_stat_activity WHERE pid = :p"),
                {"p": holder_pid},
            ).one()
        assert seen.backend_xmin is not None and seen.xact_start is None

        def measured() -> bool:
            return relay.run().outbox_dead_rows >= DEAD

        wait_until(measured, 15, "the dead rows counted")
        held = relay.run()
        assert held.outbox_dead_rows >= DEAD
        assert held.oldest_snapshot_age_seconds is not None
        assert held.oldest_snapshot_age_seconds >= HELD_FOR
        assert metrics.sample("messenger_outbox_dead_rows") == held.outbox_dead_rows
        assert (
            metrics.sample("messenger_outbox_oldest_snapshot_age_seconds")
            == held.oldest_snapshot_age_seconds
        )
    finally:
        holder.rollback()
        holder.close()
    try:
        released = relay.run()
    finally:
        slot.close(timeout=2)
        worker.dispose()
    # the snapshot closed: nothing holds the horizon back (the pool's sessions are idle)
    assert released.oldest_snapshot_age_seconds is not None
    assert released.oldest_snapshot_age_seconds < HELD_FOR
    assert metrics.sample("messenger_outbox_oldest_snapshot_age_seconds") < HELD_FOR


def test_the_function_says_unknown_when_its_owner_may_not_read_other_sessions(engine):
    """Owned by a role without pg_read_all_stats, the function would leave other
    roles' sessions out: it returns NULL (the gauge NaN) rather than a figure
    that looks reassuring."""
    owner = f"reaper_test_owner_{uuid.uuid4().hex[:8]}"
    holder = engine.connect()
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE ROLE {owner} NOLOGIN")
            conn.exec_driver_sql(f"GRANT USAGE, CREATE ON SCHEMA messenger TO {owner}")
        holder.execute(text("BEGIN ISOLATION LEVEL REPEATABLE READ"))
        holder.execute(text("SELECT 1")).scalar_one()
        with engine.connect() as conn, conn.begin() as tx:
            as_superuser = conn.execute(
                text("SELECT messenger.oldest_snapshot_age_seconds()")
            ).scalar_one()
            conn.exec_driver_sql(
                f"ALTER FUNCTION messenger.oldest_snapshot_age_seconds() OWNER TO {owner}"
            )
            unknown = conn.execute(text("SELECT messenger.oldest_snapshot_age_seconds()")).scalar()
            tx.rollback()  # the function keeps its owner
        assert as_superuser is not None and as_superuser >= 0
        assert unknown is None
    finally:
        holder.rollback()
        holder.close()
        with engine.begin() as conn:
            conn.exec_driver_sql(f"REVOKE ALL ON SCHEMA messenger FROM {owner}")
            conn.exec_driver_sql(f"DROP ROLE {owner}")
