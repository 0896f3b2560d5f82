"""The claim's floor, A against B in one run (docs/performance.md, "The claim's floor").

    .venv/bin/python bench/floor_ab.py                # 50,000 rooms an incident, about 3 min
    .venv/bin/python bench/floor_ab.py --rooms 5000   # quicker

Two databases of its own (``reaper_bench_floor_a``, ``..._b``: dropped,
re-created, migrated, seeded as bench/sustained.py seeds, dropped at the end)
take the same nine incidents as ``bench/run.py --sustained``: six, then three
while another session holds a snapshot. Each incident's rooms are closed by the
reaper's own cycles, then its outbox rows are claimed and deleted as a relay
pass does, without Kafka: claims of ``REAPER_RELAY_BATCH_SIZE`` rows, each
batch's rows deleted by ``acknowledge_outbox`` in the claim's transaction.

- **A**: every claim walks from the oldest pending row (``from_id`` 0), as
  before the floor;
- **B**: the claims start where ``reaper.relay_floor.ClaimFloor`` says, as a pass
  does now (after the batch before; from the start at least every second, and
  again when a claim from the floor finds nothing).

The incidents alternate, A's then B's, so the machine's drift meets both.
Printed per incident: each side's milliseconds for the outbox's part of the pass (the
claims and deletes of 35,000 rows at 50,000 rooms), its claims, and B over A.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import Engine, create_engine  # noqa: E402

from bench import drain, seed, sustained  # noqa: E402
from reaper.config import Settings  # noqa: E402
from reaper.queries import OutboxRow, Queries  # noqa: E402
from reaper.relay_floor import FULL_WALK_EVERY_S, ClaimFloor  # noqa: E402

PG = os.environ.get("REAPER_BENCH_PG", "postgresql+psycopg2://postgres@127.0.0.1:5432")
DATABASE = "reaper_bench_floor"


def outbox_pass(engine: Engine, batch: int, floored: bool) -> tuple[float, int, int]:
    """The outbox's part of one relay pass: seconds, claims, rows deleted. Every claim
    here has no batch in flight beside it (``may_end``)."""
    floor = ClaimFloor(FULL_WALK_EVERY_S)
    claims = deleted = 0
    started = time.perf_counter()
    while True:
        with engine.begin() as conn:
            queries = Queries(conn)
            queries.relay_planner()
            holder = queries.try_relay_lock()  # the claim is fenced on it, as a pass's is
            assert holder is not None

            def run(
                start: int, queries: Queries = queries, holder: int = holder
            ) -> list[OutboxRow]:
                nonlocal claims
                claims += 1
                return queries.claim_outbox_batch(batch, holder, start)

            rows = floor.claim(run, may_end=True) if floored else run(0)
            if not rows:
                return time.perf_counter() - started, claims, deleted
            deleted += queries.acknowledge_outbox([row.id for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rooms", type=int, default=50_000, help="rooms an incident")
    parser.add_argument("--database", default=DATABASE, help="the databases' name prefix")
    args = parser.parse_args(argv)
    as_of = datetime.now(UTC)
    urls = {side: f"{PG}/{args.database}_{side.lower()}" for side in "AB"}
    settings = Settings(database_url=urls["A"])
    engines: dict[str, Engine] = {}
    holders: list[Any] = []  # the sessions holding a snapshot
    try:
        for side, url in urls.items():
            seed.recreate(url)
            seed.seed_live(url, max(args.rooms // 2, 100), as_of)
            seed.seed_eligible(url, args.rooms, as_of)
            seed.seed_policies(url, sustained.POLICIES)
            engines[side] = create_engine(url)
        print(
            f"the outbox's part of a relay pass, per incident of {args.rooms:,} rooms:"
            " A every claim from the oldest pending row, B from ClaimFloor"
        )
        print("incident | snapshot | events | A ms | A claims | B ms | B claims | B / A")
        for number in range(1, sustained.INCIDENTS + sustained.HELD_INCIDENTS + 1):
            held = number > sustained.INCIDENTS
            if held and not holders:
                holders = [sustained.hold_snapshot(url) for url in urls.values()]
            figures = {}
            for side, url in urls.items():
                sustained.put_back(url)
                drain.reaper_drain(url, as_of, settings.batch_size, args.rooms)
                figures[side] = outbox_pass(engines[side], settings.relay_batch_size, side == "B")
            (a_s, a_claims, events), (b_s, b_claims, b_events) = figures["A"], figures["B"]
            if events != b_events:
                raise RuntimeError(f"incident {number}: A deleted {events}, B {b_events}")
            snapshot = "held" if held else "-"
            print(
                f"{number} | {snapshot} | {events:,} | {a_s * 1000:,.1f} | {a_claims}"
                f" | {b_s * 1000:,.1f} | {b_claims} | {b_s / a_s:.2f}x",
                flush=True,
            )
    finally:
        for holder in holders:
            holder.close()
        for engine in engines.values():
            engine.dispose()
        for url in urls.values():
            seed.drop(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
