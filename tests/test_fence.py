"""The fence of a phase's batches (docs/design.md#the-single-runner-lock).

A batch changes nothing unless its run is still open and its phase's lock
session still holds the run lock; a cycle that takes the run over waits for
the batch in flight, and no batch of the old owner commits after it.
"""

from __future__ import annotations

import threading
import uuid

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError

from reaper import budgets, metrics
from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.events import BatchSelected, Bus, LockLost, PhaseCompleted, PhaseFailed
from reaper.phases import EMPTY_ROOM, reap_batch
from reaper.queries import Queries
from reaper.runs import Runs
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.facts import FactRecorder

LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('messenger.conference-room-reaper', 0))"
ERRORS = "messenger_conf_reaper_errors_total"


def open_run(engine: Engine, settings: Settings) -> str:
    run_id = str(uuid.uuid4())
    assert Runs(engine, settings).take(run_id, T0).skipped is None
    return run_id


def batch(conn: Connection, settings: Settings, run_id: str, holder_pid: int):
    queries = Queries(conn)
    queries.bound_transaction(budgets.batch(settings))
    return reap_batch(
        queries, EMPTY_ROOM, settings, as_of=T0, run_id=run_id, holder_pid=holder_pid, excluded=[]
    )


def ended(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT count(*) FROM messenger.conference_sessions WHERE status = 'Ended'")
        ).scalar_one()


def test_a_batch_whose_phase_holds_the_lock_closes_its_rooms(settings, engine):
    with engine.begin() as conn:
        f.bulk_conferences(conn, 3)
    run_id = open_run(engine, settings)
    with engine.begin() as conn:
        conn.execute(text(LOCK))
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        effect = batch(conn, settings, run_id, pid)
    assert not effect.fenced and len(effect.reaped) == 3
    assert ended(engine) == 3


def test_a_batch_without_the_lock_changes_nothing(settings, engine):
    """The phase's lock session is gone (its backend pid no longer holds the lock)."""
    with engine.begin() as conn:
        f.bulk_conferences(conn, 3)
    run_id = open_run(engine, settings)
    with engine.begin() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        effect = batch(conn, settings, run_id, pid)
    assert effect.fenced and effect.reaped == [] and effect.locked == []
    with engine.begin() as conn, engine.begin() as other:
        other.execute(text(LOCK))  # held, but by another backend
        stranger = other.execute(text("SELECT pg_backend_pid()")).scalar_one()
        assert batch(conn, settings, run_id, stranger + 1_000_000).fenced
    assert ended(engine) == 0
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM messenger.integration_outbox")).scalar() == 0


def test_a_batch_of_a_run_taken_over_changes_nothing(settings, engine):
    with engine.begin() as conn:
        f.bulk_conferences(conn, 3)
    run_id = open_run(engine, settings)
    with engine.begin() as conn:
        Queries(conn).close_run(run_id, "taken_over")
    with engine.begin() as conn:
        conn.execute(text(LOCK))
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        assert batch(conn, settings, run_id, pid).fenced
    assert ended(engine) == 0


def test_a_takeover_waits_for_the_batch_in_flight_and_fences_the_next(settings, engine):
    """The batch holds its run row (FOR KEY SHARE) until it commits: the taker's
    open_run (FOR UPDATE) waits for it; once taken over, the old owner's next
    batch finds the run closed."""
    with engine.begin() as conn:
        f.bulk_conferences(conn, 4)
    run_id = open_run(engine, settings)
    small = settings.model_copy(update={"batch_size": 2})
    with engine.connect() as owner:
        owner_tx = owner.begin()
        owner.execute(text(LOCK))
        pid = owner.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with engine.connect() as lane:
            lane_tx = lane.begin()
            assert len(batch(lane, small, run_id, pid).reaped) == 2  # in flight: not committed
            owner_tx.rollback()  # the phase's lock session ends (the lock with it)
            with engine.connect() as taker:
                with pytest.raises(OperationalError, match="lock timeout"), taker.begin():
                    taker.execute(text("SET LOCAL lock_timeout = '300ms'"))
                    Queries(taker).open_run()
                lane_tx.commit()
                with taker.begin():
                    row = Queries(taker).open_run()
                    assert row is not None and row.run_id == run_id
                    Queries(taker).close_run(run_id, "taken_over")
            owner.execute(text(LOCK))  # even with the lock again: the run is no longer its
            with lane.begin():
                assert batch(lane, small, run_id, pid).fenced
            owner.rollback()
    assert ended(engine) == 2


