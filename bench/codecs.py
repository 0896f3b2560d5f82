"""Compression of the conference-ended event: record sizes and the relay's rate per codec.

    .venv/bin/python bench/codecs.py            # 20,000 normal events, 20 huge ones
    .venv/bin/python bench/codecs.py --quick    # 2,000 normal events, 5 huge ones
    .venv/bin/python bench/codecs.py --tiny     # seconds; tests/test_bench_codecs.py runs it

It seeds its own database (``reaper_bench_codecs``: dropped and re-created),
closes real rooms with the reaper's own cycle, so the events are exactly what
the phase statement writes, and then measures, for every codec kafka-python
supports (none, gzip, snappy, lz4, zstd):

- **sizes**: the record batch kafka-python builds for one event alone (a normal
  room, and rooms of 8,000 to 30,000 roster rows), and per event in a batch of
  100 normal events, as the relay sends them; the time to build it;
- **relay**: the reaper's relay (``reaper.relay.Relay``, as the task runs it)
  publishing the backlog to a Tansu broker: events per second, and the bytes
  the producer sent (counted by a TCP relay in front of the broker).

Every ratio is against ``none`` measured in the same run. No figure has a goal:
they are the evidence for the default of REAPER_KAFKA_COMPRESSION
(docs/performance.md#compression).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# run as a script, bench/ itself is first on the path: the repository instead
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kafka.record.default_records import DefaultRecordBatchBuilder  # noqa: E402

from bench import seed  # noqa: E402
from bench.broker import Tansu, create_topic, free_port  # noqa: E402
from bench.relay import keep_written  # noqa: E402
from reaper.config import Settings  # noqa: E402
from reaper.cycle import Reaper  # noqa: E402
from reaper.db import engine_for  # noqa: E402
from reaper.kafka import ProducerSlot  # noqa: E402
from reaper.relay import Relay  # noqa: E402

PG = os.environ.get("REAPER_BENCH_PG", "postgresql+psycopg2://postgres@127.0.0.1:5432")
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
# kafka-python's codec ids in a record batch's attributes
CODEC_IDS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
# Huge rooms measured for size: 8,000 rows made the first parked record; the
# event lists at most 20,000 (reaper/sql/queries.sql), so 30,000 shows the bound.
HUGE_ROSTERS = (8_000, 12_000, 20_000, 30_000)
# The roster rows an event lists at most (reaper/sql/queries.sql, end_active_batch).
ROSTER_LIMIT = 20_000
# The roster of the huge rooms of the relay's backlog.
RELAY_HUGE_ROSTER = 12_000
# The broker's default limit on a record batch (message.max.bytes).
BROKER_DEFAULT_LIMIT = 1_048_588
# Builds of one batch timed per codec: the median is reported.
BUILD_RUNS = 5
# A relay pass that publishes nothing for this long has failed: the bench stops.
RELAY_STALL = 60.0

# Rooms as the messenger leaves them: empty (everyone left), last activity two
# minutes before as_of, each with ``roster`` joins spread over its hour at
# microsecond precision, every one a distinct user.
ROOMS = """
WITH rooms AS (
    INSERT INTO messenger.conference_sessions
        (id, chat_id, deal_id, tenant_id, media_type, status, started_by_user_id,
         created_at, started_at, last_activity_at, updated_at,
         active_participant_count, peak_participant_count)
    SELECT gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
           md5('t' || mod(g, 50))::uuid, 'Video', 'Active', gen_random_uuid(),
           %(as_of)s::timestamptz - interval '62 min', %(as_of)s::timestamptz - interval '61 min',
           %(as_of)s::timestamptz - interval '2 min', %(as_of)s::timestamptz - interval '2 min',
           0, least(%(roster)s, 500)
    FROM generate_series(1, %(count)s) g
    RETURNING id
)
INSERT INTO messenger.conference_participants (conference_id, user_id, joined_at, left_at)
SELECT r.id, gen_random_uuid(), j, least(j + random() * interval '30 min',
                                         %(as_of)s::timestamptz - interval '2 min')
FROM rooms r
CROSS JOIN generate_series(1, %(roster)s) k
CROSS JOIN LATERAL (
    SELECT %(as_of)s::timestamptz - interval '61 min'
           + (k - 1 + random()) * (interval '58 min' / %(roster)s) AS j
) x
"""


def say(message: str) -> None:
    print(f"[codecs {datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


# -- the events ---------------------------------------------------------------------


def seed_rooms(url: str, as_of: datetime, count: int, roster: int) -> None:
    seed.execute(url, ROOMS, {"as_of": as_of, "count": count, "roster": roster})


def close_rooms(url: str, as_of: datetime) -> int:
    """The reaper's own cycles until nothing is left: the events the phase writes."""
    reaper = Reaper(Settings(database_url=url, batch_size=500), engine=engine_for(url))
    closed = 0
    while True:
        result = reaper.run_cycle(as_of)
        if not result["empty_timeout_count"]:
            return closed
        closed += result["empty_timeout_count"]


