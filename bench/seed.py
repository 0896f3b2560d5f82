"""Seeding of the benchmark's own database, set-based (INSERT ... SELECT generate_series).

History (finished rooms) is written once. The eligible rooms are kept as a copy
in the ``bench`` schema, so every drain run starts from the very same rows:
:func:`reset_eligible` deletes the previous run's rooms (and their outbox rows)
and inserts the copy again, then vacuums and analyzes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg2
from sqlalchemy import create_engine, make_url, text

from reaper.db import migrate

SESSION_COLUMNS = (
    "id, chat_id, deal_id, tenant_id, media_type, status, end_reason, started_by_user_id,"
    " created_at, started_at, ended_at, last_activity_at, updated_at,"
    " active_participant_count, peak_participant_count, duration_seconds"
)

HISTORY_SESSIONS = f"""
INSERT INTO messenger.conference_sessions ({SESSION_COLUMNS})
SELECT md5('h' || g)::uuid, md5('hc' || g)::uuid, md5('hd' || g)::uuid,
       md5('ht' || (mod(g, 500)))::uuid,
       CASE WHEN mod(g, 3) = 0 THEN 'Audio' ELSE 'Video' END,
       CASE WHEN mod(g, 10) = 0 THEN 'Failed' ELSE 'Ended' END,
       CASE WHEN mod(g, 10) = 0 THEN 'Error' WHEN mod(g, 10) IN (1, 2) THEN 'EmptyTimeout'
            WHEN mod(g, 10) = 3 THEN 'Timeout' ELSE 'Normal' END,
       md5('hu' || g)::uuid,
       t, CASE WHEN mod(g, 10) = 0 THEN NULL ELSE t + interval '5 s' END,
       t + interval '30 min', t + interval '30 min', t + interval '30 min',
       0, 2 + mod(g, 5), CASE WHEN mod(g, 10) = 0 THEN NULL ELSE 1795 END
FROM generate_series(%(first)s, %(last)s) g
CROSS JOIN LATERAL (
    SELECT CAST(%(as_of)s AS timestamptz) - interval '1 day' - g * interval '2 s' AS t
) x
"""

# Healthy live rooms (people in, recent activity): in the partial index, never
# eligible; they keep the mass-closure guard's share of Active rooms realistic.
LIVE_SESSIONS = f"""
INSERT INTO messenger.conference_sessions ({SESSION_COLUMNS})
SELECT md5('l' || g)::uuid, md5('lc' || g)::uuid, md5('ld' || g)::uuid,
       md5('lt' || mod(g, 500))::uuid, 'Video', 'Active', NULL, md5('lu' || g)::uuid,
       t - interval '20 min', t - interval '20 min', NULL,
       -- active within the last minute of as_of: inside every window
       t - mod(g, 60) * interval '1 s', t, 2, 3, NULL
FROM generate_series(%(first)s, %(last)s) g
CROSS JOIN LATERAL (SELECT CAST(%(as_of)s AS timestamptz) AS t) x
"""

HISTORY_PARTICIPANTS = """
INSERT INTO messenger.conference_participants (conference_id, user_id, joined_at, left_at)
SELECT md5('h' || g)::uuid, md5('hp' || g || '-' || k)::uuid,
       t + k * interval '1 min', t + interval '30 min'
