"""Seeding helpers: rows as the messenger's commands would leave them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, RootTransaction, text

T0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)


def db_now(engine: Engine) -> datetime:
    """The database's clock, the reference of every cycle (docs/design.md#time)."""
    with engine.connect() as conn:
        return conn.execute(text("SELECT clock_timestamp()")).scalar_one()


def new_id() -> str:
    return str(uuid.uuid4())


def conference(
    conn: Connection,
    *,
    status: str = "Active",
    as_of: datetime = T0,
    idle: timedelta = timedelta(minutes=5),
    age: timedelta = timedelta(minutes=30),
    participants: int = 0,
    **overrides: Any,
) -> dict[str, Any]:
    """Insert one conference; ``idle`` is how long before ``as_of`` it last saw activity."""
    created_at = as_of - age
    row: dict[str, Any] = {
        "id": new_id(),
        "chat_id": new_id(),
        "deal_id": new_id(),
        "tenant_id": new_id(),
        "media_type": "Video",
        "status": status,
        "end_reason": None,
        "started_by_user_id": new_id(),
        "created_at": created_at,
        "started_at": None if status == "Provisioning" else created_at + timedelta(seconds=5),
        "ended_at": None,
        "last_activity_at": as_of - idle,
        "updated_at": as_of - idle,
        "active_participant_count": participants,
        "peak_participant_count": max(participants, 2),
        "duration_seconds": None,
    }
    row.update(overrides)
    conn.execute(
        text(
            """
            INSERT INTO messenger.conference_sessions
              (id, chat_id, deal_id, tenant_id, media_type, status, end_reason,
               started_by_user_id, created_at, started_at, ended_at, last_activity_at,
               updated_at, active_participant_count, peak_participant_count, duration_seconds)
            VALUES (:id, :chat_id, :deal_id, :tenant_id, :media_type, :status, :end_reason,
               :started_by_user_id, :created_at, :started_at, :ended_at, :last_activity_at,
               :updated_at, :active_participant_count, :peak_participant_count,
               :duration_seconds)
            """
        ),
        row,
    )
    return row


def participant(
    conn: Connection,
    conference_id: str,
    *,
    joined_at: datetime,
    left_at: datetime | None = None,
    user_id: str | None = None,
) -> dict[str, Any]:
    row = {
        "conference_id": conference_id,
        "user_id": user_id or new_id(),
        "joined_at": joined_at,
        "left_at": left_at,
    }
    row["id"] = conn.execute(
        text(
            """
            INSERT INTO messenger.conference_participants
              (conference_id, user_id, joined_at, left_at)
            VALUES (:conference_id, :user_id, :joined_at, :left_at) RETURNING id
            """
        ),
        row,
    ).scalar_one()
    return row


def recording(
    conn: Connection,
    conference_id: str,
    *,
    status: str = "Recording",
    # or a string PostgreSQL reads as a timestamp ('infinity': a poison row)
    created_at: datetime | str = T0 - timedelta(minutes=10),
) -> dict[str, Any]:
    row = {
        "id": new_id(),
        "conference_id": conference_id,
        "status": status,
        "created_at": created_at,
    }
    conn.execute(
        text(
            """
            INSERT INTO messenger.call_recordings
              (id, conference_id, status, created_at, updated_at)
            VALUES (:id, :conference_id, :status, :created_at, :created_at)
            """
        ),
        row,
    )
    return row


def session_row(conn: Connection, conference_id: str) -> dict[str, Any]:
    return dict(
        conn.execute(
            text("SELECT * FROM messenger.conference_sessions WHERE id = :id"),
            {"id": conference_id},
        )
        .mappings()
        .one()
    )


def session_row_status(engine: Engine, conference_id: str) -> str:
    with engine.connect() as conn:
        return session_row(conn, conference_id)["status"]


def outbox(conn: Connection) -> list[dict[str, Any]]:
    return [
        dict(r)
        for r in conn.execute(text("SELECT * FROM messenger.integration_outbox ORDER BY id"))
        .mappings()
        .all()
    ]


def realtime(conn: Connection) -> list[dict[str, Any]]:
    return [
        dict(r)
        for r in conn.execute(text("SELECT * FROM messenger.realtime_outbox ORDER BY id"))
        .mappings()
        .all()
    ]


def statuses(conn: Connection) -> dict[str, tuple[str, str | None]]:
    rows = conn.execute(text("SELECT id, status, end_reason FROM messenger.conference_sessions"))
    return {str(r.id): (r.status, r.end_reason) for r in rows}


def bulk_conferences(
    conn: Connection,
    count: int,
    *,
    status: str = "Active",
    as_of: datetime = T0,
    idle: timedelta = timedelta(minutes=5),
) -> None:
    """``count`` eligible-looking conferences in one statement (backlog tests)."""
    started = "NULL" if status == "Provisioning" else ":as_of - interval '1 hour'"
    conn.execute(
        text(
            f"""
            INSERT INTO messenger.conference_sessions
              (id, chat_id, deal_id, tenant_id, media_type, status, started_by_user_id,
               created_at, started_at, last_activity_at, updated_at,
               active_participant_count, peak_participant_count)
            SELECT gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
                   'Video', :status, gen_random_uuid(),
                   :as_of - interval '2 hours' - g * interval '1 millisecond', {started},
                   :as_of - :idle - g * interval '1 millisecond',
                   :as_of - :idle, 0, 2
            FROM generate_series(1, :count) g
            """
        ),
        {"status": status, "as_of": as_of, "idle": idle, "count": count},
    )


REFUSING_TRIGGER = """
CREATE TABLE messenger.test_refused (id uuid PRIMARY KEY);
CREATE FUNCTION messenger.test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM messenger.test_refused r WHERE r.id = NEW.id) THEN
        RAISE EXCEPTION 'conference % is frozen by the legal hold', NEW.id;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_refuse BEFORE UPDATE ON messenger.conference_sessions
FOR EACH ROW EXECUTE FUNCTION messenger.test_refuse();
"""


def refuse(conn: Connection, conference_id: str) -> None:
    """Under the refusing_database fixture: the database refuses this row's update."""
    conn.execute(text("INSERT INTO messenger.test_refused VALUES (:id)"), {"id": conference_id})


@contextmanager
def command_holding(
    engine: Engine, conference_id: str
) -> Iterator[tuple[Connection, RootTransaction]]:
    """A command's transaction holding a room's row lock (FOR UPDATE) until it
    commits or the block ends (then it rolls back)."""
    with _holding(engine, "conference_sessions", conference_id) as held:
        yield held


@contextmanager
def leave_holding(
    engine: Engine, participant_id: int
) -> Iterator[tuple[Connection, RootTransaction]]:
    """A "leave" command between its two statements: its participant row locked
    (FOR UPDATE), the room's update still to come."""
    with _holding(engine, "conference_participants", participant_id) as held:
        yield held


@contextmanager
def _holding(
    engine: Engine, table: str, row_id: object
) -> Iterator[tuple[Connection, RootTransaction]]:
    command = engine.connect()
    tx = command.begin()
    command.execute(
        text(f"SELECT 1 FROM messenger.{table} WHERE id = :id FOR UPDATE"), {"id": row_id}
    )
    try:
        yield command, tx
    finally:
        if tx.is_active:
            tx.rollback()
        command.close()
