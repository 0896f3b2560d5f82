"""Every event reaches Kafka: compressed batches, a bounded roster, the native CRC.

A huge room's event (one row per join) is larger than the broker's default
limit uncompressed; zstd makes it fit (docs/performance.md#compression). The
roster is bounded all the same, and the event says how many rows it left out
(docs/design.md#the-kafka-event).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import crc32c
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer
from confluent_kafka import TopicPartition as RdTopicPartition
from kafka.record import util as record_util
from kafka.record.default_records import DefaultRecordBatchBuilder
from sqlalchemy import Connection, Engine, text

from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.kafka import ProducerSlot, producer_config
from reaper.relay import Relay
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.facts import log_events
from tests.support.kafka import create_topic, read_topic

# The roster rows an event lists at most (reaper/sql/queries.sql, end_active_batch).
ROSTER_LIMIT = 20_000
# The broker's default limit on a record batch (message.max.bytes), compressed.
BROKER_DEFAULT_LIMIT = 1_048_588
# Reading a 12,000-roster event back: the broker answers within seconds.
READ_TIMEOUT = 30.0


def roster(conn: Connection, conference_id: str, rows: int, *, open_rows: int = 0) -> None:
    """``rows`` joins spread over the room's hour, as clients stamp them (microseconds,
    distinct users); the last ``open_rows`` joins never left."""
    conn.execute(
        text(
            """
            INSERT INTO messenger.conference_participants
                (conference_id, user_id, joined_at, left_at)
            SELECT :room, gen_random_uuid(), j,
                   CASE WHEN g <= :rows - :open_rows THEN j + random() * interval '10 min' END
            FROM generate_series(1, :rows) g
            CROSS JOIN LATERAL (
                SELECT CAST(:start AS timestamptz) + g * interval '250 ms'
                       + random() * interval '200 ms' AS j
            ) x
            """
        ),
        {
            "room": conference_id,
            "rows": rows,
            "open_rows": open_rows,
            "start": T0 - timedelta(hours=1),
        },
    )


def huge_room(engine: Engine, rows: int, *, open_rows: int = 0) -> dict:
    """A stale room (still Active, people in) with ``rows`` roster rows."""
    with engine.begin() as conn:
        room = f.conference(
            conn, idle=timedelta(hours=5), age=timedelta(hours=6), participants=open_rows
        )
        roster(conn, room["id"], rows, open_rows=open_rows)
    return room


def the_event(engine: Engine) -> tuple[dict, bytes]:
    """The only outbox row: its payload, and its value as the relay sends it."""
    with engine.connect() as conn:
        (payload, value) = conn.execute(
            text("SELECT payload, payload::text FROM messenger.integration_outbox")
        ).one()
    return payload, value.encode()


def compressed_size(value: bytes, codec: str) -> int:
    """The record batch kafka-python puts on the wire for one record of ``value``."""
    attributes = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}[codec]
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=attributes,
        is_transactional=False,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=len(value) * 2,
    )
    builder.append(0, timestamp=None, key=b"k" * 36, value=value, headers=[])
    return len(builder.build())


# -- the dependencies ---------------------------------------------------------------


def test_the_relay_computes_record_crcs_with_the_native_crc32c():
    requires = importlib.metadata.requires("conference-room-reaper") or []
    declared = {r.split(";")[0].split(">")[0].split("=")[0].strip() for r in requires}
    assert {"crc32c", "zstandard"} <= declared, "runtime dependencies of the relay"
    # kafka-python binds the CRC function of its record batches at import: the
    # native one when the crc32c package is importable, else its pure-Python one.
    assert record_util.calc_crc32c.__defaults__ == (crc32c.crc32c,)
    batch = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=False,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1024,
    )
    batch.append(0, timestamp=None, key=b"k", value=b"v", headers=[])
    built = batch.build()
    # the batch's CRC field (bytes 17-20) covers everything from the attributes on
    assert int.from_bytes(built[17:21], "big") == crc32c.crc32c(bytes(built[21:]))


def test_the_producer_compresses_with_the_configured_codec(database_url):
    assert producer_config(Settings(database_url=database_url))["compression_type"] == "zstd"
    plain = Settings(database_url=database_url, kafka_compression="none")
    assert producer_config(plain)["compression_type"] is None
    gzip = Settings(database_url=database_url, kafka_compression="gzip")
    assert producer_config(gzip)["compression_type"] == "gzip"


# -- the roster's bound ---------------------------------------------------------------


def test_the_event_lists_at_most_20000_roster_rows_and_says_how_many_it_left_out(settings, engine):
    room = huge_room(engine, ROSTER_LIMIT + 7, open_rows=3)
    result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["stale_timeout_count"] == 1

    payload, value = the_event(engine)
    listed = payload["payload"]["participants"]
    assert payload["payload"]["conferenceId"] == room["id"]
    assert payload["payload"]["participantsOmitted"] == 7
    assert len(listed) == ROSTER_LIMIT
    with engine.connect() as conn:
        first = conn.execute(
            text(
                "SELECT user_id::text FROM messenger.conference_participants"
                " WHERE conference_id = :room ORDER BY joined_at, id LIMIT :n"
            ),
            {"room": room["id"], "n": ROSTER_LIMIT},
        ).scalars()
        assert [p["userId"] for p in listed] == list(first), "the first joins, in order"
        open_left = conn.execute(
            text(
                "SELECT count(*) FROM messenger.conference_participants"
                " WHERE conference_id = :room AND left_at IS NULL"
            ),
            {"room": room["id"]},
        ).scalar_one()
    assert open_left == 0, "the rows left out of the event are closed all the same"

    # The largest event fits the producer's default limit before compression and
    # the broker's default limit after it (zstd), with a quarter to spare.
    assert len(value) < settings.kafka_max_request_size
    assert compressed_size(value, "zstd") < 0.75 * BROKER_DEFAULT_LIMIT
    assert compressed_size(value, "none") > BROKER_DEFAULT_LIMIT, "compression is what fits it"


def test_a_room_under_the_bound_lists_its_whole_roster(settings, engine):
    huge_room(engine, 50, open_rows=2)
    Reaper(settings, engine=engine).run_cycle(T0)
    payload, _ = the_event(engine)
    assert len(payload["payload"]["participants"]) == 50
    assert payload["payload"]["participantsOmitted"] == 0


# -- a huge room through the real relay, read back by two clients ----------------------


@pytest.fixture
def topic(kafka_broker: str) -> str:
    name = f"test.conference-ended.{uuid.uuid4().hex[:10]}"
    create_topic(kafka_broker, name)
    return name


@pytest.fixture
def slot(database_url: str, kafka_broker: str, topic: str) -> Iterator[ProducerSlot]:
    """The relay's producer with the documented defaults (zstd, 4 MiB) on the test's topic."""
    made = ProducerSlot(
        Settings(
            database_url=database_url,
            kafka_bootstrap_servers=kafka_broker,
            conference_ended_topic=topic,
        )
    )
    yield made
    made.close(timeout=2)


def read_with_librdkafka(bootstrap: str, topic: str, expect: int) -> list[tuple[bytes, dict]]:
    """The topic's records as librdkafka reads them: (key, value), from the beginning
    of every partition (assign, no consumer group: Tansu's groups do not deliver)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "socket.timeout.ms": 10_000,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([RdTopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        found: list[tuple[bytes, dict]] = []
        deadline = time.monotonic() + READ_TIMEOUT
        while len(found) < expect and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            assert message.error() is None, message.error()
            key, value = message.key(), message.value()
            assert key is not None and value is not None  # every event has both
            found.append((key, json.loads(value)))
        return found
    finally:
        consumer.close()


def test_a_room_with_12000_roster_rows_reaches_kafka_read_by_kafka_python_and_librdkafka(
    engine, slot, kafka_broker, topic, caplog
):
    caplog.set_level(logging.INFO, "reaper")
    settings = slot.settings
    room = huge_room(engine, 12_000, open_rows=40)
    assert Reaper(settings, engine=engine).run_cycle(T0)["stale_timeout_count"] == 1
    payload, value = the_event(engine)
    assert len(value) > 1_048_576, "larger than the broker's default limit uncompressed"

    result = Relay(settings, engine=engine, producers=slot).run()
    assert (result.published, result.failed, result.parked) == (1, 0, 0)
    assert log_events(caplog, "kafka.producer_created")[-1]["compression"] == "zstd"
    # what went on the wire was compressed (kafka-python's producer metrics)
    rate = slot.get().metrics()["producer-metrics"]["compression-rate-avg"]
    assert 0 < rate < 0.5

    by_kafka_python = read_topic(kafka_broker, topic, expect=1, timeout=READ_TIMEOUT)
    assert len(by_kafka_python) == 1
    record = by_kafka_python[0]
    assert record.key == room["deal_id"]
    assert record.value == payload
    assert len(record.value["payload"]["participants"]) == 12_000
    assert record.value["payload"]["participantsOmitted"] == 0

    by_librdkafka = read_with_librdkafka(kafka_broker, topic, expect=1)
    assert len(by_librdkafka) == 1
    key, event = by_librdkafka[0]
    assert key == room["deal_id"].encode()
    assert event == payload

    with engine.connect() as conn:  # deleted at its acknowledgement: gone, and on Kafka (above)
        left = conn.execute(text("SELECT count(*) FROM messenger.integration_outbox")).scalar_one()
    assert left == 0