FROM generate_series(%(first)s, %(last)s) g
CROSS JOIN generate_series(1, 2) k
CROSS JOIN LATERAL (
    SELECT CAST(%(as_of)s AS timestamptz) - interval '1 day' - g * interval '2 s' AS t
) x
"""

HISTORY_RECORDINGS = """
INSERT INTO messenger.call_recordings (id, conference_id, status, created_at, updated_at)
SELECT md5('hr' || g)::uuid, md5('h' || g)::uuid, 'Available', t, t
FROM generate_series(%(first)s, %(last)s) g
CROSS JOIN LATERAL (
    SELECT CAST(%(as_of)s AS timestamptz) - interval '1 day' - g * interval '2 s' AS t
) x
WHERE mod(g, 10) = 1
"""

# The eligible mix, by mod(g, 10): 0-3 empty rooms (Active, nobody in, idle minutes),
# 4-6 stuck provisioning, 7-9 stale live rooms (Active, people "in", idle hours).
# Every fifth non-provisioning room has a running recording.
ELIGIBLE_SEED = """
DROP SCHEMA IF EXISTS bench CASCADE;
CREATE SCHEMA bench;
CREATE TABLE bench.sessions AS
SELECT md5('e' || g)::uuid AS id, md5('ec' || g)::uuid AS chat_id,
       md5('ed' || g)::uuid AS deal_id, md5('et' || (mod(g, 500)))::uuid AS tenant_id,
       CASE WHEN mod(g, 3) = 0 THEN 'Audio' ELSE 'Video' END AS media_type,
       CASE WHEN mod(g, 10) BETWEEN 4 AND 6 THEN 'Provisioning' ELSE 'Active' END AS status,
       NULL::text AS end_reason, md5('eu' || g)::uuid AS started_by_user_id,
       created_at,
       CASE WHEN mod(g, 10) BETWEEN 4 AND 6 THEN NULL ELSE created_at + interval '5 s' END
           AS started_at,
       NULL::timestamptz AS ended_at, last_activity_at, last_activity_at AS updated_at,
       CASE WHEN mod(g, 10) >= 7 THEN 2 ELSE 0 END AS active_participant_count,
       2 + mod(g, 3) AS peak_participant_count, NULL::int AS duration_seconds,
       g
FROM generate_series(1, %(count)s) g
CROSS JOIN LATERAL (
    SELECT CASE WHEN mod(g, 10) <= 3 THEN as_of - interval '1 hour' - g * interval '10 ms'
                WHEN mod(g, 10) <= 6 THEN as_of - interval '3 min' - g * interval '10 ms'
                ELSE as_of - interval '6 hours' - g * interval '10 ms' END AS created_at,
           CASE WHEN mod(g, 10) <= 3 THEN as_of - interval '3 min' - g * interval '10 ms'
                WHEN mod(g, 10) <= 6 THEN as_of - interval '3 min' - g * interval '10 ms'
                ELSE as_of - interval '5 hours' - g * interval '10 ms' END AS last_activity_at
    FROM (SELECT CAST(%(as_of)s AS timestamptz) AS as_of) a
) x;
CREATE TABLE bench.participants AS
SELECT s.id AS conference_id, md5('ep' || s.g || '-' || k)::uuid AS user_id,
       s.created_at + k * interval '1 s' AS joined_at,
       CASE WHEN mod(s.g, 10) <= 3 AND k = 1 THEN s.last_activity_at END AS left_at
FROM bench.sessions s
CROSS JOIN generate_series(1, 2) k
WHERE mod(s.g, 10) NOT BETWEEN 4 AND 6 OR k = 1;
CREATE TABLE bench.recordings AS
SELECT md5('er' || s.g)::uuid AS id, s.id AS conference_id, 'Recording'::text AS status,
       s.created_at + interval '10 s' AS created_at
FROM bench.sessions s
WHERE mod(s.g, 5) = 0 AND s.status = 'Active';
"""

# Tenant policies (docs/design.md#windows-per-tenant), so that the drain and the
# quiet cycle are measured with them. The first 500 are the tenants of the
# eligible rooms, with windows shorter and longer than the defaults that still
# leave every seeded room eligible at the bench's as_of (empty rooms idle 3 min
# or more: grace 30 s or 150 s; provisioning for 3 min or more: 60 s or 170 s;
# stale for 5 h or more: 1 h, 2 h or 4 h 30 min), so the reaper and the
# baseline (which knows nothing of policies) still do the same work; the
# shortest windows widen every phase's index range. The others are tenants of
# the live rooms and tenants without rooms, with longer windows (up to 7 days).
# Windows as seconds, as `reaper policy set` stores them.
POLICIES = """
INSERT INTO messenger.reaper_tenant_windows
    (tenant_id, phase, window_length, updated_at, updated_by)
