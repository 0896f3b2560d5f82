"""Where a claim starts its walk (reaper.relay_floor.ClaimFloor), against real PostgreSQL.

Within a pass a claim starts after the batch claimed before it, and from the
oldest pending row at least every FULL_WALK_EVERY_S and before the pass may end.
Rows deleted while another session holds an older snapshot stay in the pending
index, unkillable: a walk from the start visits each of them in the heap, every
claim. These tests hold what the floor saves, what it must not lose (a row
committed below the batches already claimed, the order of a key's rows) and when
it walks from the start.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

from reaper.queries import OutboxRow, Queries, load
from reaper.relay_batches import RelayBatches
from reaper.relay_floor import ClaimFloor
from tests.support.kafka import read_topic
from tests.test_relay import (  # the relay tests' fixtures and helpers
    add_outbox_row,
    make_relay,
    producers,
    relay_lock,
    rsettings,
    topic,
)
from tests.test_relay_plans import explain, nodes, outline

__all__ = ["producers", "rsettings", "topic"]  # fixtures, used by name

FILL = """
INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload)
SELECT e, :topic, 'deal-' || g,
       jsonb_build_object('eventId', e, 'eventType', 'ConferenceEnded', 'correlationId', 'c',
                          'roster', repeat('x', 1000))
