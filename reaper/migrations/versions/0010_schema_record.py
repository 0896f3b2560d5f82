"""The schema's compatibility record: ``messenger.reaper_migrations``.

One row per migration applied (this one backfills 0001 to 0010; every later
migration inserts its own row, and its downgrade deletes it): its revision,
its kind (``expand``: safe while the release before runs; ``contract``: breaks
a release older than ``compatible_from``, applied by ``reaper migrate
--contract``), the release that brought it, and ``compatible_from``, the
oldest release schema head that still runs with it applied. A release started
on a schema newer than it knows reads the rows above its own head: it runs
when every one of them is compatible with it, and refuses otherwise
(docs/design.md#releases-and-the-schema).

Both roles read the record and ``public.alembic_version`` (the revision), so a
worker and an operator's command check the schema at start as their own login.

Revision ID: 0010
Revises: 0009
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# The release that brought it, and whether it is an expand (safe while the
# release before runs) or a contract migration; the oldest release schema head
# that still runs with it applied (messenger.reaper_migrations, 0010).
kind = "expand"
release = "0.3.0"
compatible_from = "0008"

UPGRADE = """
CREATE TABLE messenger.reaper_migrations (
    revision text PRIMARY KEY CONSTRAINT ck_reaper_migrations_revision
        CHECK (revision ~ '^[0-9]{4}$'),
    kind text NOT NULL CONSTRAINT ck_reaper_migrations_kind
        CHECK (kind IN ('expand', 'contract')),
    release text NOT NULL,
    compatible_from text NOT NULL CONSTRAINT ck_reaper_migrations_compatible_from
        CHECK (compatible_from ~ '^[0-9]{4}$'),
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- What each migration before this one was, as its file says (kind, release,
-- compatible_from): 0001-0008 are 0.1.0's, 0009 is 0.2.0's expand part.
INSERT INTO messenger.reaper_migrations (revision, kind, release, compatible_from) VALUES
    ('0001', 'expand', '0.1.0', '0008'),
    ('0002', 'expand', '0.1.0', '0008'),
    ('0003', 'expand', '0.1.0', '0008'),
    ('0004', 'expand', '0.1.0', '0008'),
    ('0005', 'expand', '0.1.0', '0008'),
    ('0006', 'expand', '0.1.0', '0008'),
    ('0007', 'expand', '0.1.0', '0008'),
    ('0008', 'expand', '0.1.0', '0008'),
    ('0009', 'expand', '0.2.0', '0008'),
    ('0010', 'expand', '0.3.0', '0008');

-- The check at start runs as the process's own login: it reads the revision
-- and the record, nothing else of them.
GRANT SELECT ON messenger.reaper_migrations TO reaper_worker, reaper_operator;
GRANT SELECT ON public.alembic_version TO reaper_worker, reaper_operator;
"""

DOWNGRADE = """
REVOKE ALL ON public.alembic_version FROM reaper_worker, reaper_operator;
DROP TABLE messenger.reaper_migrations;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
