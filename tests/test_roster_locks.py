"""A command holding a roster row (docs/design.md#lock-order): the batch never
waits on it and never deadlocks with it; the room is skipped, the rest closes."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text

from reaper import budgets, cycle, phases
from reaper.cycle import Reaper
from reaper.events import CycleResult
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.figures import figure
from tests.support.processes import run_cli
from tests.support.services import wait_until

ROOMS = 50
# every room here is stale on purpose: not the mass-closure guard's business
UNGUARDED = {"mass_closure_share": 1.0}


def stale_rooms(engine: Engine, as_of=T0) -> list[dict[str, Any]]:
    """Stale Active rooms, each with one participant still inside."""
    rooms = []
    with engine.begin() as conn:
        for _ in range(ROOMS):
            room = f.conference(conn, as_of=as_of, idle=timedelta(hours=5), participants=1)
            room["participant"] = f.participant(
                conn, room["id"], joined_at=as_of - timedelta(hours=6)
            )["id"]
            rooms.append(room)
    return rooms


def statuses(engine: Engine, rooms: list[dict[str, Any]]) -> dict[str, str]:
    with engine.connect() as conn:
        return {r["id"]: f.session_row(conn, r["id"])["status"] for r in rooms}


def test_a_held_roster_row_skips_its_room_and_the_rest_closes_at_once(settings, engine):
    settings = settings.model_copy(update=UNGUARDED)
    rooms = stale_rooms(engine)
    held = rooms[0]
    with f.leave_holding(engine, held["participant"]):
        started = time.monotonic()
        result = Reaper(settings, engine=engine).run_cycle(T0)
        took = time.monotonic() - started
        closed = statuses(engine, rooms)
    # A batch that waited on the held row would wait out its lock_timeout (the
    # batch's statement budget) and fail the phase: the cycle ends well before.
    assert took < budgets.batch(settings).statement.total_seconds() / 2, took
    assert result["stale_timeout_count"] == ROOMS - 1
    assert result["skipped_locked_count"] == 1 and result["failed_count"] == 0
    assert closed[held["id"]] == "Active"
    assert sum(status == "Ended" for status in closed.values()) == ROOMS - 1
    later = Reaper(settings, engine=engine).run_cycle(T0)  # the command let go
    assert later["stale_timeout_count"] == 1
    with engine.connect() as conn:
        assert f.session_row(conn, held["id"])["status"] == "Ended"
        open_rows = conn.execute(
            text("SELECT count(*) FROM messenger.conference_participants WHERE left_at IS NULL")
        ).scalar_one()
    assert open_rows == 0


def test_a_held_room_does_not_end_its_phase_early(settings, engine):
    """Batches of one: the held room is claimed first (the oldest), yet the phase
    goes on to the others, once each, and counts it once."""
    rooms = stale_rooms(engine)
    oldest = min(rooms, key=lambda r: r["last_activity_at"])
    settings = settings.model_copy(update={"batch_size": 1, **UNGUARDED})
    with f.leave_holding(engine, oldest["participant"]):
        result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["stale_timeout_count"] == ROOMS - 1
    assert result["skipped_locked_count"] == 1


def test_a_leave_that_then_updates_its_room_goes_through(settings, engine, monkeypatch):
    """The command holds its participant row, then updates its room while the
    cycle's batch holds that room (claimed, its roster row skipped): the command
    waits on the batch, the batch never on the command, no deadlock; the other
    rooms close. The overlap is forced: the first batch stops before its commit
    until the command is seen waiting on it in pg_locks."""
    settings = settings.model_copy(update=UNGUARDED)
    rooms = stale_rooms(engine)
    held = rooms[0]
    results: list[CycleResult] = []
    batch_open = threading.Event()
    go_on = threading.Event()
    real_batch = phases.reap_batch  # what reaper.cycle calls

    def batch_held_open(*args: Any, **kwargs: Any) -> Any:
        effect = real_batch(*args, **kwargs)  # the statement ran: its rows are locked
        if held["id"] in effect.held and not batch_open.is_set():  # it holds the room
            batch_open.set()
            assert go_on.wait(30), "the test never let the batch commit"
        return effect

    monkeypatch.setattr(cycle, "reap_batch", batch_held_open)
    waited: list[float] = []
    with f.leave_holding(engine, held["participant"]) as (command, tx):
        command_pid = command.execute(text("SELECT pg_backend_pid()")).scalar_one()

        def leave() -> None:
            command.execute(
                text(
                    "UPDATE messenger.conference_participants SET left_at = :t WHERE id = :id;"
                    " UPDATE messenger.conference_sessions SET active_participant_count = 0,"
                    " last_activity_at = :t, updated_at = :t WHERE id = :room"
                ),
                {"t": T0, "id": held["participant"], "room": held["id"]},
            )
            tx.commit()
            waited.append(time.monotonic() - released[0])

        cycle_thread = threading.Thread(
            target=lambda: results.append(Reaper(settings, engine=engine).run_cycle(T0))
        )
        cycle_thread.start()
        assert batch_open.wait(30), "the cycle's first batch never ran"
        released = [0.0]
        command_thread = threading.Thread(target=leave)
        command_thread.start()

        def command_blocked() -> bool:
            with engine.connect() as conn:
                return bool(
                    conn.execute(
                        text("SELECT cardinality(pg_blocking_pids(:pid)) > 0"), {"pid": command_pid}
                    ).scalar_one()
                )

        try:
            wait_until(command_blocked, 30, "the command waiting on the open batch")
        finally:
            released[0] = time.monotonic()
            go_on.set()
        command_thread.join(timeout=30)
        cycle_thread.join(timeout=30)
    assert not cycle_thread.is_alive() and not command_thread.is_alive()
    # The command waited for the batch it met to commit, never for the phase: a
    # lane's transaction sits idle no longer than the batch budget's idle bound.
    [took] = waited
    assert took < budgets.batch(settings).idle.total_seconds(), took
    [result] = results
    assert result["stale_timeout_count"] == ROOMS - 1 and result["failed_count"] == 0
    closed = statuses(engine, rooms)
    assert closed[held["id"]] == "Active"  # the user's command decided, not the reaper
    assert sum(status == "Ended" for status in closed.values()) == ROOMS - 1


@pytest.mark.process
def test_reap_once_beside_a_held_roster_row_ends_in_seconds(settings, engine):
    rooms = stale_rooms(engine, as_of=f.db_now(engine))
    with f.leave_holding(engine, rooms[0]["participant"]):
        started = time.monotonic()
        done = run_cli(
            "reap", "--once", "--json", env={"REAPER_MASS_CLOSURE_SHARE": "1"}, timeout=60
        )
        took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["stale_timeout_count"] == ROOMS - 1 and result["skipped_locked_count"] == 1
    # Waiting on the held row would last the batch's lock_timeout (its statement
    # budget, REAPER_MAX_RUN_DURATION by default) and then fail the phase; the
    # process (its start, imports and exit included) ends in a third of it.
    assert took < budgets.batch(settings).statement.total_seconds() / 3, took
    figure(
        f"reap --once beside a held roster row: {took:.2f}s for the whole process, "
        f"{ROOMS - 1} of {ROOMS} rooms closed, the held one skipped (before: 30.6 s, the "
        "phase failed on its statement timeout and closed none)"
    )
