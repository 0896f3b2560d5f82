"""One reap cycle (reaper.cycle): its head, its phases in order, its end, and
what it tells as facts; a phase that fails, is interrupted, or finds its run
gone. The phases' own cases are tests/test_phases.py's; the run's ownership
across processes is tests/test_run_ownership.py's."""

from __future__ import annotations

import logging
from datetime import timedelta
from types import SimpleNamespace
from typing import get_args

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import DBAPIError

from reaper.config import Settings
from reaper.cycle import Cycle, Reaper, is_poison_error, phase_result
from reaper.errors import sqlstate
from reaper.events import (
    Bus,
    CountKey,
    Counts,
    CycleCompleted,
    CycleResult,
    CycleSkipped,
    CycleStarted,
    PhaseCompleted,
    PhaseCountKey,
    PhaseFailed,
    PhaseResult,
)
from reaper.phases import ORDER, PHASES
from reaper.queries import source
from reaper.runs import COUNT_KEYS, Start, unowned_result
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.facts import FactRecorder, SteppingClock, log_events

LOCK = "SELECT pg_advisory_lock(hashtextextended('messenger.conference-room-reaper', 0))"
UNLOCK = "SELECT pg_advisory_unlock(hashtextextended('messenger.conference-room-reaper', 0))"


class Interrupted(BaseException):
    """Not an Exception: what no ``except Exception`` in a phase may swallow."""


def advisory_locks(engine: Engine) -> int:
    """Advisory locks held in this test session's database, by anyone."""
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
        ).scalar_one()


def reaper_on(settings: Settings, engine: Engine, **kwargs) -> tuple[Reaper, FactRecorder]:
    bus = Bus()
    return Reaper(settings, engine=engine, bus=bus, **kwargs), FactRecorder(bus)


# -- pure ------------------------------------------------------------------------


def test_a_cycle_owns_its_run_only_when_it_took_it() -> None:
    taken = Start(run_id="r", as_of=T0, started_at=T0, clock_skew_seconds=0.0)
    assert Cycle("r", taken).owns_run
    assert not Cycle("r", None, failed="no database").owns_run
    skipped = Start(run_id="r", as_of=T0, started_at=T0, clock_skew_seconds=0.0, skipped="held")
    assert not Cycle("r", skipped).owns_run


class ServerError(Exception):
    """What the driver raises: an error carrying PostgreSQL's SQLSTATE."""

    def __init__(self, pgcode: str | None) -> None:
        super().__init__(pgcode)
        self.pgcode = pgcode


@pytest.mark.parametrize(
    ("pgcode", "refused"),
    [
        ("23505", True),  # a constraint
        ("22003", True),  # a data exception (a value out of range)
        ("P0001", True),  # a trigger raising
        ("40001", False),  # a serialization failure: the statement, not the row
        ("57014", False),  # statement timeout
        ("08006", False),  # the connection
        (None, False),
    ],
)
def test_only_what_the_database_refuses_of_a_row_is_a_refusal(
    pgcode: str | None, refused: bool
) -> None:
    exc = DBAPIError("UPDATE ...", {}, ServerError(pgcode))
    assert is_poison_error(exc) is refused


def test_the_sqlstate_is_the_drivers_and_none_for_any_other_error() -> None:
    assert sqlstate(DBAPIError("DELETE ...", {}, ServerError("42501"))) == "42501"
    assert sqlstate(DBAPIError("DELETE ...", {}, ValueError("no code"))) is None
    assert sqlstate(ValueError("not the database's")) is None


def test_a_phase_result_counts_that_phase_alone() -> None:
    before = dict.fromkeys(COUNT_KEYS, 0) | {"empty_timeout_count": 5, "failed_count": 1}
    after = before | {"empty_timeout_count": 8, "failed_count": 2}
    run = SimpleNamespace(as_of=T0)
    result = phase_result("r", run, before, after)  # type: ignore[arg-type]
    assert result["run_id"] == "r" and result["as_of"] == "2026-12-02T10:00:00Z"
    assert result["skipped"] is False and result["paused"] == []
    assert result["empty_timeout_count"] == 3 and result["failed_count"] == 1
    unchanged = [key for key in COUNT_KEYS if before[key] == after[key]]
    assert unchanged and all(result[key] == 0 for key in unchanged)


def test_a_phase_result_without_a_run_is_skipped_and_counts_nothing() -> None:
    result = phase_result("r", None, {}, {})
    assert result["skipped"] is True and result["as_of"] is None
    assert all(result[key] == 0 for key in COUNT_KEYS)


