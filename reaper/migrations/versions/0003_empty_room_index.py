"""A partial index for the empty_room phase.

empty_room wants Active rooms with nobody in, oldest activity first. On
ix_conf_active (status, last_activity_at) it has to step over every Active room
that still has people in and older activity (the stale_live candidates, and
every long-running call) on each batch, with a heap fetch each: with 30,000
such rooms, 10 ms per batch before the first row (measured, bench/). This
index holds only the rows the phase can take, in the order it takes them.

Revision ID: 0003
Revises: 0002
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.1.0"
compatible_from = "0008"


def upgrade() -> None:
    op.execute(
        "CREATE INDEX ix_conf_empty_active ON messenger.conference_sessions (last_activity_at)"
        " WHERE status = 'Active' AND active_participant_count = 0"
    )


def downgrade() -> None:
    op.execute("DROP INDEX messenger.ix_conf_empty_active")
