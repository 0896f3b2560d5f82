"""Stop signals the recorder did not take are retried (docs/design.md#the-recorder-stop-signal).

``stop_attempts`` counts the signals sent that the recorder did not take, and
``stop_next_attempt_at`` says when the sweep may send the next one (an
exponential back-off). The sweep looks only at rooms the reaper ended within
REAPER_RECORDER_RETRY_WINDOW, through a partial index over exactly those.

Revision ID: 0007
Revises: 0006
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.1.0"
compatible_from = "0008"

UPGRADE = """
ALTER TABLE messenger.call_recordings
    ADD COLUMN stop_attempts int NOT NULL DEFAULT 0,
    ADD COLUMN stop_next_attempt_at timestamptz;
CREATE INDEX ix_conf_reaped ON messenger.conference_sessions (ended_at)
    WHERE end_reason IN ('EmptyTimeout', 'Timeout', 'Error');
GRANT UPDATE (stop_attempts, stop_next_attempt_at) ON messenger.call_recordings TO reaper_worker;
"""

DOWNGRADE = """
REVOKE UPDATE (stop_attempts, stop_next_attempt_at) ON messenger.call_recordings
    FROM reaper_worker;
DROP INDEX messenger.ix_conf_reaped;
ALTER TABLE messenger.call_recordings DROP COLUMN stop_next_attempt_at, DROP COLUMN stop_attempts;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
