"""The outbox's levers, A against B in one run (docs/performance.md#the-outboxs-levers).

    .venv/bin/python bench/outbox_ab.py            # about 20 s
    .venv/bin/python bench/outbox_ab.py --rounds 3 # quicker, noisier

It seeds its own database (``reaper_bench_outbox_ab``: dropped and re-created,
migrated to this release's head, dropped at the end) with pending outbox rows
shaped as the conference-ended event, and measures, per batch of 2,000 rows, in
the relay's own transaction settings (``relay_planner``, the claim fenced on a
relay lock this session holds):

- **the claim**: ``claim_outbox_batch`` as it is (``payload::text``, the stored
  value as text, encoded and sent as is) against the same claim returning
  ``payload`` as psycopg2 returns a jsonb (parsed into a dict) and serialized
  again for the record, as a relay must then do; each claim rolled back, so
  both read the same rows;
- **the mark**: the rows' own acknowledgement as 0.3.0 marked it (``UPDATE``
  of ``published_at``) against 0.4.0's ``messenger.acknowledge_outbox``
  (``DELETE``), each on a fresh batch of its own, committed, rounds
  interleaved so both meet the same table.

Medians of the rounds; the ratio is B's time over A's (below 1: B is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import Connection, create_engine, make_url, text  # noqa: E402

from bench.seed import drop, recreate  # noqa: E402
from reaper.queries import load  # noqa: E402

PG = os.environ.get("REAPER_BENCH_PG", "postgresql+psycopg2://postgres@127.0.0.1:5432")
DATABASE = "reaper_bench_outbox_ab"
BATCH = 2_000
DEALS = 5_000

# Rows shaped as the conference-ended event of a room with a few participants
# (about 1 KB of JSON, as the phase statement writes it).
FILL = """
INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload, created_at)
SELECT e.id, 'pin.messenger.conference-ended.v1', e.deal,
       jsonb_build_object(
           'eventId', e.id, 'eventType', 'pin.messenger.conference-ended.v1',
           'occurredAt', '2026-12-02T10:00:00Z', 'correlationId', md5('run' || (g / 500)),
           'aggregateId', e.deal,
           'payload', jsonb_build_object(
               'conferenceId', md5('c' || g)::uuid, 'chatId', md5('h' || g)::uuid,
               'dealId', e.deal, 'tenantId', md5('t' || (g % 50))::uuid,
               'mediaType', 'Video', 'status', 'Ended', 'endReason', 'EmptyTimeout',
               'startedByUserId', md5('u' || g)::uuid,
               'startedAt', '2026-12-02T09:30:05Z', 'endedAt', '2026-12-02T10:00:00Z',
               'durationSeconds', 1795, 'peakParticipantCount', 3,
               'participants', (SELECT jsonb_agg(jsonb_build_object(
                                    'userId', md5('p' || g || '-' || k)::uuid,
                                    'joinedAt', '2026-12-02T09:40:00Z',
                                    'leftAt', '2026-12-02T09:58:00Z'))
                                FROM generate_series(1, 3) k),
               'participantsOmitted', 0, 'wasRecorded', false, 'recordingId', NULL)),
       now()
FROM generate_series(1, :rows) g
CROSS JOIN LATERAL (SELECT gen_random_uuid() AS id, md5('d' || (g % :deals))::uuid::text AS deal) e
"""

# The mark of release 0.3.0 (its mark_outbox_published), for the A/B only.
MARK_PUBLISHED = """
UPDATE messenger.integration_outbox
SET published_at = clock_timestamp(), attempts = attempts + 1, next_attempt_at = NULL
WHERE id = ANY (CAST(:ids AS bigint[])) AND published_at IS NULL
"""


def claim_sql(stored_as_is: bool) -> str:
    """The relay's claim; with ``stored_as_is`` its value is the jsonb column itself."""
    sql = load()["claim_outbox_batch"].text
    if not stored_as_is:
        return sql
    changed = sql.replace("c.payload::text AS value", "c.payload AS value")
    assert changed != sql, "the claim no longer selects payload::text"
    return changed


def begin_relay_transaction(conn: Connection) -> int:
    """The relay's settings and lock in this transaction; the lock holder's pid."""
    conn.execute(text(load()["relay_planner"].text))
    pid = conn.execute(text(load()["try_relay_lock"].text)).scalar_one()
    assert pid is not None
    return int(pid)


