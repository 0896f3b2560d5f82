"""The messenger conference schema the reaper works on (docs/design.md#tables).

Revision ID: 0001
Revises:
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.1.0"
compatible_from = "0008"

UPGRADE = """
CREATE SCHEMA IF NOT EXISTS messenger;

CREATE TABLE messenger.conference_sessions (
    id uuid PRIMARY KEY,
    chat_id uuid NOT NULL,
    deal_id uuid NOT NULL,
    tenant_id uuid NOT NULL,
    media_type text NOT NULL CONSTRAINT ck_conf_media_type CHECK (media_type IN ('Audio', 'Video')),
    status text NOT NULL
        CONSTRAINT ck_conf_status CHECK (status IN ('Provisioning', 'Active', 'Ended', 'Failed')),
    end_reason text CONSTRAINT ck_conf_end_reason
        CHECK (end_reason IN ('Normal', 'EmptyTimeout', 'Timeout', 'Error')),
    started_by_user_id uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    ended_at timestamptz,
    last_activity_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    active_participant_count int NOT NULL DEFAULT 0
        CONSTRAINT ck_conf_active_count CHECK (active_participant_count >= 0),
    peak_participant_count int NOT NULL DEFAULT 0
        CONSTRAINT ck_conf_peak_count CHECK (peak_participant_count >= 0),
    duration_seconds int CONSTRAINT ck_conf_duration CHECK (duration_seconds >= 0),
    -- a terminal row always says why and when it ended; a live one never does
    CONSTRAINT ck_conf_terminal CHECK (
        (status IN ('Ended', 'Failed')) = (end_reason IS NOT NULL AND ended_at IS NOT NULL)
    )
);

-- The reaper's only way into the table: live rows, oldest activity first
-- (empty_room, stale_live). Terminal history is never scanned.
CREATE INDEX ix_conf_active ON messenger.conference_sessions (status, last_activity_at)
    WHERE status IN ('Provisioning', 'Active');
-- provision_timeout orders by created_at, which ix_conf_active cannot give.
CREATE INDEX ix_conf_provisioning ON messenger.conference_sessions (created_at)
    WHERE status = 'Provisioning';

CREATE TABLE messenger.conference_participants (
    id bigserial PRIMARY KEY,
    conference_id uuid NOT NULL REFERENCES messenger.conference_sessions (id) ON DELETE CASCADE,
    user_id uuid NOT NULL,
    joined_at timestamptz NOT NULL,
    left_at timestamptz,
    CONSTRAINT ck_participant_interval CHECK (left_at IS NULL OR left_at >= joined_at)
);
CREATE INDEX ix_participants_conference ON messenger.conference_participants (conference_id);

CREATE TABLE messenger.call_recordings (
    id uuid PRIMARY KEY,
    conference_id uuid NOT NULL REFERENCES messenger.conference_sessions (id) ON DELETE CASCADE,
    status text NOT NULL CONSTRAINT ck_recording_status
        CHECK (status IN ('Pending', 'Recording', 'Uploading', 'Available', 'Failed')),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    stop_requested_at timestamptz
);
CREATE INDEX ix_recordings_conference ON messenger.call_recordings (conference_id, created_at);

CREATE TABLE messenger.integration_outbox (
    id bigserial PRIMARY KEY,
    event_id uuid NOT NULL CONSTRAINT uq_integration_outbox_event_id UNIQUE,
    topic text NOT NULL,
    message_key text NOT NULL,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    attempts int NOT NULL DEFAULT 0,
    last_error text
);
CREATE INDEX ix_integration_outbox_pending ON messenger.integration_outbox (id)
    WHERE published_at IS NULL;

CREATE TABLE messenger.realtime_outbox (
    id bigserial PRIMARY KEY,
    kind text NOT NULL CONSTRAINT ck_realtime_kind
        CHECK (kind IN ('ConferenceEnded', 'ConferenceSignal')),
    target_kind text NOT NULL CONSTRAINT ck_realtime_target CHECK (target_kind IN ('ChatGroup')),
    chat_id uuid NOT NULL,
    session_kind text NOT NULL
        CONSTRAINT ck_realtime_session CHECK (session_kind IN ('Conference')),
    conference_id uuid NOT NULL,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    dispatched_at timestamptz
);
CREATE INDEX ix_realtime_outbox_pending ON messenger.realtime_outbox (id)
    WHERE dispatched_at IS NULL;

-- RFC 3339 in UTC, fractional seconds only when there are any.
CREATE FUNCTION messenger.rfc3339(ts timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT to_char(ts AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
        || CASE WHEN date_part('microseconds', ts)::int % 1000000 = 0 THEN ''
                ELSE rtrim(to_char(ts AT TIME ZONE 'UTC', '.US'), '0') END
        || 'Z'
$$;
"""

DOWNGRADE = """
DROP FUNCTION messenger.rfc3339(timestamptz);
DROP TABLE messenger.realtime_outbox;
DROP TABLE messenger.integration_outbox;
DROP TABLE messenger.call_recordings;
DROP TABLE messenger.conference_participants;
DROP TABLE messenger.conference_sessions;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
