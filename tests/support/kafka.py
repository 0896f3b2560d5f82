"""Kafka helpers for tests: reading a topic; the private Tansu broker and topic
creation are bench/broker.py's (the bench starts its brokers the same way).

Tansu's consumer groups do not deliver, so a topic is read with ``assign()`` +
``seek_to_beginning()`` over all its partitions.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from bench.broker import Tansu, create_topic
from reaper import kafka
from reaper.config import Settings

__all__ = ["TOPIC", "Record", "Tansu", "create_topic", "get_producer", "read_topic"]

TOPIC = "pin.messenger.conference-ended.v1"


@dataclass
class Record:
    partition: int
    offset: int
    key: str
    value: dict[str, Any]
    headers: dict[str, str]
    timestamp_ms: int

    @property
    def event_id(self) -> str:
        event_id: str = self.value["eventId"]
        return event_id


def read_topic(
    bootstrap: str,
    topic: str = TOPIC,
    *,
    expect: int | None = None,
    timeout: float = 15.0,
    settle: float = 0.5,
    **security: Any,
) -> list[Record]:
    """Every record of the topic; waits until ``expect`` arrived (then ``settle``
    longer, to see any extra), or returns what is there after ``timeout``.
    ``security``: kafka-python's client settings (security_protocol, ssl_cafile...)."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        consumer_timeout_ms=1000,
        request_timeout_ms=10_000,
        **security,
    )
    try:
        partitions = None
        deadline = time.monotonic() + timeout
        while partitions is None and time.monotonic() < deadline:
            partitions = consumer.partitions_for_topic(topic)
            if partitions is None:
                time.sleep(0.2)
        if not partitions:
            return []
        consumer.assign([TopicPartition(topic, p) for p in sorted(partitions)])
        consumer.seek_to_beginning()
        records: list[Record] = []
        settled_at: float | None = None
        while time.monotonic() < deadline:
            for tp, batch in consumer.poll(timeout_ms=200).items():
                records.extend(
                    Record(
                        tp.partition,
                        r.offset,
                        r.key.decode(),
                        json.loads(r.value),
                        {k: v.decode() for k, v in r.headers},
                        r.timestamp,
                    )
                    for r in batch
                )
            if expect is not None and len(records) >= expect:
                settled_at = settled_at or time.monotonic() + settle
                if time.monotonic() >= settled_at:
                    break
        return records
    finally:
        consumer.close()


def get_producer(settings: Settings) -> KafkaProducer:
    """This process's producer, as the relay takes it (reaper.kafka.process_slot)."""
    return kafka.process_slot(settings).get()
