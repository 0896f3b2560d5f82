"""Expand: a tenant's windows as rows, one per phase; a phase a worker does not know.

``messenger.reaper_tenant_windows`` holds one row per tenant and phase: the
tenant's own window for that phase, which replaces the phase's default for its
conferences (``reaper policy``). A new phase's windows then need no column.
It is backfilled from ``messenger.reaper_tenant_policies`` (0008, one column
per phase), which the release before this one (0.4.0) still reads and writes:
until the contract migration 0016 drops it, triggers keep the two in step
both ways, for the three phases that table has columns for. A write to either
is seen in the other within its own transaction, so a 0.4.0 worker and a
0.5.0 one beside it give a tenant the same windows.

``messenger.reaper_runs.unknown_phases``: the phases a run's chain named that
the worker which received them did not know (a newer release's phases, in a
rolling deploy); that worker goes on with the chain without them.

``messenger.reaper_pauses`` no longer lists the phases in a check
(``ck_reaper_pauses_phase``): the reaper checks a phase's name against its
own list, and a new phase then needs no change of the table (dropping a check
takes nothing from the release before).

Revision ID: 0015
Revises: 0014
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.5.0"
compatible_from = "0013"

# The phases the old table has a column for, and their columns.
COLUMNS = (
    ("empty_room", "empty_room_grace"),
    ("provision_timeout", "provision_timeout"),
    ("stale_live", "stale_live_timeout"),
)
_PAIRS = ", ".join(f"('{phase}', t.{column})" for phase, column in COLUMNS)
_NEW_ROW_PAIRS = ", ".join(f"('{phase}', NEW.{column})" for phase, column in COLUMNS)
_COLUMN_LIST = ", ".join(column for _, column in COLUMNS)
# a tenant's window of each phase (plpgsql variable tenant), in COLUMNS' order
_WINDOWS_OF = ",\n        ".join(
    f"(SELECT w.window_length FROM messenger.reaper_tenant_windows w\n"
    f"         WHERE w.tenant_id = tenant AND w.phase = '{phase}')"
    for phase, _ in COLUMNS
)
_TAKE_EXCLUDED = "\n".join(f"        {column} = EXCLUDED.{column}," for _, column in COLUMNS)
_PHASES = ", ".join(f"'{phase}'" for phase, _ in COLUMNS)

UPGRADE = f"""
CREATE TABLE messenger.reaper_tenant_windows (
    tenant_id uuid NOT NULL,
    phase text NOT NULL CONSTRAINT ck_tenant_windows_phase CHECK (phase ~ '^[a-z_]+$'),
    window_length interval NOT NULL CONSTRAINT ck_tenant_windows_length
        CHECK (window_length > interval '0' AND window_length <= interval '7 days'),
    updated_at timestamptz NOT NULL,
    updated_by text NOT NULL,
    PRIMARY KEY (tenant_id, phase)
);
INSERT INTO messenger.reaper_tenant_windows
    (tenant_id, phase, window_length, updated_at, updated_by)
SELECT t.tenant_id, w.phase, w.window_length, t.updated_at, t.updated_by
FROM messenger.reaper_tenant_policies t
CROSS JOIN LATERAL (VALUES {_PAIRS}) AS w(phase, window_length)
WHERE w.window_length IS NOT NULL;

-- The operator's commands write it; the worker reads it (as 0011 left the
-- old table).
GRANT SELECT ON messenger.reaper_tenant_windows TO reaper_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON messenger.reaper_tenant_windows TO reaper_operator;