SELECT p.tenant_id, w.phase, w.window_length, p.updated_at, p.updated_by
FROM (
SELECT t.tenant,
       make_interval(secs => CASE mod(g, 3) WHEN 0 THEN t.short_grace WHEN 1 THEN t.long_grace END),
       make_interval(secs => CASE mod(g, 4) WHEN 0 THEN t.short_provision
                                            WHEN 1 THEN t.long_provision END),
       make_interval(secs => CASE WHEN mod(g, 5) = 0 THEN t.short_stale
                                  WHEN mod(g, 5) = 1 THEN t.long_stale
                                  WHEN mod(g, 3) = 2 AND mod(g, 4) >= 2 THEN t.other_stale END),
       now(), 'bench'
FROM generate_series(1, %(count)s) g
CROSS JOIN LATERAL (
    SELECT CASE WHEN g <= 500 THEN md5('et' || (g - 1))::uuid
                WHEN g <= 1000 THEN md5('lt' || (g - 501))::uuid
                ELSE md5('pt' || g)::uuid END AS tenant,
           CASE WHEN g <= 500 THEN 30 ELSE 600 END AS short_grace,
           CASE WHEN g <= 500 THEN 150 ELSE 3600 END AS long_grace,
           CASE WHEN g <= 500 THEN 60 ELSE 600 END AS short_provision,
           CASE WHEN g <= 500 THEN 170 ELSE 86400 END AS long_provision,
           CASE WHEN g <= 500 THEN 3600 ELSE 6 * 3600 END AS short_stale,
           CASE WHEN g <= 500 THEN 4.5 * 3600 ELSE 7 * 86400 END AS long_stale,
           CASE WHEN g <= 500 THEN 2 * 3600 ELSE 12 * 3600 END AS other_stale
) t
) AS p (tenant_id, empty_room_grace, provision_timeout, stale_live_timeout, updated_at, updated_by)
-- a policy row of 0.4.0's shape, one window row per phase it sets
CROSS JOIN LATERAL (VALUES ('empty_room', p.empty_room_grace),
                           ('provision_timeout', p.provision_timeout),
                           ('stale_live', p.stale_live_timeout)) AS w (phase, window_length)
WHERE w.window_length IS NOT NULL
"""

# The eligible rooms taken out (``{outboxes}`` emptied), without the triggers of
# the foreign keys; then, with PUT_IN, back exactly as seeded.
TAKE_OUT = """
SET session_replication_role = replica;
TRUNCATE {outboxes} RESTART IDENTITY;
DELETE FROM messenger.conference_participants
    WHERE conference_id IN (SELECT id FROM bench.sessions);
DELETE FROM messenger.call_recordings WHERE conference_id IN (SELECT id FROM bench.sessions);
DELETE FROM messenger.conference_sessions WHERE id IN (SELECT id FROM bench.sessions);
"""
PUT_IN = f"""
INSERT INTO messenger.conference_sessions ({SESSION_COLUMNS})
    SELECT {SESSION_COLUMNS} FROM bench.sessions ORDER BY g;
INSERT INTO messenger.conference_participants (conference_id, user_id, joined_at, left_at)
    SELECT conference_id, user_id, joined_at, left_at FROM bench.participants;
INSERT INTO messenger.call_recordings (id, conference_id, status, created_at, updated_at)
    SELECT id, conference_id, status, created_at, created_at FROM bench.recordings;
"""
BOTH_OUTBOXES = "messenger.integration_outbox, messenger.realtime_outbox"
TRIGGERS_BACK = "SET session_replication_role = DEFAULT;"
RESET_ELIGIBLE = TAKE_OUT.format(outboxes=BOTH_OUTBOXES) + PUT_IN + TRIGGERS_BACK
CLEAR_ELIGIBLE = TAKE_OUT.format(outboxes=BOTH_OUTBOXES) + TRIGGERS_BACK

TABLES = (
    "messenger.conference_sessions",
    "messenger.conference_participants",
    "messenger.call_recordings",
    "messenger.integration_outbox",
    "messenger.realtime_outbox",
    "messenger.reaper_tenant_windows",
)


def dsn(url: str) -> str:
    """A libpq URL for psycopg2 from the SQLAlchemy one."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def connect(url: str) -> psycopg2.extensions.connection:
    return psycopg2.connect(dsn(url), application_name="reaper-bench")


