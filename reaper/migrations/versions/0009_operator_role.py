"""Two roles, each with what it needs and nothing more (docs/design.md#roles).

``reaper_worker`` (migration 0004) runs cycles, the relay, the stop signals and
retention. From here it only reads the pauses and the tenant policies (0008
let it change them, because the operator's commands shared its role), and it
no longer deletes outbox rows itself: retention goes through
``messenger.delete_published_outbox``, a definer function that deletes only
published rows older than the retention, which may not be under an hour.
A stolen worker password can neither steer the reaper nor delete an event that
is still to be sent.

``reaper_operator`` (new, NOLOGIN) is what ``reaper pause``, ``resume``,
``policy``, ``outbox parked|requeue``, ``status`` and ``plan`` need: it reads
what those commands show, changes the pauses and the tenant policies, and puts
parked outbox rows back to pending. It cannot change a conference.

Logins are members of one role, created by whoever deploys (README
"Deployment"); the migrations run as the schema owner. Roles belong to the
whole cluster: created idempotently, dropped by the downgrade only when no
other database still grants them anything.

Revision ID: 0009
Revises: 0008
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

OPERATOR = "reaper_operator"

CREATE_OPERATOR = f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{OPERATOR}') THEN
        CREATE ROLE {OPERATOR} NOLOGIN;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;  -- created meanwhile by a migration of another database
END
$$;
"""

UPGRADE = f"""
-- The worker reads the operator's controls and never writes them.
REVOKE INSERT, UPDATE, DELETE ON messenger.reaper_pauses, messenger.reaper_tenant_policies
    FROM reaper_worker;

-- Retention without DELETE on the table: published rows only, older than the
-- retention by the database's clock, and a retention under an hour is refused
-- (REAPER_OUTBOX_RETENTION has the same floor). Runs as the owner (SECURITY
-- DEFINER), so its search_path is fixed and every name qualified.
REVOKE DELETE ON messenger.integration_outbox FROM reaper_worker;
CREATE FUNCTION messenger.delete_published_outbox(retention interval, batch_size int)
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    deleted int;
BEGIN
    IF retention IS NULL OR retention < interval '1 hour' THEN
        RAISE EXCEPTION 'published outbox rows are kept at least an hour (retention %)',
            retention USING ERRCODE = 'insufficient_privilege';
    END IF;
    DELETE FROM messenger.integration_outbox
    WHERE id IN (
        SELECT id
        FROM messenger.integration_outbox
        WHERE published_at IS NOT NULL AND published_at < clock_timestamp() - retention
        ORDER BY published_at
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;
REVOKE ALL ON FUNCTION messenger.delete_published_outbox(interval, int) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION messenger.delete_published_outbox(interval, int) TO reaper_worker;

GRANT USAGE ON SCHEMA messenger TO {OPERATOR};
-- reaper status and plan: the census, the candidates, the runs, the outbox counts
GRANT SELECT ON messenger.conference_sessions, messenger.reaper_runs,
                messenger.integration_outbox TO {OPERATOR};
-- reaper pause / resume / policy
GRANT SELECT, INSERT, UPDATE, DELETE ON messenger.reaper_pauses,
    messenger.reaper_tenant_policies TO {OPERATOR};
-- reaper outbox requeue: a parked row back to pending, nothing else of it
GRANT UPDATE (parked_at, attempts, next_attempt_at) ON messenger.integration_outbox
    TO {OPERATOR};
"""

DOWNGRADE = f"""
REVOKE ALL ON messenger.conference_sessions, messenger.reaper_runs,
              messenger.integration_outbox, messenger.reaper_pauses,
              messenger.reaper_tenant_policies FROM {OPERATOR};
REVOKE ALL ON SCHEMA messenger FROM {OPERATOR};
DO $$
BEGIN
    DROP ROLE IF EXISTS {OPERATOR};
EXCEPTION WHEN dependent_objects_still_exist THEN
    NULL;  -- still granted in another database of this cluster
END
$$;

DROP FUNCTION messenger.delete_published_outbox(interval, int);
GRANT DELETE ON messenger.integration_outbox TO reaper_worker;
GRANT INSERT, UPDATE, DELETE ON messenger.reaper_pauses, messenger.reaper_tenant_policies
    TO reaper_worker;
"""


def upgrade() -> None:
    op.execute(CREATE_OPERATOR)
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
