"""Contract: the tenants' windows live in ``messenger.reaper_tenant_windows`` alone.

``messenger.reaper_tenant_policies`` (0008, one column per phase) and the
triggers that kept it in step with the windows' rows (0015) go. The release
before this one (0.4.0) reads and writes that table, so this breaks it: applied
by ``reaper migrate --contract`` once no worker or command of 0.4.0 runs
(docs/runbooks/conference-room-reaper.md#deploying-a-release). The downgrade
makes the table again from the rows (the windows of the three phases it has
columns for) with the triggers of 0015.

Revision ID: 0016
Revises: 0015
"""

import importlib.util
from pathlib import Path

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "contract"
release = "0.5.0"
compatible_from = "0016"

UPGRADE = f"""
DROP TRIGGER tg_reaper_windows_to_policy ON messenger.reaper_tenant_windows;
DROP FUNCTION messenger.reaper_windows_to_policy();
DROP TABLE messenger.reaper_tenant_policies;
DROP FUNCTION messenger.reaper_policy_to_windows();

INSERT INTO messenger.reaper_migrations (revision, kind, release, compatible_from)
VALUES ('{revision}', '{kind}', '{release}', '{compatible_from}');
"""

DOWNGRADE = f"""
DELETE FROM messenger.reaper_migrations WHERE revision = '{revision}';
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
INSERT INTO messenger.reaper_tenant_policies
    (tenant_id, empty_room_grace, provision_timeout, stale_live_timeout, updated_at, updated_by)
SELECT w.tenant_id,
       min(w.window_length) FILTER (WHERE w.phase = 'empty_room'),
       min(w.window_length) FILTER (WHERE w.phase = 'provision_timeout'),
       min(w.window_length) FILTER (WHERE w.phase = 'stale_live'),
       max(w.updated_at), (array_agg(w.updated_by ORDER BY w.updated_at DESC))[1]
FROM messenger.reaper_tenant_windows w
WHERE w.phase IN ('empty_room', 'provision_timeout', 'stale_live')
GROUP BY w.tenant_id;
GRANT SELECT ON messenger.reaper_tenant_policies TO reaper_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON messenger.reaper_tenant_policies TO reaper_operator;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
    op.execute(_SYNC)


def _sync() -> str:
    """0015's two functions and triggers, as 0015 writes them (the downgrade
    makes them again)."""
    path = Path(__file__).with_name("0015_tenant_windows.py")
    spec = importlib.util.spec_from_file_location("reaper_migration_0015", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.UPGRADE
    return text[text.index("-- Old to new:") : text.index("ALTER TABLE messenger.reaper_runs")]


_SYNC = _sync()
