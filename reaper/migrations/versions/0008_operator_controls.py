"""The operator's controls, in PostgreSQL so that every replica sees them at once.

``reaper_pauses``: a paused phase changes nothing (``reaper pause``/``resume``);
a pause with ``paused_until`` ends by itself. Read at the start of each phase,
under the run's lock.

``reaper_tenant_policies``: a tenant's own windows replace the defaults for its
conferences only (``reaper policy``). Positive and at most 7 days, checked here
as well as by the command.

See docs/design.md#operator-controls.

Revision ID: 0008
Revises: 0007
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.1.0"
compatible_from = "0008"

UPGRADE = """
CREATE TABLE messenger.reaper_pauses (
    phase text PRIMARY KEY CONSTRAINT ck_reaper_pauses_phase
        CHECK (phase IN ('empty_room', 'provision_timeout', 'stale_live')),
    reason text NOT NULL CONSTRAINT ck_reaper_pauses_reason CHECK (btrim(reason) <> ''),
    paused_at timestamptz NOT NULL,
    paused_until timestamptz,
    paused_by text NOT NULL,
    CONSTRAINT ck_reaper_pauses_until CHECK (paused_until IS NULL OR paused_until > paused_at)
);

CREATE TABLE messenger.reaper_tenant_policies (
    tenant_id uuid PRIMARY KEY,
    empty_room_grace interval,
    provision_timeout interval,
    stale_live_timeout interval,
    updated_at timestamptz NOT NULL,
    updated_by text NOT NULL,
    CONSTRAINT ck_policy_some CHECK (
        empty_room_grace IS NOT NULL OR provision_timeout IS NOT NULL
        OR stale_live_timeout IS NOT NULL),
    CONSTRAINT ck_policy_empty_room_grace
        CHECK (empty_room_grace > interval '0' AND empty_room_grace <= interval '7 days'),
    CONSTRAINT ck_policy_provision_timeout
        CHECK (provision_timeout > interval '0' AND provision_timeout <= interval '7 days'),
    CONSTRAINT ck_policy_stale_live_timeout
        CHECK (stale_live_timeout > interval '0' AND stale_live_timeout <= interval '7 days')
);

-- Operators run the reaper command as the worker's role too.
GRANT SELECT, INSERT, UPDATE, DELETE ON messenger.reaper_pauses,
    messenger.reaper_tenant_policies TO reaper_worker;
"""

DOWNGRADE = """
DROP TABLE messenger.reaper_tenant_policies;
DROP TABLE messenger.reaper_pauses;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