def test_the_counts_of_a_result_are_the_typed_ones_in_the_results_order() -> None:
    """COUNT_KEYS (each phase's count_key, then the two of the cycle) are the keys
    of events.Counts and of CountKey: runs.counts casts to Counts on that ground."""
    assert set(COUNT_KEYS) == Counts.__required_keys__
    assert get_args(CountKey) == COUNT_KEYS
    assert tuple(p.count_key for p in PHASES.values()) == get_args(PhaseCountKey)


def test_the_results_are_built_with_the_keys_their_types_give() -> None:
    cycle = unowned_result("r", T0, skipped=True)
    phase = phase_result("r", None, {}, {})
    assert set(cycle) == CycleResult.__required_keys__
    assert set(phase) == PhaseResult.__required_keys__
    # the order of the task's result and of cycle.completed's fields (docs/design.md#tasks)
    assert list(cycle) == ["run_id", "as_of", "skipped", *COUNT_KEYS, "duration_ms", "paused"]
    assert list(phase) == ["run_id", "as_of", "skipped", *COUNT_KEYS, "paused"]


def test_a_phase_names_its_setting_label_and_count_once() -> None:
    """Every other spelling of a phase derives from its Phase (docs/design.md#glossary)."""
    for phase in PHASES.values():
        assert phase.setting in Settings.model_fields, phase
        assert isinstance(phase.window(Settings()), timedelta)
    for attribute in ("name", "label", "count_key", "setting"):
        values = [getattr(p, attribute) for p in PHASES.values()]
        assert len(set(values)) == len(values), attribute
    # its predicate is its one fragment of sql/queries.sql
    fragments = source().fragments
    for phase in PHASES.values():
        assert f"{phase.name}_selects" in fragments, phase.name


# -- a cycle against the session database ----------------------------------------


def test_a_cycle_tells_its_start_its_phases_in_order_and_its_end(
    settings: Settings, engine: Engine
) -> None:
    with engine.begin() as conn:
        f.conference(conn, idle=timedelta(minutes=5))
        f.conference(conn, status="Provisioning", age=timedelta(minutes=5))
        f.conference(conn, idle=timedelta(hours=5), participants=1)
    reaper, facts = reaper_on(settings, engine)
    result = reaper.run_cycle(T0)
    kinds = [
        type(fact)
        for fact in facts.facts
        if type(fact) in (CycleStarted, PhaseCompleted, PhaseFailed, CycleCompleted)
    ]
    assert kinds == [CycleStarted, *[PhaseCompleted] * len(ORDER), CycleCompleted]
    assert [p.phase for p in facts.of(PhaseCompleted)] == list(ORDER)
    assert {fact.run_id for fact in facts.facts if hasattr(fact, "run_id")} == {result["run_id"]}
    (finished,) = facts.of(CycleCompleted)
    assert finished.result == result and finished.errors == 0
    assert (
        result["empty_timeout_count"],
        result["provision_failed_count"],
        result["stale_timeout_count"],
    ) == (1, 1, 1)
    assert advisory_locks(engine) == 0


def test_a_cycle_runs_only_the_phases_it_is_given(settings: Settings, engine: Engine) -> None:
    with engine.begin() as conn:
        empty = f.conference(conn, idle=timedelta(minutes=5))
        stale = f.conference(conn, idle=timedelta(hours=5), participants=1)
    reaper, facts = reaper_on(settings, engine)
    result = reaper.run_cycle(T0, phases=["stale_live"])
    assert [p.phase for p in facts.of(PhaseCompleted)] == ["stale_live"]
    assert result["stale_timeout_count"] == 1 and result["empty_timeout_count"] == 0
    with engine.connect() as conn:
        assert f.statuses(conn)[empty["id"]] == ("Active", None)
        assert f.statuses(conn)[stale["id"]][0] == "Ended"


def test_a_cycle_that_cannot_reach_the_database_fails_and_says_why() -> None:
    dead = create_engine("postgresql+psycopg2://reaper@127.0.0.1:1/reaper")
    bus = Bus()
    facts = FactRecorder(bus)
    result = Reaper(Settings(), engine=dead, bus=bus).run_cycle()
    assert result["skipped"] is False
    assert all(result[key] == 0 for key in COUNT_KEYS)
    (finished,) = facts.of(CycleCompleted)
    assert finished.errors == 1 and finished.error and "127.0.0.1" in finished.error
    assert facts.of(CycleStarted) == [] and facts.of(PhaseCompleted) == []


