"""The race with users: sessions join, leave and end rooms as the messenger's
commands do (row lock on the conference, then the roster and the counters)
while reap cycles run back to back.

Invariants, checked after every seeded schedule:
- the reaper never ended a room while a participant had joined and not left
  at its commit: it never closed an open roster row, and every user's leave
  of a room it ended came at least EmptyRoomGrace before its ended_at;
- no room ended twice: exactly one integration event and one realtime row per
  Ended room (users' end-conference writes them too), none for live rooms;
- a live room's active_participant_count equals its open roster rows.

Default: 40 seeded schedules; ``REAPER_SOAK=1``: 400.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Connection, Engine, create_engine, text

from reaper.config import Settings
from reaper.cycle import Reaper
from tests.conftest import clean
from tests.support import factory as f
from tests.support.figures import figure
from tests.support.ledger import assert_clean

SOAK = os.environ.get("REAPER_SOAK") == "1"
SCHEDULES = 400 if SOAK else 40
GRACE = timedelta(milliseconds=50)

# -- the messenger's commands, as it would run them -------------------------

LOCK_ROOM = text("SELECT status FROM messenger.conference_sessions WHERE id = :id FOR UPDATE")
JOIN = text(
    """
    WITH p AS (
        INSERT INTO messenger.conference_participants (conference_id, user_id, joined_at)
        VALUES (:id, gen_random_uuid(), clock_timestamp()) RETURNING id
    )
    UPDATE messenger.conference_sessions
    SET active_participant_count = active_participant_count + 1,
        peak_participant_count = greatest(peak_participant_count, active_participant_count + 1),
        last_activity_at = clock_timestamp(), updated_at = clock_timestamp()
    WHERE id = :id
    RETURNING (SELECT id FROM p)
    """
)
PICK_OPEN = text(
    """
    SELECT id FROM messenger.conference_participants
    WHERE conference_id = :id AND left_at IS NULL
    ORDER BY id LIMIT 1 FOR UPDATE
    """
)
LEAVE = text(
    """
    WITH p AS (
        UPDATE messenger.conference_participants SET left_at = clock_timestamp()
        WHERE id = :pid RETURNING id, left_at
    ), a AS (
        INSERT INTO race_audit (participant_id, action, at) SELECT id, 'leave', left_at FROM p
    )
    -- the leave's own moment: an unreferenced CTE runs after the main UPDATE, so
    -- clock_timestamp() here was a few microseconds before left_at, and a cycle
    -- at that edge looked like a close inside the grace
    UPDATE messenger.conference_sessions
    SET active_participant_count = active_participant_count - 1,
        last_activity_at = (SELECT left_at FROM p), updated_at = clock_timestamp()
    WHERE id = :id
    """
)
END = text(
    """
    WITH s AS (
        UPDATE messenger.conference_sessions
        SET status = 'Ended', end_reason = 'Normal', ended_at = clock_timestamp(),
            updated_at = clock_timestamp(), active_participant_count = 0,
            duration_seconds = floor(extract(epoch FROM clock_timestamp() - started_at))::int
        WHERE id = :id AND status = 'Active'
        RETURNING id, chat_id, deal_id, ended_at
    ), p AS (
        UPDATE messenger.conference_participants SET left_at = clock_timestamp()
        WHERE conference_id = :id AND left_at IS NULL RETURNING id, left_at
    ), a AS (
        INSERT INTO race_audit (participant_id, action, at) SELECT id, 'end', left_at FROM p
    ), i AS (
        INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload)
        SELECT e.id, 'pin.messenger.conference-ended.v1', s.deal_id::text,
               -- the fields the ledger compares with the room (reaper/ledger.py)
               jsonb_build_object('eventId', e.id, 'payload', jsonb_build_object(
                   'conferenceId', s.id, 'dealId', s.deal_id, 'status', 'Ended',
                   'endReason', 'Normal', 'endedAt', messenger.rfc3339(s.ended_at)))
        FROM s CROSS JOIN (SELECT gen_random_uuid() AS id) e
    )
    INSERT INTO messenger.realtime_outbox
        (kind, target_kind, chat_id, session_kind, conference_id, payload)
    SELECT 'ConferenceEnded', 'ChatGroup', s.chat_id, 'Conference', s.id,
           jsonb_build_object('conferenceId', s.id, 'signal', 'Ended')
    FROM s
    """
)

# -- the invariants ----------------------------------------------------------

REAPER_CLOSED_AN_OPEN_ROW = text(
    """
    SELECT s.id, p.id AS participant
    FROM messenger.conference_sessions s
    JOIN messenger.conference_participants p ON p.conference_id = s.id
    WHERE s.end_reason IN ('EmptyTimeout', 'Timeout')
      AND NOT EXISTS (SELECT 1 FROM race_audit a WHERE a.participant_id = p.id)
    """
)
LEFT_INSIDE_GRACE = text(
    """
    SELECT s.id, max(a.at) AS last_leave, s.ended_at
    FROM messenger.conference_sessions s
    JOIN messenger.conference_participants p ON p.conference_id = s.id
    JOIN race_audit a ON a.participant_id = p.id
    WHERE s.end_reason IN ('EmptyTimeout', 'Timeout')
    GROUP BY s.id, s.ended_at
    HAVING max(a.at) > s.ended_at - CAST(:grace AS interval)
    """
)
COUNT_DRIFT = text(
    """
    SELECT s.id FROM messenger.conference_sessions s
    WHERE s.status = 'Active' AND s.active_participant_count <> (
        SELECT count(*) FROM messenger.conference_participants p
        WHERE p.conference_id = s.id AND p.left_at IS NULL)
    """
)
JOINED_AFTER_END = text(
    """
    SELECT p.id FROM messenger.conference_participants p
    JOIN messenger.conference_sessions s ON s.id = p.conference_id
    WHERE s.ended_at IS NOT NULL AND p.joined_at > s.ended_at
    """
)


@pytest.fixture
def db(database_url: str) -> Iterator[Engine]:
    engine = create_engine(
        database_url, pool_size=8, connect_args={"application_name": "race-users"}
    )
    with engine.begin() as conn:
        clean(conn)
        conn.execute(text("DROP TABLE IF EXISTS race_audit"))
        conn.execute(
            text("CREATE TABLE race_audit (participant_id bigint, action text, at timestamptz)")
        )
    yield engine
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS race_audit"))
    engine.dispose()


def command(engine: Engine, rng: random.Random, rooms: list[str], tally: Counter) -> None:
    room = rng.choice(rooms)
    action = rng.choices(["join", "leave", "end"], weights=[12, 12, 1])[0]
    with engine.begin() as conn:
        status = conn.execute(LOCK_ROOM, {"id": room}).scalar_one()
        time.sleep(rng.uniform(0, 0.004))  # hold the row lock a moment, as real commands do
        if status != "Active":
            tally[f"{action} refused: room {status}"] += 1
            return
        if action == "join":
            conn.execute(JOIN, {"id": room})
        elif action == "leave":
            pid = conn.execute(PICK_OPEN, {"id": room}).scalar()
            if pid is None:
                tally["leave: nobody in the room"] += 1
                return
            conn.execute(LEAVE, {"id": room, "pid": pid})
        else:
            conn.execute(END, {"id": room})
        tally[action] += 1


def seed_rooms(conn: Connection, rng: random.Random, count: int) -> list[str]:
    rooms = []
    for _ in range(count):
        row = f.conference(conn, as_of=f.T0, idle=timedelta(0))
        # make it live now: started a while ago, last activity now
        conn.execute(
            text(
                "UPDATE messenger.conference_sessions SET last_activity_at = clock_timestamp(),"
                " created_at = now() - interval '1 hour', started_at = now() - interval '1 hour'"
                " WHERE id = :id"
            ),
            {"id": row["id"]},
        )
        for _ in range(rng.randint(0, 2)):
            conn.execute(JOIN, {"id": row["id"]})
        rooms.append(row["id"])
    return rooms


def run_schedule(
    db: Engine, reaper: Reaper, schedule: int, tally: Counter, totals: Counter
) -> None:
    """One seeded schedule: 4 user sessions and a back-to-back reaper on a few rooms."""
    rng = random.Random(schedule)
    with db.begin() as conn:
        rooms = seed_rooms(conn, rng, rng.randint(2, 6))
    stop = threading.Event()
    errors: list[BaseException] = []

    def reap_loop() -> None:
        try:
            while not stop.is_set():
                result = reaper.run_cycle()
                totals["cycles"] += 1
                totals["reaped"] += result["empty_timeout_count"]
                totals["skipped_locked"] += result["skipped_locked_count"]
                time.sleep(0.001)
        except BaseException as exc:
            errors.append(exc)

    def user(seed: int) -> None:
        user_rng = random.Random(seed)
        try:
            for _ in range(user_rng.randint(10, 25)):
                command(db, user_rng, rooms, tally)
                time.sleep(user_rng.expovariate(1 / 0.015))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reap_loop)]
    threads += [threading.Thread(target=user, args=(schedule * 100 + u,)) for u in range(4)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not errors, errors


@pytest.mark.soak
def test_race_with_users(db, database_url):
    settings = Settings(
        database_url=database_url,
        empty_room_grace=GRACE,
        stale_live_timeout=timedelta(hours=1),
        provision_timeout=timedelta(hours=1),
        batch_size=3,
        lock_ttl=timedelta(seconds=10),
        run_lease=timedelta(seconds=3),
        max_run_duration=timedelta(seconds=5),
    )
    reaper = Reaper(settings, engine=db)
    tally: Counter = Counter()
    totals: Counter = Counter()
    for schedule in range(SCHEDULES):
        run_schedule(db, reaper, schedule, tally, totals)
        with db.connect() as conn:
            assert conn.execute(REAPER_CLOSED_AN_OPEN_ROW).all() == [], f"schedule {schedule}"
            late = conn.execute(LEFT_INSIDE_GRACE, {"grace": f"{GRACE.total_seconds()} s"}).all()
            assert late == [], f"schedule {schedule}: {late}"
            assert conn.execute(COUNT_DRIFT).all() == [], f"schedule {schedule}"
            assert conn.execute(JOINED_AFTER_END).all() == [], f"schedule {schedule}"
            assert_clean(db)
            ended = conn.execute(
                text(
                    "SELECT end_reason, count(*) FROM messenger.conference_sessions"
                    " WHERE status = 'Ended' GROUP BY 1"
                )
            ).all()
        for reason, n in ended:
            totals[f"ended {reason}"] += n
        with db.begin() as conn:
            conn.execute(
                text(
                    "TRUNCATE messenger.realtime_outbox, messenger.integration_outbox,"
                    " messenger.call_recordings, messenger.conference_participants,"
                    " messenger.conference_sessions, race_audit"
                )
            )

    commands = sum(v for k, v in tally.items())
    assert totals["ended EmptyTimeout"] > 0 and totals["ended Normal"] > 0, dict(totals)
    assert tally["join refused: room Ended"] > 0  # users did lose races to the reaper
    figure(
        f"race with users: {SCHEDULES} seeded schedules (4 user sessions + a "
        f"back-to-back reaper each), {commands} commands {dict(sorted(tally.items()))}; "
        f"{totals['cycles']} reap cycles, {totals['ended EmptyTimeout']} rooms reaped, "
        f"{totals['ended Normal']} ended by users, {totals['skipped_locked']} rows skipped "
        f"while a command held them; violations 0"
    )