def time_claim(conn: Connection, stored_as_is: bool) -> tuple[float, int]:
    """One claim of BATCH rows and the values the relay sends, rolled back: seconds."""
    with conn.begin() as tx:
        pid = begin_relay_transaction(conn)
        started = time.perf_counter()
        rows = conn.execute(
            text(claim_sql(stored_as_is)), {"batch_size": BATCH, "holder_pid": pid, "from_id": 0}
        ).all()
        if stored_as_is:  # psycopg2 parsed the jsonb: the record needs its bytes again
            values = [json.dumps(row.value).encode() for row in rows]
        else:
            values = [row.value.encode() for row in rows]
        elapsed = time.perf_counter() - started
        size = sum(map(len, values))
        tx.rollback()
    assert len(rows) == BATCH, len(rows)
    return elapsed, size


def time_mark(conn: Connection, delete: bool) -> float:
    """Claim the next BATCH pending rows, mark them acknowledged, commit: the mark's
    seconds (the statement alone, as the relay's batch runs it)."""
    with conn.begin():
        pid = begin_relay_transaction(conn)
        rows = conn.execute(
            text(load()["claim_outbox_batch"].text),
            {"batch_size": BATCH, "holder_pid": pid, "from_id": 0},
        ).all()
        ids = [row.id for row in rows]
        assert len(ids) == BATCH, len(ids)
        started = time.perf_counter()
        if delete:
            done = conn.execute(text(load()["acknowledge_outbox"].text), {"ids": ids}).scalar_one()
        else:
            done = conn.execute(text(MARK_PUBLISHED), {"ids": ids}).rowcount
        elapsed = time.perf_counter() - started
    assert done == BATCH, done
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of each variant")
    args = parser.parse_args(argv)
    url = make_url(PG).set(database=DATABASE).render_as_string(hide_password=False)
    recreate(url)
    engine = create_engine(url)
    try:
        # pending rows for every mark round of both variants, and the claims' batch
        rows = (2 * args.rounds + 1) * BATCH
        with engine.begin() as conn:
            conn.execute(text(FILL), {"rows": rows, "deals": DEALS})
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(
                text("VACUUM ANALYZE messenger.integration_outbox")
            )
        claims: dict[bool, list[float]] = {False: [], True: []}
        sizes: dict[bool, int] = {}
        marks: dict[bool, list[float]] = {False: [], True: []}
        with engine.connect() as conn:
            for _ in range(2):  # warm the caches and the statements' plans
                time_claim(conn, False)
                time_claim(conn, True)
            for _ in range(args.rounds):
                for variant in (False, True):
                    elapsed, sizes[variant] = time_claim(conn, variant)
                    claims[variant].append(elapsed)
            for _ in range(args.rounds):
                for delete in (False, True):
                    marks[delete].append(time_mark(conn, delete))
            size_bytes = conn.execute(
                text("SELECT pg_total_relation_size('messenger.integration_outbox')")
            ).scalar_one()
    finally:
        engine.dispose()
        drop(url)

    def ms(values: list[float]) -> float:
        return statistics.median(values) * 1000

    print(f"outbox A/B, per batch of {BATCH:,} rows, median of {args.rounds} rounds each")
    claim_a, claim_b = ms(claims[False]), ms(claims[True])
    print(
        f"claim, payload::text sent as is:               {claim_a:7.1f} ms"
        f"  ({sizes[False] / BATCH:.0f} bytes per value)"
    )
    print(
        f"claim, payload as psycopg2 returns it + dumps: {claim_b:7.1f} ms"
        f"  ({sizes[True] / BATCH:.0f} bytes per value)"
    )
    print(f"  ratio (as returned / ::text): {claim_b / claim_a:.2f}x")
    mark_a, mark_b = ms(marks[False]), ms(marks[True])
    print(f"mark, UPDATE published_at (0.3.0):             {mark_a:7.1f} ms")
    print(f"mark, acknowledge_outbox DELETE (0.4.0):       {mark_b:7.1f} ms")
    print(f"  ratio (DELETE / UPDATE): {mark_b / mark_a:.2f}x")
    print(f"outbox after the run: {size_bytes / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
