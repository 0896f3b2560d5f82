"""Where a relay pass's next claim starts its walk of the pending rows (:class:`ClaimFloor`).

A policy on a clock and nothing else: the claim itself is ``claim_outbox_batch``
(reaper/sql/queries.sql, ``:from_id``), run by reaper/relay_batches.py.
"""

from __future__ import annotations

from collections.abc import Callable

from reaper.clock import Monotonic, monotonic
from reaper.queries import OutboxRow

# The longest a claimable row waits for a claim that walks from the oldest
# pending row, while a pass goes on: claims in between start after the batch
# claimed before them (ClaimFloor) and pass over what was not claimable when
# the walk went by.
FULL_WALK_EVERY_S = 1.0


class ClaimFloor:
    """Where a pass's next claim starts its walk of the pending rows.

    A claim walks the pending rows in id order. Rows deleted since the last
    vacuum are still in the pending index, and while a snapshot older than
    their deletion is held anywhere in the database (a report, a backup) no
    scan can mark them dead: a walk from the oldest pending row visits every
    one of them in the heap again, each claim, and the rows a pass deletes
    pile up in front of its own later claims. So a claim starts right after
    the batch claimed before it. Below that point it would miss what was not
    claimable when the earlier walk went by: a back-off that ran out, a later
    row of a key whose earlier row was in flight, a row whose transaction
    committed after rows with higher ids. Those wait for the next walk from
    the start: the pass's first claim, one at least every ``every_s``, and one
    whenever a claim with no batch in flight finds nothing after the last batch
    (:meth:`claim`), so a pass never ends on a walk that started above a
    claimable row. A claim beside a batch in flight that finds nothing does not
    end the pass, and walks no further. Per-key order does not depend
    on where a walk starts: the claim's probes for an earlier row of a key are
    never floored.
    """

    def __init__(self, every_s: float = FULL_WALK_EVERY_S, clock: Monotonic = monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self.next_id = 0  # after the last batch claimed; 0: from the start
        self.walked_at: float | None = None  # the last walk from the start

    def start(self) -> int:
        """The id the next claim starts from: 0 when a walk from the start is due."""
        now = self.clock()
        if self.walked_at is None or now - self.walked_at >= self.every_s:
            return self.from_start()
        return self.next_id

    def from_start(self) -> int:
        self.walked_at = self.clock()
        return 0

    def claimed(self, rows: list[OutboxRow]) -> None:
        """The next claim starts after these (in id order, as the claim returns them)."""
        if rows:
            self.next_id = rows[-1].id + 1

    def claim(self, run: Callable[[int], list[OutboxRow]], *, may_end: bool) -> list[OutboxRow]:
        """``run`` (a claim from a given id) from where this says; with ``may_end`` (no
        batch in flight, so finding nothing ends the pass) from the start again when
        the walk from the floor found nothing."""
        start = self.start()
        rows = run(start)
        if not rows and start and may_end:
            rows = run(self.from_start())
        self.claimed(rows)
        return rows
