"""Contract: ``reaper_worker`` loses the rights only releases before 0.2.0 used.

From 0.2.0 on the worker reads the operator's controls and never writes them,
and keeps the outbox's retention through ``messenger.delete_published_outbox``
(0009), never by DELETE on the table. Release 0.1.0 still deletes directly:
this migration breaks it, so it is a contract migration, applied by ``reaper
migrate --contract`` after every worker runs this release (docs/design.md#releases-and-the-schema).
A stolen worker password can then neither steer the reaper nor delete an event
that is still to be sent.

A database that ran 0009 as 0.2.0 released it already has these revokes: then
this changes nothing but the record.

Revision ID: 0011
Revises: 0010
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "contract"
release = "0.3.0"
compatible_from = "0009"

UPGRADE = f"""
REVOKE INSERT, UPDATE, DELETE ON messenger.reaper_pauses, messenger.reaper_tenant_policies
    FROM reaper_worker;
REVOKE DELETE ON messenger.integration_outbox FROM reaper_worker;
INSERT INTO messenger.reaper_migrations (revision, kind, release, compatible_from)
VALUES ('{revision}', '{kind}', '{release}', '{compatible_from}');
"""

DOWNGRADE = f"""
DELETE FROM messenger.reaper_migrations WHERE revision = '{revision}';
GRANT DELETE ON messenger.integration_outbox TO reaper_worker;
GRANT INSERT, UPDATE, DELETE ON messenger.reaper_pauses, messenger.reaper_tenant_policies
    TO reaper_worker;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