-- Old to new: a 0.4.0 command wrote a tenant's row; its windows become the
-- tenant's rows for those phases. Not when the write comes from the trigger
-- below (pg_trigger_depth): each side is written once per change.
CREATE FUNCTION messenger.reaper_policy_to_windows() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_trigger_depth() > 1 THEN
        RETURN NULL;
    END IF;
    IF TG_OP <> 'INSERT' THEN
        DELETE FROM messenger.reaper_tenant_windows
        WHERE tenant_id = OLD.tenant_id AND phase IN ({_PHASES});
    END IF;
    IF TG_OP <> 'DELETE' THEN
        INSERT INTO messenger.reaper_tenant_windows
            (tenant_id, phase, window_length, updated_at, updated_by)
        SELECT NEW.tenant_id, w.phase, w.window_length, NEW.updated_at, NEW.updated_by
        FROM (VALUES {_NEW_ROW_PAIRS}) AS w(phase, window_length)
        WHERE w.window_length IS NOT NULL
        ON CONFLICT (tenant_id, phase) DO UPDATE
        SET window_length = EXCLUDED.window_length, updated_at = EXCLUDED.updated_at,
            updated_by = EXCLUDED.updated_by;
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER tg_reaper_policy_to_windows
AFTER INSERT OR UPDATE OR DELETE ON messenger.reaper_tenant_policies
FOR EACH ROW EXECUTE FUNCTION messenger.reaper_policy_to_windows();

-- New to old: this release wrote a tenant's window; the tenant's row in the
-- old table is its windows of the three phases again (none left: no row,
-- as ck_policy_some wants). A phase the old table has no column for is this
-- release's alone.
CREATE FUNCTION messenger.reaper_windows_to_policy() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    tenant uuid;
    changed messenger.reaper_tenant_windows;
BEGIN
    IF pg_trigger_depth() > 1 THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'DELETE' THEN
        changed := OLD;
    ELSE
        changed := NEW;
    END IF;
    tenant := changed.tenant_id;
    IF changed.phase NOT IN ({_PHASES}) THEN
        RETURN NULL;
    END IF;
    IF NOT EXISTS (SELECT FROM messenger.reaper_tenant_windows
                   WHERE tenant_id = tenant AND phase IN ({_PHASES})) THEN
        DELETE FROM messenger.reaper_tenant_policies WHERE tenant_id = tenant;
        RETURN NULL;
    END IF;
    INSERT INTO messenger.reaper_tenant_policies
        (tenant_id, updated_at, updated_by, {_COLUMN_LIST})
    SELECT tenant, changed.updated_at, changed.updated_by,
        {_WINDOWS_OF}
    ON CONFLICT (tenant_id) DO UPDATE
    SET
{_TAKE_EXCLUDED}
        updated_at = EXCLUDED.updated_at,
        updated_by = EXCLUDED.updated_by;
    RETURN NULL;
END
$$;
CREATE TRIGGER tg_reaper_windows_to_policy
AFTER INSERT OR UPDATE OR DELETE ON messenger.reaper_tenant_windows
FOR EACH ROW EXECUTE FUNCTION messenger.reaper_windows_to_policy();

ALTER TABLE messenger.reaper_runs ADD COLUMN unknown_phases text[] NOT NULL DEFAULT '{{}}';
GRANT UPDATE (unknown_phases) ON messenger.reaper_runs TO reaper_worker;

ALTER TABLE messenger.reaper_pauses DROP CONSTRAINT ck_reaper_pauses_phase;
ALTER TABLE messenger.reaper_pauses ADD CONSTRAINT ck_reaper_pauses_phase_name
    CHECK (phase ~ '^[a-z_]+$');

INSERT INTO messenger.reaper_migrations (revision, kind, release, compatible_from)
VALUES ('{revision}', '{kind}', '{release}', '{compatible_from}');
"""

DOWNGRADE = f"""
DELETE FROM messenger.reaper_migrations WHERE revision = '{revision}';
DELETE FROM messenger.reaper_pauses WHERE phase NOT IN ({_PHASES});
ALTER TABLE messenger.reaper_pauses DROP CONSTRAINT ck_reaper_pauses_phase_name;
ALTER TABLE messenger.reaper_pauses ADD CONSTRAINT ck_reaper_pauses_phase
    CHECK (phase IN ({_PHASES}));
ALTER TABLE messenger.reaper_runs DROP COLUMN unknown_phases;
DROP TABLE messenger.reaper_tenant_windows;
DROP FUNCTION messenger.reaper_windows_to_policy();
DROP TRIGGER tg_reaper_policy_to_windows ON messenger.reaper_tenant_policies;
DROP FUNCTION messenger.reaper_policy_to_windows();
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