def values(url: str, *, huge: bool) -> list[tuple[int, bytes]]:
    """(roster rows in the room, the event as the relay sends it), in outbox order."""
    conn = seed.connect(url)
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT (SELECT count(*) FROM messenger.conference_participants p"
            "        WHERE p.conference_id = (o.payload -> 'payload' ->> 'conferenceId')::uuid),"
            " o.payload::text FROM messenger.integration_outbox o"
            " WHERE (jsonb_array_length(o.payload -> 'payload' -> 'participants') > 1000) = %s"
            " ORDER BY o.id",
            (huge,),
        )
        rows = [(n, value.encode()) for n, value in cur.fetchall()]
    conn.close()
    return rows


# -- sizes ------------------------------------------------------------------------------


def batch(codec: str, events: list[bytes]) -> tuple[int, float]:
    """Bytes of the record batch kafka-python builds for ``events``, and seconds to build it."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=CODEC_IDS[codec],
        is_transactional=False,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=sum(map(len, events)) * 2,
    )
    for offset, value in enumerate(events):
        builder.append(offset, timestamp=None, key=b"k" * 36, value=value, headers=[])
    started = time.perf_counter()
    size = len(builder.build())
    return size, time.perf_counter() - started


def build_time(codec: str, events: list[bytes]) -> float:
    """Seconds to build the batch, the median of BUILD_RUNS (the machine is shared)."""
    return statistics.median(batch(codec, events)[1] for _ in range(BUILD_RUNS))


def listed(rows: int) -> str:
    return f", {ROSTER_LIMIT:,} listed" if rows > ROSTER_LIMIT else ""


def size_table(normal: list[bytes], huge: dict[int, bytes]) -> list[str]:
    lines = [
        "| event | codec | bytes on the wire | vs none | build (ms) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    median = sorted(normal, key=len)[len(normal) // 2]
    cases: list[tuple[str, list[bytes]]] = [
        (f"normal room, alone ({len(median):,} B JSON, the median)", [median]),
        ("normal rooms, per event in a batch of 100", normal[:100]),
    ]
    cases += [
        (f"{rows:,} roster rows{listed(rows)} ({len(value):,} B JSON)", [value])
        for rows, value in huge.items()
    ]
    for label, events in cases:
        base, _ = batch("none", events)
        for codec in CODECS:
            size, _ = batch(codec, events)
            seconds = build_time(codec, events)
            per = len(events)
            fits = "" if size <= BROKER_DEFAULT_LIMIT else " (over 1 MiB)"
            lines.append(
                f"| {label} | {codec} | {size / per:,.0f}{fits} | {size / base:.2f}x"
                f" | {seconds * 1000 / per:.2f} |"
            )
    return lines


def bytes_per_row(huge: dict[int, bytes]) -> dict[str, float]:
    """Bytes per roster row on the wire, from the two largest rosters under the bound."""
    (small, small_value), (large, large_value) = sorted(
        (n, v) for n, v in huge.items() if n <= ROSTER_LIMIT
    )[-2:]
    return {
        codec: (batch(codec, [large_value])[0] - batch(codec, [small_value])[0]) / (large - small)
        for codec in CODECS
    }


# -- the relay ---------------------------------------------------------------------------


class CountingRelay:
    """A TCP relay in front of the broker that counts the bytes clients send to it."""

    def __init__(self, port: int, target_port: int) -> None:
        self.target_port = target_port
        self.sent = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            upstream.settimeout(None)
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket, count: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if count:
                    with self._lock:
                        self.sent += len(data)
                target.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, target):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._server.close()


@contextmanager
def broker_behind_a_counter() -> Iterator[tuple[str, CountingRelay]]:
    """A Tansu broker that advertises the counting relay's address: every byte a
    client sends, bootstrap and produce requests alike, goes through the counter."""
    counted = free_port()
    broker = Tansu(advertised_port=counted)
    counter = CountingRelay(counted, broker.port)
    try:
        broker.start()
        yield f"127.0.0.1:{counted}", counter
    finally:
        counter.close()
        broker.stop()


def make_pending(url: str) -> int:
    """The backlog's events (``bench.outbox_written``) pending again, then vacuumed and
    analyzed: every codec's run starts from the same table and statistics (the
    fresh-backlog effect is bench/run.py's to measure, not a codec's)."""
    seed.execute(
        url,
        "DELETE FROM messenger.integration_outbox;"
        " INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload)"
        " SELECT event_id, topic, message_key, payload FROM bench.outbox_written"
        " ORDER BY position",
    )
    seed.vacuum(url, ("messenger.integration_outbox",))
    return int(seed.one(url, "SELECT count(*) FROM messenger.integration_outbox")[0])


def keep_backlog(url: str) -> int:
    """The outbox's events, as the reaper wrote them, kept aside for every codec's run
    (the relay deletes what it sends); how many."""
    conn = seed.connect(url)
    with conn, conn.cursor() as cur:
        kept = keep_written(cur)
    conn.close()
    return kept


def relay_once(url: str, bootstrap: str, counter: CountingRelay, codec: str) -> tuple[float, int]:
    """The relay publishes the whole outbox with ``codec``: events/s and bytes sent."""
    topic = f"bench.codecs.{codec}.{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic)
    expected = make_pending(url)
    settings = Settings(
        database_url=url,
        kafka_bootstrap_servers=bootstrap,
        conference_ended_topic=topic,
        kafka_compression=codec,
        # none: a huge event uncompressed must pass the producer's own check too
        kafka_max_request_size=16 * 1_048_576,
    )
    slot = ProducerSlot(settings)
    relay = Relay(settings, engine=engine_for(url), producers=slot)
    slot.get().partitions_for(topic)  # connected, with metadata, before the clock starts
    published = 0
    before = counter.sent
    started = time.perf_counter()
    last_progress = started
    try:
        while published < expected:
            result = relay.run()
            if result.failed or result.parked or result.kafka_unavailable:
                raise RuntimeError(f"the relay failed with {codec}: {result}")
            published += result.published
            now = time.perf_counter()
            if result.published:
                last_progress = now
            elif now - last_progress > RELAY_STALL:
                raise RuntimeError(f"the relay stalled with {codec}: {result}")
        elapsed = time.perf_counter() - started
        return expected / elapsed, counter.sent - before
    finally:
        slot.close()


def relay_table(url: str, label: str, repeats: int) -> list[str]:
    """Every codec ``repeats`` times, interleaved, every other round in reverse
    order (the best of each is reported)."""
    rates: dict[str, list[float]] = {c: [] for c in CODECS}
    sent: dict[str, int] = {}
    events = keep_backlog(url)
    with broker_behind_a_counter() as (bootstrap, counter):
        for round_ in range(repeats):
            for codec in CODECS if round_ % 2 == 0 else reversed(CODECS):
                rate, wire = relay_once(url, bootstrap, counter, codec)
                rates[codec].append(rate)
                sent[codec] = wire
                say(f"relay, {label}, round {round_ + 1}: {codec} {rate:,.0f} events/s, {wire:,} B")
    base_rate, base_bytes = max(rates["none"]), sent["none"]
    lines = [
        f"relay, {label} ({events:,} events, best of {repeats}):",
        "",
        "| codec | events/s | vs none | bytes sent per event | vs none |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for codec in CODECS:
        best = max(rates[codec])
        lines.append(
            f"| {codec} | {best:,.0f} | {best / base_rate:.2f}x | {sent[codec] / events:,.0f}"
            f" | {sent[codec] / base_bytes:.2f}x |"
        )
    return lines


def clear_outbox(url: str) -> None:
    seed.execute(
        url, "DELETE FROM messenger.integration_outbox; DELETE FROM messenger.realtime_outbox"
    )


def measure(
    url: str, as_of: datetime, normal_rooms: int, huge_rooms: int, repeats: int
) -> list[str]:
    """Every table, as printed."""
    for rows in HUGE_ROSTERS:
        seed_rooms(url, as_of, 1, rows)
    close_rooms(url, as_of)
    huge = dict(values(url, huge=True))
    clear_outbox(url)

    # the relay's backlogs: normal rooms (2 to 8 joins each), then huge rooms
    for roster in range(2, 9):
        seed_rooms(url, as_of, normal_rooms // 7, roster)
    close_rooms(url, as_of)
    normal = [value for _, value in values(url, huge=False)]
    say(f"{len(normal):,} normal events, {len(huge)} huge ones")

    report = ["sizes (one record batch, as kafka-python builds it):", "", *size_table(normal, huge)]
    per_row = bytes_per_row(huge)
    report += ["", "bytes per roster row on the wire, and the largest roster that fits 1 MiB:", ""]
    report += ["| codec | bytes per row | rows in 1 MiB |", "| --- | ---: | ---: |"]
    report += [
        f"| {codec} | {per_row[codec]:.1f} | {BROKER_DEFAULT_LIMIT / per_row[codec]:,.0f} |"
        for codec in CODECS
    ]
    report += ["", *relay_table(url, "normal rooms", repeats)]

    clear_outbox(url)
    seed_rooms(url, as_of, huge_rooms, RELAY_HUGE_ROSTER)
    close_rooms(url, as_of)
    report += ["", *relay_table(url, f"rooms of {RELAY_HUGE_ROSTER:,} roster rows", repeats)]

    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="10x fewer normal events")
    mode.add_argument("--tiny", action="store_true", help="smoke-test sizes (seconds)")
    parser.add_argument("--database", default="reaper_bench_codecs")
    parser.add_argument("--repeats", type=int, default=2, help="relay runs per codec")
    args = parser.parse_args(argv)
    if not args.database.startswith("reaper_bench"):
        parser.error("--database must start with reaper_bench (it is dropped and re-created)")
    normal_rooms, huge_rooms = (210, 1) if args.tiny else (2_000, 5) if args.quick else (20_000, 20)
    url = f"{PG}/{args.database}"
    as_of = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)

    say(f"seeding {args.database}")
    seed.recreate(url)
    try:
        report = measure(url, as_of, normal_rooms, huge_rooms, args.repeats)
    finally:
        seed.drop(url)
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
