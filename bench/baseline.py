"""The drain baseline: one hand-written set-based statement per batch, psycopg2, a loop.

The same transitions, roster updates and outbox rows (same payloads) as the
reaper's phases, and nothing else: no run lock, no statement bounds, no
poison/locked/stop reporting, no logs.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta

from bench.seed import connect, one_row

# The integration payload, exactly as docs/design.md#the-kafka-event (and the reaper) write it.
_INTEGRATION = """
integration AS (
    INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload, created_at)
    SELECT e.event_id, %(topic)s, e.deal_id::text,
           jsonb_build_object(
               'eventId', e.event_id,
               'eventType', 'pin.messenger.conference-ended.v1',
               'occurredAt', messenger.rfc3339(%(as_of)s),
               'correlationId', %(run_id)s,
               'aggregateId', e.deal_id,
               'payload', jsonb_build_object(
                   'conferenceId', e.id, 'chatId', e.chat_id, 'dealId', e.deal_id,
                   'tenantId', e.tenant_id, 'mediaType', e.media_type, 'status', e.status,
                   'endReason', e.end_reason, 'startedByUserId', e.started_by_user_id,
                   'startedAt', messenger.rfc3339(e.started_at),
                   'endedAt', messenger.rfc3339(e.ended_at),
                   'durationSeconds', e.duration_seconds,
                   'peakParticipantCount', e.peak_participant_count,
                   'participants', coalesce(ros.list, '[]'::jsonb),
                   'participantsOmitted', coalesce(ros.omitted, 0),
                   'wasRecorded', rec.id IS NOT NULL,
                   'recordingId', rec.id)),
           now()
    FROM (SELECT ended.*, gen_random_uuid() AS event_id FROM ended) e
    LEFT JOIN LATERAL (
        SELECT jsonb_agg(jsonb_build_object(
                   'userId', p.user_id,
                   'joinedAt', messenger.rfc3339(p.joined_at),
                   'leftAt', messenger.rfc3339(
                       coalesce(p.left_at, greatest(%(as_of)s, p.joined_at))))
               ORDER BY p.joined_at, p.id) FILTER (WHERE p.n <= 20000) AS list,
               greatest(count(*) - 20000, 0) AS omitted
        FROM (SELECT p.*, row_number() OVER (ORDER BY p.joined_at, p.id) AS n
              FROM messenger.conference_participants p
              WHERE p.conference_id = e.id) p
    ) ros ON true
    LEFT JOIN LATERAL (
        SELECT r.id FROM messenger.call_recordings r
        WHERE r.conference_id = e.id
        ORDER BY r.created_at DESC, r.id DESC
        LIMIT 1
    ) rec ON true
)"""

END_ACTIVE = f"""
WITH claimed AS (
    SELECT id FROM messenger.conference_sessions
    WHERE status = 'Active' AND last_activity_at <= %(cutoff)s {{empty}}
    ORDER BY last_activity_at
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
),
ended AS (
    UPDATE messenger.conference_sessions s
    SET status = 'Ended', end_reason = %(end_reason)s, ended_at = %(as_of)s,
        updated_at = %(as_of)s, active_participant_count = 0,
        duration_seconds = floor(extract(epoch FROM %(as_of)s - s.started_at))::int
    FROM claimed
    WHERE s.id = claimed.id
    RETURNING s.*
),
roster AS (
    UPDATE messenger.conference_participants p
    SET left_at = greatest(%(as_of)s, p.joined_at)
    FROM ended
    WHERE p.conference_id = ended.id AND p.left_at IS NULL
),
{_INTEGRATION},
realtime AS (
    INSERT INTO messenger.realtime_outbox
        (kind, target_kind, chat_id, session_kind, conference_id, payload, created_at)
    SELECT 'ConferenceEnded', 'ChatGroup', e.chat_id, 'Conference', e.id,
           jsonb_build_object('conferenceId', e.id, 'chatId', e.chat_id, 'status', e.status,
                              'endReason', e.end_reason, 'signal', 'Ended'),
           now()
    FROM ended e
)
SELECT count(*) FROM ended
"""

FAIL_PROVISIONING = """
WITH claimed AS (
    SELECT id FROM messenger.conference_sessions
    WHERE status = 'Provisioning' AND created_at <= %(cutoff)s
    ORDER BY created_at
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
),
failed AS (
    UPDATE messenger.conference_sessions s
    SET status = 'Failed', end_reason = 'Error', ended_at = %(as_of)s, updated_at = %(as_of)s,
        active_participant_count = 0
    FROM claimed
    WHERE s.id = claimed.id
    RETURNING s.id, s.chat_id, s.status, s.end_reason
),
roster AS (
    UPDATE messenger.conference_participants p
    SET left_at = greatest(%(as_of)s, p.joined_at)
    FROM failed
    WHERE p.conference_id = failed.id AND p.left_at IS NULL
),
realtime AS (
    INSERT INTO messenger.realtime_outbox
        (kind, target_kind, chat_id, session_kind, conference_id, payload, created_at)
    SELECT 'ConferenceSignal', 'ChatGroup', f.chat_id, 'Conference', f.id,
           jsonb_build_object('conferenceId', f.id, 'chatId', f.chat_id, 'status', f.status,
                              'endReason', f.end_reason, 'signal', 'Failed'),
           now()
    FROM failed f
)
SELECT count(*) FROM failed
"""

# (name, statement, window, end reason) in the reaper's phase order.
PHASES = (
    (
        "empty_room",
        END_ACTIVE.format(empty="AND active_participant_count = 0"),
        timedelta(seconds=90),
        "EmptyTimeout",
    ),
    ("provision_timeout", FAIL_PROVISIONING, timedelta(seconds=120), "Error"),
    ("stale_live", END_ACTIVE.format(empty=""), timedelta(hours=4), "Timeout"),
)


def drain(url: str, as_of: datetime, batch_size: int, topic: str) -> tuple[dict[str, int], float]:
    """Run every phase's statement in a loop until a batch comes back short."""
    run_id = str(uuid.uuid4())
    counts: dict[str, int] = {}
    conn = connect(url)
    started = time.perf_counter()
    with conn.cursor() as cur:
        for name, statement, window, reason in PHASES:
            params = {
                "as_of": as_of,
                "cutoff": as_of - window,
                "batch_size": batch_size,
                "end_reason": reason,
                "run_id": run_id,
                "topic": topic,
            }
            total = 0
            while True:
                cur.execute(statement, params)
                (done,) = one_row(cur)
                conn.commit()
                total += done
                if done < batch_size:
                    break
            counts[name] = total
    elapsed = time.perf_counter() - started
    conn.close()
    return counts, elapsed
