"""Kafka for the bench: the relay figures and their baseline (the broker: bench/broker.py).

The relay is measured as an incident leaves the outbox: ``fresh_backlog`` writes
the events anew into a table whose statistics say it is empty (analyzed empty,
autovacuum off for the measurement, so no ``ANALYZE`` comes in between), and
``reaper relay --once`` relays them in its own process. Its rate is events over
the pass's own ``duration_ms`` (the ``relay.completed`` line): the process's
start and the producer's connection are not counted, as the baseline's producer
is connected before its clock starts and a worker's producer is kept from one
pass to the next (only a worker process's first pass connects it). That clock
covers the relay lock, every claim, send, acknowledgement, mark and commit, the
last (empty) claim, retention and the outbox's gauges; the bench takes off it
the ``duration_ms`` of an empty pass run right after, on the outbox the first
one emptied, so what any pass costs whatever it relays is not counted against
the events (the whole pass's ratio is printed and kept beside it).

The relay's baseline is kafka-python alone (``bench.kafka_alone``, in a process
of its own as the relay is): the same records (key, value, headers) from memory,
the same producer settings (``reaper.kafka.producer_config``), every record sent,
then one flush; no database. ``native_crc`` says whether kafka-python found the
``crc32c`` package (its CRC in C) in this environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from bench.seed import connect, execute, one_row
from reaper.config import Settings
from reaper.queries import OutboxRow
from reaper.relay_batches import headers

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# a record as the relay sends it: key, value, headers
Record = tuple[bytes, bytes, list[tuple[str, bytes]]]


def fresh_backlog(url: str, count: int) -> int:
    """The first ``count`` outbox rows (the drain's events) written anew as pending
    rows into a table analyzed empty, with autovacuum off (``autovacuum_back``
    turns it on again): as an incident leaves the outbox, and it stays that way.
    The relay deletes what it sends, so the drain's events are kept aside
    (``bench.outbox_written``) while the outbox holds them, and read from there."""
    conn = connect(url)
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT count(*), to_regclass('bench.outbox_written') IS NOT NULL"
            " FROM messenger.integration_outbox"
        )
        pending, kept = one_row(cur)
        written = None
        if kept:
            cur.execute("SELECT count(*) FROM bench.outbox_written")
            written = one_row(cur)[0]
        # the drain's events, kept for the next runs; not a backlog written here
        # before (still in the outbox when kafka-python alone went first)
        if pending >= count and (written is None or pending > written):
            keep_written(cur)
        cur.execute(
            "CREATE TEMP TABLE backlog ON COMMIT DROP AS SELECT event_id, topic, message_key,"
            " payload FROM bench.outbox_written ORDER BY position LIMIT %s",
            (count,),
        )
        cur.execute("ALTER TABLE messenger.integration_outbox SET (autovacuum_enabled = false)")
        cur.execute("TRUNCATE messenger.integration_outbox RESTART IDENTITY")
        cur.execute("ANALYZE messenger.integration_outbox")  # statistics: an empty table
        cur.execute(
            "INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload)"
            " SELECT event_id, topic, message_key, payload FROM backlog"
        )
        cur.execute(
            "SELECT (SELECT count(*) FROM messenger.integration_outbox),"
            " (SELECT reltuples FROM pg_class WHERE relname = 'integration_outbox')"
        )
        pending, reltuples = one_row(cur)
    conn.close()
    if reltuples > 0:
        raise RuntimeError(f"the outbox's statistics say {reltuples} rows, not empty")
    return int(pending)


def keep_written(cur: Any) -> int:
    """The outbox's rows, as the drain wrote them, kept aside in ``bench.outbox_written``
    (what ``records`` reads and ``bench.kafka_alone`` sends); how many."""
    cur.execute("CREATE SCHEMA IF NOT EXISTS bench")
    cur.execute("DROP TABLE IF EXISTS bench.outbox_written")
    cur.execute(
        "CREATE TABLE bench.outbox_written AS SELECT id AS position, event_id, topic,"
        " message_key, payload FROM messenger.integration_outbox"
    )
    return int(cur.rowcount)


def autovacuum_back(url: str) -> None:
    execute(url, "ALTER TABLE messenger.integration_outbox RESET (autovacuum_enabled)")


def records(url: str, count: int) -> list[Record]:
    """The first ``count`` written events (what ``fresh_backlog`` puts in the outbox)
    as the relay sends them: key, value and the relay's own headers (``headers``)."""
    conn = connect(url)
    with conn, conn.cursor() as cur:
        # OutboxRow's columns, in its order, as claim_outbox_batch returns them
        cur.execute(
            "SELECT position, event_id::text, topic, message_key, 0, payload::text,"
            " payload ->> 'eventType', payload ->> 'correlationId'"
            " FROM bench.outbox_written ORDER BY position LIMIT %s",
            (count,),
        )
        rows = [OutboxRow._make(row) for row in cur.fetchall()]
    conn.close()
    return [(row.message_key.encode(), row.value.encode(), headers(row)) for row in rows]


def relay_settings(url: str, bootstrap: str, topic: str) -> Settings:
    return Settings(
        database_url=url, kafka_bootstrap_servers=bootstrap, conference_ended_topic=topic
    )


def native_crc() -> bool:
    """Whether kafka-python computes record CRCs in C here (the ``crc32c`` package)."""
    from kafka.record import util

    # kafka-python's stubs leave out this module attribute (None without the package)
    return util.crc32c_c is not None  # type: ignore[attr-defined, unused-ignore]


def relay_once(
    url: str, bootstrap: str, topic: str, expected: int, command: list[str] | None = None
) -> dict[str, Any]:
    """``reaper relay --once --json`` (or ``command``, a variant of it) in its own
    process: its result, the pass's own duration (``relay.completed``) and the whole
    process's wall time."""
    env = {
        **os.environ,
        "REAPER_DATABASE_URL": url,
        "REAPER_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "REAPER_CONFERENCE_ENDED_TOPIC": topic,
        "REAPER_METRICS_PORT": "0",
        # one pass for the whole backlog
        "REAPER_RELAY_MAX_PASS_DURATION": "600",
    }
    started = time.perf_counter()
    done = subprocess.run(
        command or [str(BIN / "reaper"), "relay", "--once", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"reaper relay --once failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["published"] != expected or result["failed"] or result["parked"]:
        raise RuntimeError(f"the relay did not publish the {expected} events: {result}")
    [completed] = [
        line
        for line in map(_json_line, done.stderr.splitlines())
        if line.get("event") == "relay.completed"
    ]
    return {**result, "pass_s": completed["duration_ms"] / 1000, "process_s": wall}


def _json_line(line: str) -> dict[str, Any]:
    try:
        parsed = json.loads(line)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def kafka_alone(
    url: str, bootstrap: str, topic: str, count: int, *, partitions_given: bool = False
) -> float:
    """kafka-python alone on the first ``count`` written events, in its own process
    (``bench.kafka_alone``): events/s from its send loop and flush; with
    ``partitions_given``, each record's partition chosen as the relay chooses it."""
    given = ["--partitions-given"] if partitions_given else []
    done = subprocess.run(
        [sys.executable, "-m", "bench.kafka_alone", url, bootstrap, topic, str(count), *given],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kafka-python alone failed: {done.stderr[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["per_s"])


def timestamps(bootstrap: str, topic: str, expect: int, timeout: float) -> dict[str, int]:
    """conferenceId -> the record's timestamp (ms, set by the producer at send)."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, request_timeout_ms=10_000
    )
    found: dict[str, int] = {}
    try:
        deadline = time.monotonic() + timeout
        partitions = None
        while not partitions and time.monotonic() < deadline:
            partitions = consumer.partitions_for_topic(topic)
            time.sleep(0.1)
        consumer.assign([TopicPartition(topic, p) for p in sorted(partitions or [])])
        consumer.seek_to_beginning()
        while len(found) < expect and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                for record in batch:
                    value: dict[str, Any] = json.loads(record.value)
                    found[value["payload"]["conferenceId"]] = record.timestamp
    finally:
        consumer.close()
    return found
