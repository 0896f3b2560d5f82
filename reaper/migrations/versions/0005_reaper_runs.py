"""The run: which cycle owns the reaper, from its first phase to its end.

One row per cycle that took the run. At most one row is open (``finished_at``
null: the unique index on a constant says so), and its lease
(``lease_expires_at``) is extended by each of the cycle's phases; a cycle that
finds the open run's lease expired (its owner died or hung) closes it as
``taken_over`` and takes the run. The row also carries the cycle's running
totals from phase to phase (the phases run as separate Celery tasks, often in
other processes). Rows are changed only under the single-runner advisory
lock. Finished rows are kept for a day (``reaper status``, the health check).
See docs/design.md#one-cycle-at-a-time.

Revision ID: 0005
Revises: 0004
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.1.0"
compatible_from = "0008"

UPGRADE = """
CREATE TABLE messenger.reaper_runs (
    run_id text PRIMARY KEY,
    as_of timestamptz NOT NULL,
    started_at timestamptz NOT NULL,
    deadline timestamptz NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    owner text NOT NULL,
    phase text,
    counts jsonb NOT NULL DEFAULT '{}',
    excluded uuid[] NOT NULL DEFAULT '{}',
    blocked text[] NOT NULL DEFAULT '{}',
    paused text[] NOT NULL DEFAULT '{}',
    errors int NOT NULL DEFAULT 0,
    finished_at timestamptz,
    outcome text CONSTRAINT ck_reaper_runs_outcome
        CHECK (outcome IN ('completed', 'failed', 'taken_over')),
    CONSTRAINT ck_reaper_runs_finished CHECK ((finished_at IS NULL) = (outcome IS NULL))
);
CREATE UNIQUE INDEX ux_reaper_runs_one_open ON messenger.reaper_runs ((true))
    WHERE finished_at IS NULL;
CREATE INDEX ix_reaper_runs_finished ON messenger.reaper_runs (finished_at)
    WHERE finished_at IS NOT NULL;

GRANT SELECT, INSERT, DELETE ON messenger.reaper_runs TO reaper_worker;
GRANT UPDATE (lease_expires_at, phase, counts, excluded, blocked, paused, errors, finished_at,
              outcome)
    ON messenger.reaper_runs TO reaper_worker;
"""

DOWNGRADE = """
DROP TABLE messenger.reaper_runs;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
