"""``reaper relay --once --json`` with release 0.3.0's acknowledgement, for the
sustained run's baseline only (bench/sustained.py ``--baseline-marking``).

    .venv/bin/python -m bench.marking_relay   # from the repository's root

Everything is this release's relay but the acknowledgement: each sent row is
marked (``UPDATE ... SET published_at``, 0.3.0's ``mark_outbox_published``)
instead of deleted, so its row stays in the outbox with a new version and new
index entries, as it did until 0.4.0.
"""

from __future__ import annotations

import sys

from sqlalchemy import text

from reaper import cli
from reaper.queries import Queries

# The mark of release 0.3.0 (its mark_outbox_published).
MARK_PUBLISHED = """
UPDATE messenger.integration_outbox
SET published_at = clock_timestamp(), attempts = attempts + 1, next_attempt_at = NULL
WHERE id = ANY (CAST(:ids AS bigint[])) AND published_at IS NULL
"""


def mark_published(self: Queries, ids: list[int]) -> int:
    """0.3.0's acknowledgement: the rows marked published, not deleted."""
    return int(self.conn.execute(text(MARK_PUBLISHED), {"ids": ids}).rowcount)


if __name__ == "__main__":
    # the one change: every acknowledgement this process makes marks instead
    Queries.acknowledge_outbox = mark_published  # type: ignore[method-assign]
    sys.exit(cli.main(["relay", "--once", "--json"]))
