"""The outbox relay's bookkeeping on integration_outbox.

``next_attempt_at``: when a row that failed may be tried again (null: now).
Pending rows are claimed oldest first and per message key, so the pending
index carries the key; published rows are deleted by age after the retention.

Revision ID: 0002
Revises: 0001
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.1.0"
compatible_from = "0008"

UPGRADE = """
ALTER TABLE messenger.integration_outbox ADD COLUMN next_attempt_at timestamptz;

-- Per-key ordering: "is an earlier row of this key still pending?"
CREATE INDEX ix_integration_outbox_pending_key
    ON messenger.integration_outbox (message_key, id)
    WHERE published_at IS NULL;

-- Retention: published rows by age.
CREATE INDEX ix_integration_outbox_published
    ON messenger.integration_outbox (published_at)
    WHERE published_at IS NOT NULL;
"""

DOWNGRADE = """
DROP INDEX messenger.ix_integration_outbox_published;
DROP INDEX messenger.ix_integration_outbox_pending_key;
ALTER TABLE messenger.integration_outbox DROP COLUMN next_attempt_at;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
