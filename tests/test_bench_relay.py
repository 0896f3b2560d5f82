"""The relay figure's two sides read the same events: ``fresh_backlog`` writes the
drain's events anew into the outbox from the bench's copy, and kafka-python alone
(``bench.kafka_alone``, a process of its own) sends that copy's first events as
the relay sends them. Only that both sides see the same records is checked here;
the rates are the bench's business."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text

from bench import relay as bench_kafka
from reaper.traceids import traceparent
from tests.support.kafka import create_topic, read_topic

EVENTS = 10


@pytest.fixture
def drained(engine: Engine, database_url: str) -> Iterator[str]:
    """An outbox holding EVENTS conference-ended events, as the drain leaves it; the
    bench's copy and the outbox's storage setting undone afterwards."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload)"
                " SELECT gen_random_uuid(), 'bench.t', 'deal-' || n,"
                " jsonb_build_object('eventType', 'ConferenceEnded', 'correlationId',"
                " 'c-' || n, 'payload', jsonb_build_object('conferenceId', 'conf-' || n))"
                " FROM generate_series(1, :events) n"
            ),
            {"events": EVENTS},
        )
    try:
        yield database_url
    finally:
        bench_kafka.autovacuum_back(database_url)
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA IF EXISTS bench CASCADE"))


def keys(engine: Engine, rows: str) -> list[str]:
    """The message keys of ``rows`` (a table and its order), in that order."""
    with engine.connect() as conn:
        return list(conn.execute(text(f"SELECT message_key FROM {rows}")).scalars().all())


def written(engine: Engine) -> list[str]:
    return keys(engine, "bench.outbox_written ORDER BY position")


def pending(engine: Engine) -> list[str]:
    return keys(engine, "messenger.integration_outbox ORDER BY id")


def test_fresh_backlog_keeps_the_drains_events_while_a_backlog_of_its_own_is_pending(
    drained: str, engine: Engine
) -> None:
    everything = [f"deal-{n}" for n in range(1, EVENTS + 1)]
    assert bench_kafka.fresh_backlog(drained, 4) == 4
    assert written(engine) == everything
    assert pending(engine) == everything[:4]
    # kafka-python alone went first: the backlog written for it is still pending,
    # as large as the next one asked for; the copy stays the drain's
    assert bench_kafka.fresh_backlog(drained, 4) == 4
    assert written(engine) == everything
    assert bench_kafka.fresh_backlog(drained, EVENTS) == EVENTS
    assert pending(engine) == everything


def test_kafka_alone_sends_the_first_written_events_as_the_relay_does(
    drained: str, engine: Engine, kafka_broker: str
) -> None:
    bench_kafka.fresh_backlog(drained, EVENTS)  # the copy, as the drain's events
    topic = "bench.kafka-alone"
    create_topic(kafka_broker, topic, partitions=1)
    assert bench_kafka.kafka_alone(drained, kafka_broker, topic, 6) > 0
    got = read_topic(kafka_broker, topic, expect=6)
    assert [r.key for r in got] == [f"deal-{n}" for n in range(1, 7)]
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT event_id::text, payload::text FROM bench.outbox_written"
                " ORDER BY position LIMIT 6"
            )
        ).all()
    assert [r.value for r in got] == [json.loads(payload) for _, payload in rows]
    assert [r.headers for r in got] == [
        {
            "event-id": event_id,
            "event-type": "ConferenceEnded",
            "correlation-id": json.loads(payload)["correlationId"],
            "traceparent": traceparent(json.loads(payload)["correlationId"]),
        }
        for event_id, payload in rows
    ]


def test_kafka_alone_with_the_partitions_given_puts_each_key_where_kafka_python_does(
    drained: str, kafka_broker: str
) -> None:
    """The bench's second baseline sends as the relay does (partitions hashed a
    batch at a time, given to send): on the partitions kafka-python alone chooses."""
    bench_kafka.fresh_backlog(drained, EVENTS)
    stock, given = (f"bench.alone.{uuid.uuid4().hex[:8]}.{side}" for side in ("stock", "given"))
    for topic in (stock, given):
        create_topic(kafka_broker, topic, partitions=3)
    assert bench_kafka.kafka_alone(drained, kafka_broker, stock, EVENTS) > 0
    assert bench_kafka.kafka_alone(drained, kafka_broker, given, EVENTS, partitions_given=True) > 0

    def partition_by_key(topic: str) -> dict[str, int]:
        return {r.key: r.partition for r in read_topic(kafka_broker, topic, expect=EVENTS)}

    chosen = partition_by_key(given)
    assert chosen == partition_by_key(stock)
    assert len(chosen) == EVENTS and len(set(chosen.values())) > 1
