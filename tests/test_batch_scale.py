"""Full batches of realistic rooms (rosters, recordings), on analyzed tables.

Small hand-made fixtures leave the planner on its default estimates; these
seed enough rows and ANALYZE so the phase statements run the plans they run in
production, where a per-row expression evaluated once per batch would show.
"""

from __future__ import annotations

from sqlalchemy import text

from reaper.config import Settings
from reaper.cycle import Reaper
from tests import factory as f
from tests.factory import T0


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
    result = Reaper(settings, engine=engine, clock=lambda: T0).run_cycle(T0)
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
