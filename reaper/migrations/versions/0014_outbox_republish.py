"""Expand: a lost conference-ended event put back, by an operator, on the record.

``reaper reconcile`` (docs/delivery.md) reads the rooms the reaper closed and
the events on Kafka and names each room whose event is lost: neither pending
in the outbox nor on the topic. ``reaper reconcile --republish`` puts each such
event back into ``messenger.integration_outbox`` through
``messenger.republish_outbox(target, topic, why, operator_name)``, and the
relay sends it as any other row (same key, the deal id, so it keeps its place
in the deal's order from then on).

The event is built again from the room as it is now, in the format the phase
statement writes (reaper/sql/queries.sql, end_active_batch): a closed room no
longer changes, so it says what the lost one said. ``occurredAt`` is the
room's ``ended_at`` (the closing run's ``as_of``); ``correlationId`` is that
run's id while ``messenger.reaper_runs`` still holds it, otherwise the new
event id. The event id is NEW: the lost one was random and lived only in the
outbox row and on Kafka, so it cannot be known once the row is gone and the
topic does not have it. Consumers are idempotent per conference; should the
lost event still arrive after all (it was in flight, not lost), the ledger
counts that conference as duplicated, which is what happened.

What the function refuses:

- a room that is not one the reaper ended (``Ended`` with ``EmptyTimeout`` or
  ``Timeout``): ``object_not_in_prerequisite_state``; an unknown id:
  ``no_data_found``. A ``Failed`` room has no integration event at all.
- a room whose event is still in the outbox (pending or parked: the relay or
  ``reaper outbox requeue`` will send it) or was discarded by an operator
  (``messenger.outbox_discards``: Kafka refuses it for good):
  ``object_not_in_prerequisite_state``.

Each event put back is kept in ``messenger.outbox_republishes``: which event,
which conference and closing, who (the name the command gives, and the
database login, ``session_user``), when (the database's clock) and why.

EXECUTE for ``reaper_operator`` only: a worker credential must not be able to
add events to the topic. The operator also reads ``realtime_outbox`` from now
on: the ledger checks each closing's push row.

Revision ID: 0014
Revises: 0013
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.5.0"
compatible_from = "0009"

UPGRADE = f"""
CREATE TABLE messenger.outbox_republishes (
    event_id uuid PRIMARY KEY,
    conference_id uuid NOT NULL,
    deal_id uuid NOT NULL,
    end_reason text NOT NULL,
    ended_at timestamptz NOT NULL,
    topic text NOT NULL,
    republished_at timestamptz NOT NULL DEFAULT now(),
    republished_by text NOT NULL,
    republished_login text NOT NULL DEFAULT session_user,
    reason text NOT NULL CONSTRAINT ck_outbox_republishes_reason CHECK (btrim(reason) <> '')
);
-- a room's republished events (the ledger and the runbook find them by room)
CREATE INDEX ix_outbox_republishes_conference ON messenger.outbox_republishes (conference_id);

CREATE FUNCTION messenger.republish_outbox(
    target uuid, topic text, why text, operator_name text)
RETURNS messenger.outbox_republishes
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    room messenger.conference_sessions;
    new_id uuid := gen_random_uuid();
    run text;
    done messenger.outbox_republishes;