def one_row(cur: psycopg2.extensions.cursor) -> tuple[Any, ...]:
    """The row of a statement that always returns one (a count, a function's result)."""
    row: tuple[Any, ...] | None = cur.fetchone()
    if row is None:
        raise RuntimeError(f"no row from {cur.query!r}")
    return row


def execute(url: str, sql: str, params: Any = None, *, autocommit: bool = False) -> None:
    """``sql`` (one statement or several) in a transaction on a connection of its own;
    ``autocommit``: outside any transaction, as VACUUM must run."""
    conn = connect(url)
    conn.autocommit = autocommit
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params)
        conn.commit()
    finally:
        conn.close()


def one(url: str, sql: str, params: Any = None) -> tuple[Any, ...]:
    """The one row ``sql`` returns (its last statement's, with several), on a
    connection of its own."""
    conn = connect(url)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(sql, params)
            return one_row(cur)
    finally:
        conn.close()


def recreate(url: str) -> None:
    """Drop and create the bench database, then migrate it with reaper.db.migrate."""
    target = make_url(url)
    name = target.database
    if not name or not name.startswith("reaper_bench"):
        raise SystemExit(f"refusing to recreate {name!r}: bench databases are named reaper_bench*")
    admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()
    migrate(url)


def drop(url: str) -> None:
    target = make_url(url)
    admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{target.database}" WITH (FORCE)'))
    admin.dispose()


def vacuum(url: str, tables: tuple[str, ...] = TABLES) -> None:
    execute(url, f"VACUUM (ANALYZE) {', '.join(tables)}", autocommit=True)


def seed_history(
    url: str, count: int, as_of: datetime, live: int = 0, chunk: int = 250_000
) -> None:
    """``count`` finished rooms, two closed roster rows each, a recording on every tenth;
    ``live`` healthy live rooms."""
    conn = connect(url)
    with conn, conn.cursor() as cur:
        cur.execute("SET session_replication_role = replica")  # no FK triggers for the seed
        seed_live_rooms(cur, live, as_of, chunk)
        for first in range(1, count + 1, chunk):
            params = {"first": first, "last": min(count, first + chunk - 1), "as_of": as_of}
            for statement in (HISTORY_SESSIONS, HISTORY_PARTICIPANTS, HISTORY_RECORDINGS):
                cur.execute(statement, params)
    conn.close()
    vacuum(url)


def seed_live_rooms(
    cur: psycopg2.extensions.cursor, count: int, as_of: datetime, chunk: int = 250_000
) -> None:
    for first in range(1, count + 1, chunk):
        params = {"first": first, "last": min(count, first + chunk - 1), "as_of": as_of}
        cur.execute(LIVE_SESSIONS, params)


def seed_live(url: str, count: int, as_of: datetime) -> None:
    """``count`` live rooms (Active, occupied, recently active) and no history."""
    conn = connect(url)
    with conn, conn.cursor() as cur:
        seed_live_rooms(cur, count, as_of)
    conn.close()
    vacuum(url)


def seed_policies(url: str, count: int) -> None:
    """``count`` tenant policies (see POLICIES)."""
    execute(url, POLICIES, {"count": count})
    vacuum(url)


def seed_eligible(url: str, count: int, as_of: datetime) -> None:
    execute(url, ELIGIBLE_SEED, {"count": count, "as_of": as_of})


def reset_eligible(url: str) -> None:
    """Put the eligible rooms back exactly as seeded; empty both outboxes."""
    execute(url, RESET_ELIGIBLE)
    vacuum(url)


def clear_eligible(url: str) -> None:
    execute(url, CLEAR_ELIGIBLE)
    vacuum(url)
