"""Expand: a way out for an outbox event Kafka will never accept.

A parked row holds back the later events of its deal until it is requeued
(docs/design.md#parked-events). A record Kafka refuses for good (too large for
any limit the operators will set, rejected as invalid) is parked again at every
requeue, so it holds them for ever. ``messenger.discard_outbox(target, why,
operator_name)`` moves such a row, in one statement, from the outbox into
``messenger.outbox_discards``, which keeps what it was (topic, key, payload,
when written and parked, attempts, last error) and who discarded it, when and
why. Its deal's later events are then claimed as if it had been sent.

Only a parked row is discarded: a pending one is still being tried (the
function refuses it, ``object_not_in_prerequisite_state``), an unknown id is
refused too (``no_data_found``). A definer function, since no role has DELETE
on the outbox; EXECUTE for ``reaper_operator`` only: a worker credential must
not be able to drop an event unseen. ``discarded_by`` is the name the command
gives (REAPER_OPERATOR, else the OS user, as every operator control records);
``discarded_login`` is the database login that called it (``session_user``,
which the caller cannot choose).

Both roles read the table: the operator to find a payload again, the worker
to count its rows (``messenger_outbox_discarded``). The worker could read the
same payloads while they were in the outbox.

Revision ID: 0013
Revises: 0012
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.4.0"
compatible_from = "0009"

UPGRADE = f"""
CREATE TABLE messenger.outbox_discards (
    event_id uuid PRIMARY KEY,
    topic text NOT NULL,
    message_key text NOT NULL,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL,
    parked_at timestamptz NOT NULL,
    attempts int NOT NULL,
    last_error text,
    discarded_at timestamptz NOT NULL DEFAULT now(),
    discarded_by text NOT NULL,
    discarded_login text NOT NULL DEFAULT session_user,
    reason text NOT NULL CONSTRAINT ck_outbox_discards_reason CHECK (btrim(reason) <> '')
);
-- a deal's discarded events (the runbook finds them by deal)
CREATE INDEX ix_outbox_discards_message_key ON messenger.outbox_discards (message_key);

CREATE FUNCTION messenger.discard_outbox(target uuid, why text, operator_name text)
RETURNS messenger.outbox_discards
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    discarded messenger.outbox_discards;
BEGIN
    IF why IS NULL OR btrim(why) = '' THEN
        RAISE EXCEPTION 'a discard needs a reason' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF operator_name IS NULL OR btrim(operator_name) = '' THEN
        RAISE EXCEPTION 'a discard needs the operator''s name'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- One statement: the row leaves the outbox and is kept here, or neither.
    -- Only a parked row: a pending one is still being tried, a published one
    -- (a 0.3.0 relay's) is on Kafka already.
    WITH gone AS (
        DELETE FROM messenger.integration_outbox
        WHERE event_id = target AND parked_at IS NOT NULL AND published_at IS NULL
        RETURNING event_id, topic, message_key, payload, created_at, parked_at, attempts,
                  last_error
    )
    INSERT INTO messenger.outbox_discards
        (event_id, topic, message_key, payload, created_at, parked_at, attempts, last_error,
         discarded_at, discarded_by, discarded_login, reason)
    SELECT g.event_id, g.topic, g.message_key, g.payload, g.created_at, g.parked_at,
           g.attempts, g.last_error, clock_timestamp(), btrim(operator_name), session_user,
           btrim(why)
    FROM gone g
    RETURNING * INTO discarded;
    IF discarded.event_id IS NULL THEN
        IF EXISTS (SELECT FROM messenger.integration_outbox
                   WHERE event_id = target AND published_at IS NOT NULL) THEN
            RAISE EXCEPTION 'outbox event % was published: nothing to discard', target
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
        IF EXISTS (SELECT FROM messenger.integration_outbox WHERE event_id = target) THEN
            RAISE EXCEPTION 'outbox event % is still pending (the relay keeps trying it): '
                'only a parked event can be discarded; wait until it is parked', target
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
        RAISE EXCEPTION 'no outbox event %', target USING ERRCODE = 'no_data_found';
    END IF;
    RETURN discarded;
END
$$;
REVOKE ALL ON FUNCTION messenger.discard_outbox(uuid, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION messenger.discard_outbox(uuid, text, text) TO reaper_operator;

GRANT SELECT ON messenger.outbox_discards TO reaper_operator, reaper_worker;

INSERT INTO messenger.reaper_migrations (revision, kind, release, compatible_from)
VALUES ('{revision}', '{kind}', '{release}', '{compatible_from}');
"""

DOWNGRADE = f"""
DELETE FROM messenger.reaper_migrations WHERE revision = '{revision}';
DROP FUNCTION messenger.discard_outbox(uuid, text, text);
DROP TABLE messenger.outbox_discards;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