FROM (SELECT g, gen_random_uuid() AS e FROM generate_series(1, :count) g) fresh
"""


def fill(conn: Connection, topic: str, count: int) -> None:
    conn.execute(text(FILL), {"topic": topic, "count": count})


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def row(id_: int) -> OutboxRow:
    return OutboxRow(id_, f"e{id_}", "t", "k", 0, "{}", "t", "c")


def test_the_floor_starts_after_the_last_batch_and_from_the_start_every_so_often() -> None:
    clock = FakeClock()
    floor = ClaimFloor(1.0, clock)
    assert floor.start() == 0  # a pass's first claim walks from the start
    floor.claimed([row(5), row(9)])
    clock.now += 0.5
    assert floor.start() == 10  # after the batch before
    floor.claimed([])  # a claim that found nothing does not move it
    assert floor.start() == 10
    clock.now += 0.5
    assert floor.start() == 0  # a second since the last walk from the start
    floor.claimed([row(3)])
    assert floor.start() == 4  # where that walk's batch ended, lower than before
    assert floor.from_start() == 0
    clock.now += 0.9
    assert floor.start() == 4  # from_start restarted the interval
    clock.now += 0.1
    assert floor.start() == 0


def test_a_claim_from_the_floor_leaves_out_the_rows_below_it(engine: Engine) -> None:
    with engine.begin() as conn:
        fill(conn, "t", 10)
    with engine.begin() as conn:
        ids = [r.id for r in Queries(conn).claim_outbox_batch(100, relay_lock(conn), 7)]
    assert ids == [7, 8, 9, 10]


def test_a_row_below_the_floor_still_holds_back_the_later_rows_of_its_key(
    engine: Engine,
) -> None:
    """The probes for an earlier row of a key are not floored: a pending row of
    the key below where the walk starts keeps the later one back."""
    with engine.begin() as conn:
        add_outbox_row(conn, topic="t", key="deal-a")  # id 1
        add_outbox_row(conn, topic="t", key="deal-b")  # id 2
        add_outbox_row(conn, topic="t", key="deal-a")  # id 3, behind id 1
    with engine.begin() as conn:
        ids = [r.id for r in Queries(conn).claim_outbox_batch(100, relay_lock(conn), 2)]
    assert ids == [2]


def test_the_floored_walk_starts_at_the_floor_in_the_pending_index(engine: Engine) -> None:
    """The floor is an index condition of the walk over ix_integration_outbox_pending,
    not a filter applied to rows read from the oldest on."""
    with engine.connect() as conn, conn.begin() as tx:
        fill(conn, "t", 2_000)
        conn.execute(text(load()["relay_planner"].text))
        params = {"batch_size": 100, "holder_pid": relay_lock(conn), "from_id": 1_500}
        plan = explain(conn, load()["claim_outbox_batch"].text, params)
        tx.rollback()
    [walk] = [n for n, _ in nodes(plan) if n.get("Alias") == "o"]
    assert walk.get("Index Name") == "ix_integration_outbox_pending", outline(plan)
    assert "id >=" in walk.get("Index Cond", ""), walk.get("Index Cond")


@pytest.fixture
def held_snapshot(engine: Engine) -> Iterator[Connection]:
    """Another session with a REPEATABLE READ snapshot taken and kept open, as a
    report or a backup would; rolled back at the end, failed test or not."""
    conn = engine.connect().execution_options(isolation_level="REPEATABLE READ")
    tx = conn.begin()
    conn.execute(text("SELECT 1"))  # the snapshot is taken here
    try:
        yield conn
    finally:
        tx.rollback()
        conn.close()


def walk_buffers(engine: Engine, from_id: int) -> tuple[int, list[int]]:
    """The shared buffers the claim's walk itself touched (the pending index and the
    heap pages of the rows it visits), and the ids it claimed (rolled back)."""
    with engine.connect() as conn, conn.begin() as tx:
        conn.execute(text(load()["relay_planner"].text))
        holder = relay_lock(conn)
        params = {"batch_size": 500, "holder_pid": holder, "from_id": from_id}
        plan = explain(conn, load()["claim_outbox_batch"].text, params, analyze=True)
        claimed = [r.id for r in Queries(conn).claim_outbox_batch(500, holder, from_id)]
        tx.rollback()
    [walk] = [n for n, _ in nodes(plan) if n.get("Alias") == "o"]
    # the walk's own: a node's figures include its subplans' (the per-key probes)
    own = blocks(walk) - sum(blocks(child) for child in walk.get("Plans", []))
    return own, claimed


def blocks(node: dict[str, Any]) -> int:
    return int(node["Shared Hit Blocks"] + node["Shared Read Blocks"])


def test_under_a_held_snapshot_the_floor_skips_the_rows_deleted_below_it(
    engine: Engine, held_snapshot: Connection
) -> None:
    """5,000 rows deleted after the held snapshot began keep their entries in the
    pending index: the walk from the start visits each in the heap (about 5,000 /
    6 rows a page), the walk from the floor only what it claims."""
    with engine.begin() as conn:
        fill(conn, "t", 6_000)
    with engine.begin() as conn:
        deleted = Queries(conn).acknowledge_outbox(list(range(1, 5_001)))
    assert deleted == 5_000
    # the first walks over them, which would mark the entries dead without the snapshot
    walk_buffers(engine, 0)

    full, full_ids = walk_buffers(engine, 0)
    floored, floored_ids = walk_buffers(engine, 5_001)

    assert full_ids == floored_ids == list(range(5_001, 5_501))
    assert full > 600, full  # the deleted rows' heap pages, every time
    assert floored * 4 < full, (floored, full)


def test_a_row_committed_below_the_batches_claimed_goes_in_the_same_pass(
    rsettings, engine, producers, topic, kafka_broker, monkeypatch
) -> None:
    """A writer's transaction takes id 1 and commits once the pass's first batch is
    claimed: the claims after it start above id 1 (no walk from the start comes
    within the hour set here), and the pass does not end before a walk from the
    start has found it."""
    rsettings = rsettings.model_copy(update={"relay_batch_size": 200})
    late = engine.connect()
    late_tx = late.begin()
    try:
        late_event = add_outbox_row(late, topic=topic, key="deal-late")  # id 1, not committed
        with engine.begin() as conn:
            fill(conn, topic, 1_000)  # ids 2..1001, committed
        starts: list[tuple[int, list[int]]] = []  # each claim's start and what it found
        real_claim = Queries.claim_outbox_batch
        real_batch_claim = RelayBatches.claim

        def claim_outbox_batch(self: Queries, size: int, pid: Any, from_id: int = 0) -> Any:
            rows = real_claim(self, size, pid, from_id)
            starts.append((from_id, [r.id for r in rows]))
            return rows

        def claim(self: RelayBatches, size: int, **kwargs: Any) -> Any:
            self.floor.every_s = 3600.0  # no walk from the start comes by the clock
            flight = real_batch_claim(self, size, **kwargs)
            if late_tx.is_active:
                late_tx.commit()  # id 1 is claimable from here on, below the floor
            return flight

        monkeypatch.setattr(Queries, "claim_outbox_batch", claim_outbox_batch)
        monkeypatch.setattr(RelayBatches, "claim", claim)
        result: Any = make_relay(rsettings, engine, producers).run()
    finally:
        if late_tx.is_active:
            late_tx.rollback()
        late.close()

    assert result.published == 1_001
    records = read_topic(kafka_broker, topic, expect=1_001)
    assert late_event in {r.event_id for r in records}
    # claims after the first started above id 1 and did not see it; a walk from
    # the start, after a floored claim found nothing, did
    [found_by] = [i for i, (_, ids) in enumerate(starts) if 1 in ids]
    # the first claim walked from the start before id 1 was committed; every claim
    # after it started above id 1, until the claim with no batch in flight found
    # nothing there; then, before the pass could end, a walk from the start found
    # it; and the pass ended on one more that found nothing
    assert starts[0][0] == 0 and 1 not in starts[0][1]
    assert all(start > 1 for start, _ in starts[1:found_by])
    assert starts[found_by - 1][1] == [] and found_by > 2
    from_start = [i for i, (start, _) in enumerate(starts) if start == 0]
    assert from_start == [0, found_by, len(starts) - 1], starts
    assert starts[-1][1] == []