def test_a_phase_whose_lock_session_ends_stops_and_counts_what_it_committed(settings, engine):
    """The server ends the phase's lock session mid-drain (as it does a silent
    one): the next batch is fenced off, every lane stops, the phase fails and
    tells the lost lock, and the run's counts say exactly what was committed."""
    with engine.begin() as conn:
        f.bulk_conferences(conn, 400)
    settings = settings.model_copy(update={"batch_size": 10, "drain_lanes": 2})
    bus = Bus()
    facts = FactRecorder(bus, BatchSelected, PhaseFailed, LockLost)
    reaper = Reaper(settings, engine=engine, bus=bus)
    killed = threading.Event()

    def end_lock_session(fact: BatchSelected) -> None:
        if killed.is_set() or fact.phase != "empty_room":
            return
        killed.set()
        end_lock_sessions(engine)

    bus.subscribe(BatchSelected, end_lock_session)
    metrics.subscribe(bus)
    errors_before = metrics.sample(ERRORS)
    cycle = reaper.start(T0)
    phase = reaper.run_phase("empty_room", cycle.run_id)
    result = reaper.finish(cycle.run_id)
    facts.close()
    assert killed.is_set()
    [failed] = facts.of(PhaseFailed)
    assert "RunLost" in failed.error and "fenced off" in failed.error
    assert len(facts.of(LockLost)) == 1
    # the failed phase and the lost lock, one error each
    assert metrics.sample(ERRORS) - errors_before == 2
    committed = ended(engine)
    assert 0 < committed < 400  # stopped mid-drain
    assert phase["empty_timeout_count"] == result["empty_timeout_count"] == committed
    with engine.connect() as conn:
        saved = conn.execute(
            text("SELECT counts, errors FROM messenger.reaper_runs WHERE run_id = :r"),
            {"r": cycle.run_id},
        ).one()
    assert saved.counts["empty_timeout_count"] == committed and saved.errors == 1


def end_lock_sessions(engine: Engine) -> int:
    """The server ends every session holding the run lock, as it ends a silent one."""
    with engine.begin() as conn:
        return len(
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'"
                    " AND objsubid = 1 AND granted AND pid <> pg_backend_pid()"
                    # this test's database only: the cluster may serve others
                    " AND database = (SELECT oid FROM pg_database"
                    " WHERE datname = current_database())"
                )
            ).all()
        )


def test_a_lock_lost_after_the_last_batch_is_counted_in_errors_total(settings, engine):
    """The lock session ends after the phase's only batch has committed: the phase
    completes (its rooms are closed) but lost its lock on the way out; that is
    `lock.lost` and one error in messenger_conf_reaper_errors_total, although no
    phase failed."""
    with engine.begin() as conn:
        f.bulk_conferences(conn, 5)
    settings = settings.model_copy(update={"batch_size": 10, "drain_lanes": 1})
    bus = Bus()
    facts = FactRecorder(bus, PhaseCompleted, PhaseFailed, LockLost)
    metrics.subscribe(bus)
    reaper = Reaper(settings, engine=engine, bus=bus)
    terminated: list[int] = []
    # the only batch is short: the drain ends after its report, then the phase releases
    bus.subscribe(BatchSelected, lambda fact: terminated.append(end_lock_sessions(engine)))
    errors_before = metrics.sample(ERRORS)
    cycle = reaper.start(T0)
    phase = reaper.run_phase("empty_room", cycle.run_id)
    facts.close()
    assert terminated == [1]
    assert phase["empty_timeout_count"] == 5 and ended(engine) == 5
    assert facts.of(PhaseFailed) == []
    assert [c.phase for c in facts.of(PhaseCompleted)] == ["empty_room"]
    [lost] = facts.of(LockLost)
    assert lost.phase == "empty_room" and lost.run_id == cycle.run_id
    assert metrics.sample(ERRORS) - errors_before == 1
