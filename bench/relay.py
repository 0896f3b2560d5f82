"""Kafka for the bench: the relay figure and its baseline (the broker: tests.support.kafka).

The relay's baseline is kafka-python alone: the same records (key, value,
headers) from memory, the same producer settings (``reaper.kafka.producer_config``),
the same batch size, every acknowledgement awaited per batch; no database.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from bench.seed import connect
from reaper.config import Settings
from reaper.db import engine_for
from reaper.kafka import ProducerSlot, producer_config


def keep_pending(url: str, count: int) -> int:
    """Leave exactly the first ``count`` outbox rows (the drain's), all pending again."""
    conn = connect(url)
    with conn, conn.cursor() as cur:
        cur.execute(
            "DELETE FROM messenger.integration_outbox WHERE id NOT IN"
            " (SELECT id FROM messenger.integration_outbox ORDER BY id LIMIT %s)",
            (count,),
        )
        cur.execute(
            "UPDATE messenger.integration_outbox SET published_at = NULL, attempts = 0,"
            " last_error = NULL, next_attempt_at = NULL"
        )
        cur.execute("SELECT count(*) FROM messenger.integration_outbox")
        (pending,) = cur.fetchone()
    conn.close()
    return pending


def records(url: str) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    """The outbox rows as the relay sends them: key, value, the three headers."""
    conn = connect(url)
    with conn, conn.cursor() as cur:
        cur.execute(
            "SELECT message_key, payload::text, event_id::text, payload ->> 'eventType',"
            " payload ->> 'correlationId' FROM messenger.integration_outbox ORDER BY id"
        )
        rows = cur.fetchall()
    conn.close()
    return [
        (
            key.encode(),
            value.encode(),
            [
                ("event-id", event_id.encode()),
                ("event-type", (event_type or "").encode()),
                ("correlation-id", (correlation or "").encode()),
            ],
        )
        for key, value, event_id, event_type, correlation in rows
    ]


def relay_settings(url: str, bootstrap: str, topic: str) -> Settings:
    return Settings(
        database_url=url, kafka_bootstrap_servers=bootstrap, conference_ended_topic=topic
    )


def relay_rate(url: str, bootstrap: str, topic: str, expected: int) -> float:
    """The reaper's relay (reaper.relay.Relay, as the task runs it): events per second."""
    from reaper.relay import Relay

    settings = relay_settings(url, bootstrap, topic)
    slot = ProducerSlot(settings)
    relay = Relay(settings, engine=engine_for(url), producers=slot)
    slot.get()  # connected before the clock starts, as on the baseline side
    published = 0
    started = time.perf_counter()
    try:
        while published < expected:
            result = relay.run()
            if result.failed or result.kafka_unavailable:
                raise RuntimeError(f"the relay failed: {result}")
            published += result.published
        return published / (time.perf_counter() - started)
    finally:
        slot.close()


def baseline_rate(settings: Settings, topic: str, recs: list, batch_size: int) -> float:
    """kafka-python alone: same records, same settings, batches, every ack awaited."""
    producer = KafkaProducer(**producer_config(settings))
    try:
        producer.partitions_for(topic)  # metadata before the clock starts
        started = time.perf_counter()
        for i in range(0, len(recs), batch_size):
            futures = [
                producer.send(topic, key=key, value=value, headers=headers)
                for key, value, headers in recs[i : i + batch_size]
            ]
            for future in futures:
                future.get(timeout=30)
        return len(recs) / (time.perf_counter() - started)
    finally:
        producer.close(timeout=10)


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