BEGIN
    IF why IS NULL OR btrim(why) = '' THEN
        RAISE EXCEPTION 'a republish needs a reason' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF operator_name IS NULL OR btrim(operator_name) = '' THEN
        RAISE EXCEPTION 'a republish needs the operator''s name'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF topic IS NULL OR btrim(topic) = '' THEN
        RAISE EXCEPTION 'a republish needs the topic' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- FOR SHARE: two operators republishing the same room wait for each other,
    -- and the second then finds the first one's row in the outbox.
    SELECT * INTO room FROM messenger.conference_sessions s WHERE s.id = target FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no conference %', target USING ERRCODE = 'no_data_found';
    END IF;
    IF room.status IS DISTINCT FROM 'Ended'
       OR room.end_reason NOT IN ('EmptyTimeout', 'Timeout') THEN
        RAISE EXCEPTION 'conference % is %/%, not ended by the reaper: it has no event to '
            'republish', target, room.status, room.end_reason
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF EXISTS (SELECT FROM messenger.integration_outbox o
               WHERE o.published_at IS NULL
                 AND o.payload->'payload'->>'conferenceId' = target::text) THEN
        RAISE EXCEPTION 'the event of conference % is still in the outbox (pending or parked): '
            'the relay or reaper outbox requeue sends it', target
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF EXISTS (SELECT FROM messenger.outbox_discards d
               WHERE d.message_key = room.deal_id::text
                 AND d.payload->'payload'->>'conferenceId' = target::text) THEN
        RAISE EXCEPTION 'the event of conference % was discarded by an operator '
            '(messenger.outbox_discards): not republished', target
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    SELECT r.run_id INTO run FROM messenger.reaper_runs r
    WHERE r.as_of = room.ended_at ORDER BY r.started_at LIMIT 1;

    -- The format of end_active_batch (reaper/sql/queries.sql), from the closed room.
    INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload, created_at)
    SELECT new_id, btrim(topic), room.deal_id::text,
           jsonb_build_object(
               'eventId', new_id,
               'eventType', 'pin.messenger.conference-ended.v1',
               'occurredAt', messenger.rfc3339(room.ended_at),
               'correlationId', coalesce(run, new_id::text),
               'aggregateId', room.deal_id,
               'payload', jsonb_build_object(
                   'conferenceId', room.id,
                   'chatId', room.chat_id,
                   'dealId', room.deal_id,
                   'tenantId', room.tenant_id,
                   'mediaType', room.media_type,
                   'status', room.status,
                   'endReason', room.end_reason,
                   'startedByUserId', room.started_by_user_id,
                   'startedAt', messenger.rfc3339(room.started_at),
                   'endedAt', messenger.rfc3339(room.ended_at),
                   'durationSeconds', room.duration_seconds,
                   'peakParticipantCount', room.peak_participant_count,
                   'participants', coalesce(roster.list, '[]'::jsonb),
                   'participantsOmitted', coalesce(roster.omitted, 0),
                   'wasRecorded', rec.latest_id IS NOT NULL,
                   'recordingId', rec.latest_id)),
           now()
    FROM (SELECT (array_agg(r.id ORDER BY r.created_at DESC, r.id DESC))[1] AS latest_id
          FROM messenger.call_recordings r WHERE r.conference_id = room.id) rec,
         (SELECT jsonb_agg(jsonb_build_object(
                     'userId', p.user_id,
                     'joinedAt', messenger.rfc3339(p.joined_at),
                     'leftAt', messenger.rfc3339(
                         coalesce(p.left_at, greatest(room.ended_at, p.joined_at))))
                 ORDER BY p.joined_at, p.id) FILTER (WHERE p.n <= 20000) AS list,
                 greatest(count(*) - 20000, 0) AS omitted
          FROM (SELECT p.*, row_number() OVER (ORDER BY p.joined_at, p.id) AS n
                FROM messenger.conference_participants p
                WHERE p.conference_id = room.id) p) roster;

    INSERT INTO messenger.outbox_republishes
        (event_id, conference_id, deal_id, end_reason, ended_at, topic, republished_at,
         republished_by, republished_login, reason)
    VALUES (new_id, room.id, room.deal_id, room.end_reason, room.ended_at, btrim(topic),
            clock_timestamp(), btrim(operator_name), session_user, btrim(why))
    RETURNING * INTO done;
    RETURN done;
END
$$;
REVOKE ALL ON FUNCTION messenger.republish_outbox(uuid, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION messenger.republish_outbox(uuid, text, text, text) TO reaper_operator;

GRANT SELECT ON messenger.outbox_republishes TO reaper_operator, reaper_worker;
-- the ledger (reaper reconcile) checks each closing's push row
GRANT SELECT ON messenger.realtime_outbox TO reaper_operator;

INSERT INTO messenger.reaper_migrations (revision, kind, release, compatible_from)
VALUES ('{revision}', '{kind}', '{release}', '{compatible_from}');
"""

DOWNGRADE = f"""
DELETE FROM messenger.reaper_migrations WHERE revision = '{revision}';
REVOKE SELECT ON messenger.realtime_outbox FROM reaper_operator;
DROP FUNCTION messenger.republish_outbox(uuid, text, text, text);
DROP TABLE messenger.outbox_republishes;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
