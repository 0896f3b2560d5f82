"""The pass locks (reaper/lease.py): the relay's and the stop pass's lock held as
the phases hold the run lock, their claims and marks fenced on the lock
session, the gate that keeps an earlier holder's marks from committing after
a successor began, and the heartbeat that keeps a batch's transaction alive
while it waits on Kafka. The process and fault layer is tests/test_pass_takeover.py."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from reaper import budgets
from reaper.config import Settings
from reaper.db import begin
from reaper.lease import Heartbeat, pass_lock
from reaper.phases import IN_ORDER
from reaper.queries import Queries


def add_rows(engine: Engine, count: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload)"
                " SELECT gen_random_uuid(), 't', 'deal-' || n, '{}' FROM generate_series(1, :c) n"
            ),
            {"c": count},
        )


def relay_lock(engine: Engine, settings: Settings):
    return pass_lock(
        engine,
        settings,
        take=Queries.try_relay_lock,
        wait_for_marks=Queries.wait_relay_marks,
        give_up_s=60,
    )


def test_the_batch_and_pass_budgets_are_the_lease(settings):
    """A relay batch's transaction and a pass's lock session are idle for at most
    one REAPER_RUN_LEASE; the give-up bounds are the longest a healthy pass runs."""
    assert budgets.relay_batch(settings).idle == settings.run_lease == timedelta(seconds=10)
    assert budgets.run_lock(settings).idle == settings.run_lease
    # 20 s of claims, then the batches in flight settle within six Kafka timeouts
    assert budgets.relay_pass_give_up(settings) == timedelta(seconds=90)
    assert budgets.stop_pass_give_up(settings) == timedelta(seconds=6 + 15)


def test_one_pass_holds_the_relay_lock_and_its_fence_names_its_session(settings, engine):
    add_rows(engine, 5)
    with relay_lock(engine, settings) as lock, relay_lock(engine, settings) as other:
        assert lock is not None and lock.holder_pid is not None
        assert other is None  # taken without waiting: the other pass is skipped
        with engine.connect() as conn:
            queries = Queries(conn)
            assert len(queries.claim_outbox_batch(10, lock.holder_pid)) == 5
            conn.rollback()
            # any other backend (a lost lock session's pid): nothing is claimed
            assert queries.claim_outbox_batch(10, lock.holder_pid + 1) == []
            assert queries.relay_marks_fence(lock.holder_pid)
            assert not queries.relay_marks_fence(lock.holder_pid + 1)
            conn.rollback()
        assert not lock.lost
    assert lock.error is None  # held to the end
    with engine.connect() as conn:  # and freed at its end
        assert Queries(conn).try_relay_lock() is not None
        conn.rollback()


def test_a_lock_session_ended_midway_is_found_lost_and_fences_everything(settings, engine):
    add_rows(engine, 3)
    with relay_lock(engine, settings) as lock:
        assert lock is not None and lock.holder_pid is not None
        with engine.connect() as conn:
            # with a timeout it returns once the backend is gone, and its lock with it
            # (without one it only signals it: a claim right after could still see it)
            ended = conn.execute(
                text("SELECT pg_terminate_backend(:p, 10000)"), {"p": lock.holder_pid}
            ).scalar_one()
            assert ended
            conn.commit()
            queries = Queries(conn)
            assert queries.claim_outbox_batch(10, lock.holder_pid) == []
            assert not queries.relay_marks_fence(lock.holder_pid)
            conn.rollback()
    assert lock.error is not None  # what the pass reports as relay.lock_lost


def test_a_successor_waits_for_marks_that_passed_the_fence(settings, engine):
    """The gate: a batch that passed the fence holds it until its commit, and a new
    holder waits for that commit before it begins; while a new holder waits, a
    late batch of the old one finds the gate closed."""
    with relay_lock(engine, settings) as lock:
        assert lock is not None and lock.holder_pid is not None
        with engine.connect() as marks, engine.connect() as successor:
            assert Queries(marks).relay_marks_fence(lock.holder_pid)  # a batch at its marks
            tx, queries = begin(successor, budgets.quick(settings))
            successor.execute(text("SET LOCAL lock_timeout = '300ms'"))
            with pytest.raises(OperationalError, match="lock timeout"):
                queries.wait_relay_marks()
            tx.rollback()
            marks.commit()  # the batch committed: the successor may begin
            tx, queries = begin(successor, budgets.quick(settings))
            queries.wait_relay_marks()
            # a late batch of the old holder while the successor holds the gate
            assert not Queries(marks).relay_marks_fence(lock.holder_pid)
            marks.rollback()
            tx.rollback()


def test_the_stop_lock_is_held_and_fenced_the_same_way(settings, engine):
    take = pass_lock(
        engine,
        settings,
        take=Queries.try_stop_lock,
        wait_for_marks=Queries.wait_stop_marks,
        give_up_s=60,
    )
    with take as lock:
        assert lock is not None and lock.holder_pid is not None
        with engine.connect() as conn:
            queries = Queries(conn)
            assert queries.try_stop_lock() is None
            assert queries.stop_marks_fence(lock.holder_pid)
            assert not queries.stop_marks_fence(lock.holder_pid + 1)
            conn.rollback()
            window = 365 * 86400
            for pid in (lock.holder_pid, lock.holder_pid + 1, None):
                assert (
                    queries.claim_stops_due(
                        phases=IN_ORDER, window_s=window, lease_s=1, limit=1, holder_pid=pid
                    )
                    == []
                )  # nothing due here: the statement runs with either fence
                conn.rollback()


def test_a_tended_transaction_outlives_its_idle_bound_until_untended(database_url, engine):
    """A relay batch waiting on Kafka: its transaction's idle bound is the lease,
    and the heartbeat speaks on it; untended, the server ends it a lease later."""
    settings = Settings(database_url=database_url, run_lease=timedelta(seconds=2))
    conn = engine.connect()
    try:
        begin(conn, budgets.relay_batch(settings))
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        heartbeat = Heartbeat.per_lease(None, settings, give_up_s=60)
        heartbeat.tend(conn)
        heartbeat.start()
        try:
            time.sleep(2.5 * 2)  # two and a half leases
            assert alive(engine, pid)
            heartbeat.untend(conn)
            time.sleep(2 + 1.5)
            assert not alive(engine, pid)
        finally:
            heartbeat.stop()
    finally:
        conn.invalidate()  # the server ended it
        conn.close()


def alive(engine: Engine, pid: int) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": pid}
            ).scalar_one()
        )