def test_lock_held_elsewhere_makes_the_run_a_noop(settings, engine, caplog):
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5))
    with engine.connect() as other:
        other.execute(text(LOCK))
        pid = other.execute(text("SELECT pg_backend_pid()")).scalar()
        result = Reaper(settings, engine=engine).run_cycle(T0)
        other.execute(text(UNLOCK))
    assert result["skipped"] is True and result["empty_timeout_count"] == 0
    with engine.connect() as conn:
        assert f.statuses(conn) == {room["id"]: ("Active", None)} and f.outbox(conn) == []
    skipped = log_events(caplog, "cycle.skipped")
    assert skipped and all(e["holder_pid"] == pid for e in skipped)
    assert Reaper(settings, engine=engine).run_cycle(T0)["empty_timeout_count"] == 1


def test_a_second_cycle_while_the_first_owns_the_run_is_skipped_whole(
    settings: Settings, engine: Engine
) -> None:
    with engine.begin() as conn:
        f.conference(conn, idle=timedelta(minutes=5))
    first, _ = reaper_on(settings, engine)
    cycle = first.start(T0)
    assert cycle.owns_run
    second, facts = reaper_on(settings, engine)
    result = second.run_cycle(T0)
    assert result["skipped"] is True and result["empty_timeout_count"] == 0
    (skipped,) = facts.of(CycleSkipped)
    assert skipped.owner_run_id == cycle.run_id
    for name in ORDER:
        first.run_phase(name, cycle.run_id)
    assert first.finish(cycle.run_id)["empty_timeout_count"] == 1


def test_cycle_respects_max_run_duration_then_resumes(database_url, engine):
    settings = Settings(database_url=database_url, batch_size=10)
    with engine.begin() as conn:
        f.bulk_conferences(conn, 50)
    # every clock read advances 10 s: the 30 s budget is spent after a few batches
    first = Reaper(settings, engine=engine, clock=SteppingClock(10.0)).run_cycle(T0)
    assert 0 < first["empty_timeout_count"] < 50
    rest = Reaper(settings, engine=engine).run_cycle(T0)
    assert first["empty_timeout_count"] + rest["empty_timeout_count"] == 50


# -- a phase that fails, is interrupted, or finds its run gone ----------------------


def test_a_phase_of_a_run_no_longer_its_cycles_changes_nothing_and_says_so(
    settings: Settings, engine: Engine
) -> None:
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5))
    reaper, facts = reaper_on(settings, engine)
    cycle = reaper.start(T0)
    reaper.finish(cycle.run_id)  # the run ended: a late phase task finds it gone
    result = reaper.run_phase("empty_room", cycle.run_id)
    assert result["skipped"] is True and result["empty_timeout_count"] == 0
    (completed,) = facts.of(PhaseCompleted)
    assert completed.lost and completed.batches == 0
    with engine.connect() as conn:
        assert f.statuses(conn)[room["id"]] == ("Active", None)


def test_a_soft_time_limit_in_a_phase_fails_that_phase_and_the_cycle_goes_on(
    settings: Settings, engine: Engine
) -> None:
    """Celery's soft time limit is an Exception: the phase fails (counted, its
    lock freed) and the next phases run."""
    with engine.begin() as conn:
        f.conference(conn, idle=timedelta(hours=5), participants=1)
    limited = {"empty_room"}

    def clock() -> float:  # read once as each phase starts its drain
        if limited:
            limited.clear()
            raise SoftTimeLimitExceeded()
        return 0.0

    reaper, facts = reaper_on(settings, engine, clock=clock)
    result = reaper.run_cycle(T0)
    (failed,) = facts.of(PhaseFailed)
    assert failed.phase == "empty_room" and "SoftTimeLimitExceeded" in failed.error
    assert [p.phase for p in facts.of(PhaseCompleted)] == list(ORDER[1:])
    assert result["stale_timeout_count"] == 1
    (finished,) = facts.of(CycleCompleted)
    assert finished.errors == 1
    assert advisory_locks(engine) == 0


def test_a_base_exception_in_a_phase_frees_its_lock_now_and_is_raised(
    settings: Settings, engine: Engine
) -> None:
    """Not a lease later: the next cycle's phases can lock at once."""
    with engine.begin() as conn:
        f.conference(conn, idle=timedelta(minutes=5))

    def clock() -> float:
        raise Interrupted()

    reaper, facts = reaper_on(settings, engine, clock=clock)
    cycle = reaper.start(T0)
    with pytest.raises(Interrupted):
        reaper.run_phase("empty_room", cycle.run_id)
    assert advisory_locks(engine) == 0
    assert facts.of(PhaseCompleted) == [] and facts.of(PhaseFailed) == []
    # the same cycle goes on: its next phase takes the lock again
    reaper.clock = lambda: 0.0
    assert reaper.run_phase("empty_room", cycle.run_id)["empty_timeout_count"] == 1
