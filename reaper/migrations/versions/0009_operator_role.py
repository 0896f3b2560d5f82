"""Two roles, each with what it needs and nothing more (docs/design.md#roles):
the expand part.

``reaper_operator`` (new, NOLOGIN) is what ``reaper pause``, ``resume``,
``policy``, ``outbox parked|requeue``, ``status`` and ``plan`` need: it reads
what those commands show, changes the pauses and the tenant policies, and puts
parked outbox rows back to pending. It cannot change a conference.

``messenger.delete_published_outbox`` lets ``reaper_worker`` keep retention
without DELETE on the table: a definer function that deletes only published
rows older than the retention, which may not be under an hour.

Released in 0.2.0, this migration also took from ``reaper_worker`` the rights
the release before it still used (DELETE on ``integration_outbox``, the writes
of the control tables): the 0.1.0 workers of a rolling deploy then failed
every relay pass. Those revokes are now the contract migration 0011, applied
by ``reaper migrate --contract`` once no worker of the older release runs; a
database that ran the 0.2.0 text of this migration already has them, and 0011
changes nothing there.

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

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.2.0"
compatible_from = "0008"

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
-- Retention without DELETE on the table: published rows only, older than the
-- retention by the database's clock, and a retention under an hour is refused
-- (REAPER_OUTBOX_RETENTION has the same floor). Runs as the owner (SECURITY
-- DEFINER), so its search_path is fixed and every name qualified. (The DELETE
-- the worker had is taken by the contract migration 0011.)
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
"""


def upgrade() -> None:
    op.execute(CREATE_OPERATOR)
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
