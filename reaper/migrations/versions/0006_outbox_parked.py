"""Parked outbox rows: refused by Kafka for good, or out of attempts.

``parked_at`` is set when a row's record is refused as not retriable (too
large, an invalid topic) or has failed REAPER_RELAY_MAX_ATTEMPTS times. A
parked row is no longer pending: the relay does not claim it, and it no longer
holds back later rows of its key. ``reaper outbox requeue`` makes it pending
again. The pending indexes now leave parked rows out; a small one finds them.
See docs/design.md#parked-events.

Revision ID: 0006
Revises: 0005
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.1.0"
compatible_from = "0008"

UPGRADE = """
ALTER TABLE messenger.integration_outbox ADD COLUMN parked_at timestamptz;

DROP INDEX messenger.ix_integration_outbox_pending;
CREATE INDEX ix_integration_outbox_pending ON messenger.integration_outbox (id)
    WHERE published_at IS NULL AND parked_at IS NULL;
DROP INDEX messenger.ix_integration_outbox_pending_key;
CREATE INDEX ix_integration_outbox_pending_key
    ON messenger.integration_outbox (message_key, id)
    WHERE published_at IS NULL AND parked_at IS NULL;
CREATE INDEX ix_integration_outbox_parked ON messenger.integration_outbox (parked_at)
    WHERE parked_at IS NOT NULL;

GRANT UPDATE (parked_at) ON messenger.integration_outbox TO reaper_worker;
"""

DOWNGRADE = """
REVOKE UPDATE (parked_at) ON messenger.integration_outbox FROM reaper_worker;
DROP INDEX messenger.ix_integration_outbox_parked;
DROP INDEX messenger.ix_integration_outbox_pending_key;
CREATE INDEX ix_integration_outbox_pending_key
    ON messenger.integration_outbox (message_key, id)
    WHERE published_at IS NULL;
DROP INDEX messenger.ix_integration_outbox_pending;
CREATE INDEX ix_integration_outbox_pending ON messenger.integration_outbox (id)
    WHERE published_at IS NULL;
ALTER TABLE messenger.integration_outbox DROP COLUMN parked_at;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
