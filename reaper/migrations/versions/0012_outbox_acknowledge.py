"""Expand: the relay removes a row at its Kafka acknowledgement.

Until 0.3.0 the relay marked each acknowledged row published (an UPDATE of
``published_at``, a column in the pending indexes' predicates, so never a HOT
update): every event left a dead row version and new index entries behind, and
retention deleted the row again later. From 0.4.0 on the relay deletes the row
in the transaction that claimed it, through ``messenger.acknowledge_outbox``: a
definer function, since ``reaper_worker`` has no DELETE on the table (0011),
that deletes only the rows named that are still pending (neither published nor
parked). The worker could always mark any pending row published, which takes
it out of delivery as surely; the function gives it no more than that.

The 0.3.0 relay beside this release keeps marking rows published, and
retention (``messenger.delete_published_outbox``) keeps deleting those: both
forms of a sent row are understood by both releases.

``messenger.oldest_snapshot_age_seconds()``: what holds the outbox's dead rows
(``messenger_outbox_oldest_snapshot_age_seconds``). A transaction that holds a
snapshot (a long report, a session idle in transaction) keeps every row version
deleted after it began, however often vacuum runs. PostgreSQL shows any login
that another session holds a snapshot (``backend_xmin``), but since when
(``xact_start``) only to members of ``pg_read_all_stats``, which would also show
the worker every other session's query text. This definer function returns
one number, the age of the oldest transaction of this database holding a
snapshot: the worker learns that and nothing else. It sees what its owner (the
role that ran the migration) may see, so that owner must be a superuser or a
member of ``pg_read_all_stats``; otherwise the function returns NULL
(unknown), never a figure that leaves other roles' sessions out.

The table's autovacuum settings: a queue table churns its whole content, so
the cluster's default (a vacuum after 20 % of the table is dead) lets it bloat
to many times its live size. Vacuum after a fixed number of dead rows instead,
and without the cost delay. ``ALTER TABLE ... SET`` of these takes only a
SHARE UPDATE EXCLUSIVE lock: the relay and the writers go on meanwhile.

Revision ID: 0012
Revises: 0011
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.4.0"
compatible_from = "0009"

UPGRADE = f"""
CREATE FUNCTION messenger.acknowledge_outbox(ids bigint[])
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    deleted int;
BEGIN
    -- Pending, written so that it implies no partial index's predicate: the rows
    -- are reached by their ids (the primary key). As "published_at IS NULL AND
    -- parked_at IS NULL", on the statistics of a table analyzed empty (right
    -- after an incident's burst) the planner walked the whole pending index
    -- of (message_key, id) and filtered it by id (tests/test_relay_plans.py).
    DELETE FROM messenger.integration_outbox
    WHERE id = ANY (ids) AND coalesce(published_at, parked_at) IS NULL;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;
REVOKE ALL ON FUNCTION messenger.acknowledge_outbox(bigint[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION messenger.acknowledge_outbox(bigint[]) TO reaper_worker;

CREATE FUNCTION messenger.oldest_snapshot_age_seconds()
RETURNS double precision
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    -- client sessions of this database other than the caller; an autovacuum
    -- worker's snapshot holds back no other vacuum
    SELECT CASE WHEN pg_catalog.pg_has_role('pg_read_all_stats', 'USAGE') THEN
        coalesce(max(extract(epoch FROM pg_catalog.clock_timestamp() - a.xact_start)), 0)
    END::double precision
    FROM pg_catalog.pg_stat_activity a
    WHERE a.datname = pg_catalog.current_database() AND a.pid <> pg_catalog.pg_backend_pid()
      AND a.backend_type = 'client backend'
      AND a.backend_xmin IS NOT NULL AND a.xact_start IS NOT NULL
$$;
REVOKE ALL ON FUNCTION messenger.oldest_snapshot_age_seconds() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION messenger.oldest_snapshot_age_seconds() TO reaper_worker;

ALTER TABLE messenger.integration_outbox SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0
);

INSERT INTO messenger.reaper_migrations (revision, kind, release, compatible_from)
VALUES ('{revision}', '{kind}', '{release}', '{compatible_from}');
"""

DOWNGRADE = f"""
DELETE FROM messenger.reaper_migrations WHERE revision = '{revision}';
ALTER TABLE messenger.integration_outbox RESET (
    autovacuum_vacuum_scale_factor,
    autovacuum_vacuum_threshold,
    autovacuum_vacuum_insert_scale_factor,
    autovacuum_vacuum_insert_threshold,
    autovacuum_vacuum_cost_delay
);
DROP FUNCTION messenger.oldest_snapshot_age_seconds();
DROP FUNCTION messenger.acknowledge_outbox(bigint[]);
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
