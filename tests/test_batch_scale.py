"""Full batches of realistic rooms (rosters, recordings), on analyzed tables.

Small hand-made fixtures leave the planner on its default estimates; these
seed enough rows and ANALYZE so the phase statements run the plans they run in
production, where a per-row expression evaluated once per batch would show.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import text

from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.phases import ORDER
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.facts import log_events, log_records


def test_every_room_of_a_full_batch_gets_its_own_event(database_url, engine):
    settings = Settings(database_url=database_url, batch_size=200)
    with engine.begin() as conn:
        f.bulk_conferences(conn, 500)
        conn.execute(
            text(
                """
                INSERT INTO messenger.conference_participants
                    (conference_id, user_id, joined_at, left_at)
                SELECT s.id, gen_random_uuid(), s.started_at + k * interval '1 s',
                       CASE WHEN k = 1 THEN s.last_activity_at END
                FROM messenger.conference_sessions s CROSS JOIN generate_series(1, 2) k;
                INSERT INTO messenger.call_recordings (id, conference_id, status, created_at)
                SELECT gen_random_uuid(), s.id, 'Recording', s.started_at
                FROM messenger.conference_sessions s;
                ANALYZE messenger.conference_sessions, messenger.conference_participants,
                        messenger.call_recordings
                """
            )
        )
    result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["empty_timeout_count"] == 500 and result["failed_count"] == 0
    with engine.connect() as conn:
        events = f.outbox(conn)
        open_rows = conn.execute(
            text("SELECT count(*) FROM messenger.conference_participants WHERE left_at IS NULL")
        ).scalar()
    assert len({e["event_id"] for e in events}) == len(events) == 500
    assert all(str(e["event_id"]) == e["payload"]["eventId"] for e in events)
    assert len({e["payload"]["payload"]["conferenceId"] for e in events}) == 500
    assert all(len(e["payload"]["payload"]["participants"]) == 2 for e in events)
    assert all(e["payload"]["payload"]["wasRecorded"] for e in events)
    assert open_rows == 0


def test_two_lanes_count_only_the_rows_someone_else_holds(database_url, engine, caplog):
    """Lanes see each other's claimed rows as locked; only the command's row is skipped."""
    caplog.set_level(logging.INFO, "reaper")
    settings = Settings(database_url=database_url, batch_size=50, drain_lanes=2)
    with engine.begin() as conn:
        f.bulk_conferences(conn, 1_000)
        held = conn.execute(
            text(
                "SELECT id::text FROM messenger.conference_sessions"
                " ORDER BY last_activity_at LIMIT 1"
            )
        ).scalar_one()
    with f.command_holding(engine, held):
        result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["empty_timeout_count"] == 999
    assert result["skipped_locked_count"] == 1
    told = log_records(caplog, "batch.selected")
    threads = {r.threadName for r in told}
    assert threads == {"reaper-tell_0"}  # told on the helper thread
    with engine.connect() as conn:
        events = f.outbox(conn)
    assert len({e["payload"]["payload"]["conferenceId"] for e in events}) == 999
    assert held not in {e["payload"]["payload"]["conferenceId"] for e in events}
    again = Reaper(settings, engine=engine).run_cycle(T0)
    assert again["empty_timeout_count"] == 1 and again["skipped_locked_count"] == 0


def test_a_quiet_phase_is_one_statement_even_with_lanes(database_url, engine, caplog):
    caplog.set_level(logging.INFO, "reaper")
    settings = Settings(database_url=database_url, drain_lanes=4)
    with engine.begin() as conn:
        f.bulk_conferences(conn, 10, idle=timedelta(seconds=5))  # within the grace
    result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["empty_timeout_count"] == 0
    batches = log_events(caplog, "batch.selected")
    assert sorted(b["phase"] for b in batches) == sorted(ORDER)
