"""The relay gives each record the partition kafka-python's default partitioner
would choose: the hash against kafka-python's own murmur2, the choice against its
DefaultPartitioner, and the records on a real broker against a stock producer's."""

from __future__ import annotations

import random
import uuid

from kafka import KafkaProducer
from kafka.partitioner import DefaultPartitioner, murmur2
from sqlalchemy import Engine

from reaper.kafka import producer_config
from reaper.partitions import Partitions, key_hashes
from tests.support.kafka import create_topic, read_topic
from tests.test_relay import (  # the relay tests' fixtures and helpers
    Producers,
    add_outbox_row,
    make_relay,
    producers,
    relay_settings,
)

__all__ = ["producers"]  # a fixture, used by name


def test_key_hashes_are_kafka_pythons_murmur2_with_the_sign_bit_cleared() -> None:
    rng = random.Random(24)
    keys = [rng.randbytes(n) for n in range(81) for _ in range(5)]  # every tail length
    keys += [str(uuid.uuid4()).encode() for _ in range(200)]  # the deal ids
    keys += ["сделка-№7".encode(), b"", b"\xff" * 4, keys[3]]  # non-ASCII, empty, a repeat
    rng.shuffle(keys)  # lengths interleaved, as a batch's keys are
    assert key_hashes(keys) == [murmur2(key) & 0x7FFFFFFF for key in keys]
    assert key_hashes([]) == []


class _Cluster:
    """What DefaultPartitioner reads of kafka-python's cluster metadata."""

    def __init__(self, topic: str, partitions: set[int]) -> None:
        self.topic, self.partitions = topic, partitions

    def topics(self) -> set[str]:
        return {self.topic}

    def partitions_for_topic(self, topic: str) -> set[int]:
        return self.partitions

    def available_partitions_for_topic(self, topic: str) -> set[int]:
        return self.partitions


class _Producer:
    """What Partitions reads of a producer: the topic's partitions."""

    def __init__(self, partitions: set[int]) -> None:
        self.partitions = partitions
        self.asked = 0

    def partitions_for(self, topic: str) -> set[int]:
        self.asked += 1
        return self.partitions


def test_the_partition_is_the_one_the_default_partitioner_chooses() -> None:
    rng = random.Random(5)
    keys = [rng.randbytes(rng.randrange(1, 40)) for _ in range(2_000)]
    hashes = key_hashes(keys)
    for partitions in ({0}, {0, 1, 2}, set(range(7)), set(range(12)), {4, 0, 9, 2}):
        producer = _Producer(partitions)
        chosen = Partitions(producer)  # type: ignore[arg-type]
        cluster = _Cluster("t", partitions)
        default = DefaultPartitioner()
        for key, key_hash in zip(keys, hashes, strict=True):
            assert chosen.of("t", key_hash) == default.partition("t", key, key, b"", b"", cluster)
        assert producer.asked == 1  # read once per round, not per record


def test_the_relays_records_land_where_kafka_python_puts_their_keys(
    database_url: str, engine: Engine, producers: Producers, kafka_broker: str
) -> None:
    """The same keys, sent by the relay and by a stock producer (a previous release,
    another client), end on the same partitions of two 5-partition topics: a deal's
    events keep their partition, and so their order, across a deploy."""
    relayed, stock = (f"test.partitions.{uuid.uuid4().hex[:8]}.{n}" for n in ("relay", "stock"))
    for topic in (relayed, stock):
        create_topic(kafka_broker, topic, partitions=5)
    keys = [str(uuid.uuid4()) for _ in range(150)] + [f"deal-{n}" for n in range(40)]
    keys += ["сделка-№1", "x", ""]
    with engine.begin() as conn:
        for key in keys:
            add_outbox_row(conn, topic=relayed, key=key)
    settings = relay_settings(database_url, kafka_broker, relayed)
    assert make_relay(settings, engine, producers).run().published == len(keys)
    producer = KafkaProducer(**producer_config(settings))
    try:
        for key in keys:
            producer.send(stock, key=key.encode(), value=b"{}")
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=5)

    def partition_by_key(topic: str) -> dict[str, int]:
        records = read_topic(kafka_broker, topic, expect=len(keys), timeout=30, settle=0.2)
        assert len(records) == len(keys)
        return {r.key: r.partition for r in records}

    by_relay = partition_by_key(relayed)
    assert by_relay == partition_by_key(stock)
    assert len(set(by_relay.values())) == 5
