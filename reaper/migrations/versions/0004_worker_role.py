"""A least-privilege role for the worker: ``reaper_worker`` (NOLOGIN).

It holds exactly what the reaper and the outbox relay do on the five tables,
and nothing else: no DDL, no TRUNCATE, no DELETE of conferences, UPDATE only
of the columns a transition or a relay pass writes. Deployments create a
LOGIN role that is a member of it and put that role in REAPER_DATABASE_URL;
the migrations themselves run as the schema owner (``reaper migrate``).

A role belongs to the whole cluster: creating it is idempotent (several
databases of one cluster share it) and the downgrade only revokes this
database's grants, dropping the role when nothing else holds it.

Revision ID: 0004
Revises: 0003
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.1.0"
compatible_from = "0008"

ROLE = "reaper_worker"

CREATE_ROLE = f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{ROLE}') THEN
        CREATE ROLE {ROLE} NOLOGIN;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;  -- created meanwhile by a migration of another database
END
$$;
"""

GRANTS = f"""
GRANT USAGE ON SCHEMA messenger TO {ROLE};

-- phases: claim (FOR UPDATE), transition, close the roster
GRANT SELECT ON messenger.conference_sessions TO {ROLE};
GRANT UPDATE (status, end_reason, ended_at, updated_at, duration_seconds,
              active_participant_count)
    ON messenger.conference_sessions TO {ROLE};
GRANT SELECT ON messenger.conference_participants TO {ROLE};
GRANT UPDATE (left_at) ON messenger.conference_participants TO {ROLE};

-- recorder stop signals
GRANT SELECT ON messenger.call_recordings TO {ROLE};
GRANT UPDATE (stop_requested_at) ON messenger.call_recordings TO {ROLE};

-- outbox rows written with a transition; the relay marks, retries, expires them
GRANT SELECT, INSERT, DELETE ON messenger.integration_outbox TO {ROLE};
GRANT UPDATE (published_at, attempts, last_error, next_attempt_at)
    ON messenger.integration_outbox TO {ROLE};
GRANT SELECT, INSERT ON messenger.realtime_outbox TO {ROLE};
GRANT USAGE ON SEQUENCE messenger.integration_outbox_id_seq,
                        messenger.realtime_outbox_id_seq TO {ROLE};

GRANT EXECUTE ON FUNCTION messenger.rfc3339(timestamptz) TO {ROLE};
"""

REVOKES = f"""
REVOKE ALL ON messenger.conference_sessions, messenger.conference_participants,
              messenger.call_recordings, messenger.integration_outbox,
              messenger.realtime_outbox FROM {ROLE};
REVOKE ALL ON SEQUENCE messenger.integration_outbox_id_seq,
                       messenger.realtime_outbox_id_seq FROM {ROLE};
REVOKE ALL ON FUNCTION messenger.rfc3339(timestamptz) FROM {ROLE};
REVOKE ALL ON SCHEMA messenger FROM {ROLE};
DO $$
BEGIN
    DROP ROLE IF EXISTS {ROLE};
EXCEPTION WHEN dependent_objects_still_exist THEN
    NULL;  -- still granted in another database of this cluster, or has members
END
$$;
"""


def upgrade() -> None:
    op.execute(CREATE_ROLE)
    op.execute(GRANTS)


def downgrade() -> None:
    op.execute(REVOKES)
