"""End to end: a running ``celery -A reaper worker -B`` with short intervals; from the
moment a room becomes eligible to its record on Kafka (the producer's timestamp)."""

from __future__ import annotations

import statistics
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench.relay import timestamps
from bench.seed import connect
from bench.worker import relaying

SEED_ROOMS = """
INSERT INTO messenger.conference_sessions
    (id, chat_id, deal_id, tenant_id, media_type, status, started_by_user_id,
     created_at, started_at, last_activity_at, updated_at,
     active_participant_count, peak_participant_count)
SELECT gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), 'Video',
       'Active', gen_random_uuid(), %(t0)s - interval '1 hour', %(t0)s - interval '1 hour',
       %(t0)s - %(grace)s + k * %(spread)s, %(t0)s, 0, 2
FROM generate_series(0, %(rooms)s - 1) k
RETURNING id::text, last_activity_at + %(grace)s
"""


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def run(url: str, workdir: Path, rooms: int, interval_s: float, spread_s: float) -> dict:
    """``rooms`` empty rooms that become eligible one after another over ``spread_s``."""
    grace = timedelta(seconds=2)
    with relaying(
        url,
        workdir / "worker-e2e.log",
        REAPER_POLLING_INTERVAL=str(interval_s),
        REAPER_EMPTY_ROOM_GRACE=str(grace.total_seconds()),
        REAPER_KAFKA_TIMEOUT="4",
        REAPER_RELAY_INTERVAL="60",  # only the relay a cycle enqueues may be fast
    ) as (bootstrap, topic):
        t0 = datetime.now(UTC) + timedelta(seconds=1)
        conn = connect(url)
        with conn, conn.cursor() as cur:
            cur.execute(
                SEED_ROOMS,
                {
                    "t0": t0,
                    "grace": grace,
                    "rooms": rooms,
                    "spread": timedelta(seconds=spread_s / rooms),
                },
            )
            eligible_at = {room: at for room, at in cur.fetchall()}
        conn.close()
        time.sleep(max(0.0, (t0 - datetime.now(UTC)).total_seconds() + spread_s))
        seen = timestamps(bootstrap, topic, expect=rooms, timeout=60)
    missing = set(eligible_at) - set(seen)
    if missing:
        raise RuntimeError(f"{len(missing)} of {rooms} rooms never reached Kafka")
    delays = [seen[room] / 1000 - eligible_at[room].timestamp() for room in eligible_at]
    return {
        "rooms": rooms,
        "interval_s": interval_s,
        "median_s": statistics.median(delays),
        "p99_s": percentile(delays, 0.99),
        "max_s": max(delays),
        "min_s": min(delays),
    }
