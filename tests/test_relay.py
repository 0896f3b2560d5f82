"""The outbox relay against real PostgreSQL and a real Kafka-protocol broker (Tansu)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import cast

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from kafka import KafkaProducer
from kafka import errors as kafka_errors
from kafka.errors import KafkaTimeoutError
from sqlalchemy import Connection, Engine, text

from reaper import budgets, metrics, relay_pipeline
from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.events import Bus, CycleResult, RelayBatchCommitted, RelayResult, process_bus
from reaper.kafka import ProducerSlot, Unavailable, producer_config
from reaper.lease import Heartbeat, PassLock, pass_lock
from reaper.queries import OutboxRow, Queries
from reaper.relay import Relay
from reaper.relay_batches import RelayBatches, headers
from reaper.traceids import cycle_span_id_for
from tests.conftest import ROOT
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.facts import log_events
from tests.support.figures import figure
from tests.support.kafka import Tansu, create_topic, read_topic
from tests.support.ports import free_port


@pytest.fixture
def topic(kafka_broker: str) -> str:
    """A topic of this test alone on the session's broker."""
    name = f"test.conference-ended.{uuid.uuid4().hex[:10]}"
    create_topic(kafka_broker, name)
    return name


def relay_settings(database_url: str, bootstrap: str, topic: str, **overrides) -> Settings:
    values = {
        "database_url": database_url,
        "kafka_bootstrap_servers": bootstrap,
        "conference_ended_topic": topic,
        "kafka_timeout": timedelta(seconds=4),
        "relay_backoff_initial": timedelta(milliseconds=200),
        "relay_backoff_max": timedelta(seconds=1),
        **overrides,
    }
    return Settings(**values)


@pytest.fixture
def rsettings(database_url: str, kafka_broker: str, topic: str) -> Settings:
    return relay_settings(database_url, kafka_broker, topic)


class Producers:
    """Producer slots of the test's relays, closed at the end of the test."""

    def __init__(self) -> None:
        self.slots: list[ProducerSlot] = []

    def slot(self, settings: Settings) -> ProducerSlot:
        self.slots.append(ProducerSlot(settings))
        return self.slots[-1]

    def close(self) -> None:
        for slot in self.slots:
            slot.close(timeout=2)


@pytest.fixture
def producers() -> Iterator[Producers]:
    made = Producers()
    yield made
    made.close()


def make_relay(settings: Settings, engine: Engine, producers: Producers, **kwargs) -> Relay:
    return Relay(settings, engine=engine, producers=producers.slot(settings), **kwargs)


def reap(settings: Settings, engine: Engine, as_of: datetime = T0) -> CycleResult:
    return Reaper(settings, engine=engine).run_cycle(as_of)


def relay_lock(conn: Connection) -> int:
    """The relay lock, taken by this transaction as a pass's lock session takes it:
    its backend pid, which a claim outside a pass is fenced on."""
    pid = Queries(conn).try_relay_lock()
    assert pid is not None, "another session holds the relay lock"
    return pid


def outbox_rows(engine: Engine) -> list[dict]:
    with engine.connect() as conn:
        return f.outbox(conn)


def add_outbox_row(conn, *, topic: str, key: str, payload: dict | None = None) -> str:
    event_id = str(uuid.uuid4())
    value = payload or {"eventId": event_id, "eventType": "test", "correlationId": "c"}
    conn.execute(
        text(
            "INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload)"
            " VALUES (:e, :t, :k, CAST(:p AS jsonb))"
        ),
        {"e": event_id, "t": topic, "k": key, "p": json.dumps(value)},
    )
    return event_id


# -- reap, then relay ---------------------------------------------------------


def test_reaped_conference_reaches_kafka_as_the_contract_event(
    rsettings, engine, producers, topic, kafka_broker, caplog
):
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(seconds=91), peak_participant_count=3)
        alice = f.participant(
            conn,
            room["id"],
            joined_at=T0 - timedelta(minutes=20),
            left_at=T0 - timedelta(minutes=2),
        )
        rec = f.recording(conn, room["id"], status="Available")
        stale = f.conference(conn, idle=timedelta(hours=5), age=timedelta(hours=6), participants=1)
        failed = f.conference(conn, status="Provisioning", age=timedelta(minutes=3))
        f.conference(conn, idle=timedelta(seconds=10))  # within the grace: stays
    cycle = reap(rsettings, engine)
    assert (cycle["empty_timeout_count"], cycle["stale_timeout_count"]) == (1, 1)
    assert cycle["provision_failed_count"] == 1

    published_before = metrics.sample("messenger_outbox_relay_published_total")
    rows = {str(r["event_id"]): r for r in outbox_rows(engine)}  # before the relay deletes them
    result = make_relay(rsettings, engine, producers).run()
    assert result.to_json() == {"published": 2, "failed": 0, "parked": 0, "pending": 0}
    assert metrics.sample("messenger_outbox_relay_published_total") == published_before + 2
    assert metrics.sample("messenger_outbox_pending") == 0

    records = read_topic(kafka_broker, topic, expect=2)
    assert len(records) == 2, "exactly one record per ended conference"
    by_conf = {r.value["payload"]["conferenceId"]: r for r in records}
    assert set(by_conf) == {room["id"], stale["id"]}
    assert failed["id"] not in by_conf

    record = by_conf[room["id"]]
    row = rows[record.event_id]
    assert record.key == room["deal_id"] == row["message_key"]
    trace_id = uuid.UUID(cycle["run_id"]).hex  # the cycle's trace, for the consumers
    assert record.headers == {
        "event-id": record.event_id,
        "event-type": "pin.messenger.conference-ended.v1",
        "correlation-id": cycle["run_id"],
        "traceparent": f"00-{trace_id}-{cycle_span_id_for(cycle['run_id']):016x}-01",
    }
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", record.headers["traceparent"])
    assert record.value == {
        "eventId": record.event_id,
        "eventType": "pin.messenger.conference-ended.v1",
        "occurredAt": "2026-12-02T10:00:00Z",
        "correlationId": cycle["run_id"],
        "aggregateId": room["deal_id"],
        "payload": {
            "conferenceId": room["id"],
            "chatId": room["chat_id"],
            "dealId": room["deal_id"],
            "tenantId": room["tenant_id"],
            "mediaType": "Video",
            "status": "Ended",
            "endReason": "EmptyTimeout",
            "startedByUserId": room["started_by_user_id"],
            "startedAt": "2026-12-02T09:30:05Z",
            "endedAt": "2026-12-02T10:00:00Z",
            "durationSeconds": 1795,
            "peakParticipantCount": 3,
            "participants": [
                {
                    "userId": alice["user_id"],
                    "joinedAt": "2026-12-02T09:40:00Z",
                    "leftAt": "2026-12-02T09:58:00Z",
                }
            ],
            "participantsOmitted": 0,
            "wasRecorded": True,
            "recordingId": rec["id"],
        },
    }
    assert record.value == row["payload"]
    assert by_conf[stale["id"]].value["payload"]["endReason"] == "Timeout"
    assert by_conf[stale["id"]].key == stale["deal_id"]

    # each row left the outbox at its own acknowledgement: gone, and its event on Kafka
    assert outbox_rows(engine) == []
    assert {r.event_id for r in records} == set(rows)
    assert log_events(caplog, "relay.completed")[-1]["published"] == 2

    # A second pass has nothing left to send.
    again = make_relay(rsettings, engine, producers).run()
    assert again.to_json() == {"published": 0, "failed": 0, "parked": 0, "pending": 0}
    assert len(read_topic(kafka_broker, topic, expect=3, timeout=2)) == 2


@pytest.mark.parametrize("batch_size", [2000, 3], ids=["one-batch", "pipelined-batches-of-3"])
def test_events_of_one_deal_arrive_in_commit_order(
    rsettings, engine, producers, topic, kafka_broker, batch_size
):
    """With batches of 3 the deal's rows span batches that are in flight together."""
    rsettings = rsettings.model_copy(update={"relay_batch_size": batch_size})
    deal = f.new_id()
    other = f.new_id()
    expected = []
    # five conferences of one deal, each ended by its own cycle, interleaved with another deal
    for i in range(5):
        as_of = T0 + timedelta(minutes=i)
        with engine.begin() as conn:
            room = f.conference(conn, as_of=as_of, idle=timedelta(minutes=2), deal_id=deal)
            f.conference(conn, as_of=as_of, idle=timedelta(minutes=2), deal_id=other)
        reap(rsettings, engine, as_of)
        expected.append(room["id"])
    result = make_relay(rsettings, engine, producers).run()
    assert result.published == 10
    records = read_topic(kafka_broker, topic, expect=10)
    mine = [r for r in records if r.key == deal]
    assert len({r.partition for r in mine}) == 1
    mine.sort(key=lambda r: r.offset)
    assert [r.value["payload"]["conferenceId"] for r in mine] == expected


class _Failed:
    """A send whose acknowledgement failed with ``error`` (what the relay reads of
    kafka-python's future: ``is_done``, ``exception``, ``get``)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.is_done = True
        self.exception = error

    def get(self, timeout: float | None = None) -> None:
        raise self.error


class AckedSlot(ProducerSlot):
    """A real producer that records the event ids Kafka acknowledged with an offset."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.acked: set[str] = set()

    def get(self) -> KafkaProducer:
        real = super().get()
        slot = self

        class Producer:
            def send(self, topic, *, key, value, headers, partition):
                future = real.send(
                    topic, key=key, value=value, headers=headers, partition=partition
                )
                event_id = dict(headers)["event-id"].decode()

                def acknowledged(meta) -> None:
                    if meta.offset >= 0:
                        slot.acked.add(event_id)

                future.add_callback(acknowledged)
                return future

            def __getattr__(self, name):
                return getattr(real, name)

        return Producer()  # type: ignore[return-value]


class FailingSlot(ProducerSlot):
    """A real producer whose records of the chosen event ids fail, once each, with
    the given error (Tansu refuses nothing on its own)."""

    def __init__(self, settings: Settings, failures: dict[str, BaseException]) -> None:
        super().__init__(settings)
        self.failures = dict(failures)

    def get(self) -> KafkaProducer:
        real = super().get()
        slot = self

        class Producer:
            def send(self, topic, *, key, value, headers, partition):
                event_id = dict(headers)["event-id"].decode()
                if event_id in slot.failures:
                    return _Failed(slot.failures.pop(event_id))
                return real.send(topic, key=key, value=value, headers=headers, partition=partition)

            def __getattr__(self, name):
                return getattr(real, name)

        return Producer()  # type: ignore[return-value]


def test_a_failed_row_holds_back_its_key_while_other_keys_go_on(
    rsettings, engine, producers, topic, kafka_broker, caplog
):
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:
        first = add_outbox_row(conn, topic=topic, key="deal-a")
        second = add_outbox_row(conn, topic=topic, key="deal-a")
        other = add_outbox_row(conn, topic=topic, key="deal-b")
    # retriable: the partition's leader is moving
    slot = FailingSlot(rsettings, {first: kafka_errors.NotLeaderForPartitionError()})
    producers.slots.append(slot)
    relay = Relay(rsettings, engine=engine, producers=slot)

    result = relay.run()
    assert (result.published, result.failed, result.pending, result.held_back) == (1, 1, 2, 1)
    assert result.parked == 0
    rows = {str(r["event_id"]): r for r in outbox_rows(engine)}
    assert other not in rows  # deleted at its acknowledgement; on Kafka, read at the end
    assert rows[first]["published_at"] is None and rows[first]["attempts"] == 1
    assert rows[first]["parked_at"] is None
    assert "NotLeaderForPartitionError" in rows[first]["last_error"]
    assert rows[first]["next_attempt_at"] > datetime.now(UTC)
    assert rows[second]["published_at"] is None and rows[second]["attempts"] == 0
    [failed] = log_events(caplog, "relay.row_failed")
    assert failed["event_id"] == first and failed["message_key"] == "deal-a"

    # While the first row backs off, the second one still waits behind it.
    assert relay.run().published == 0
    assert [str(r["event_id"]) for r in outbox_rows(engine)] == [first, second]

    # Due again (the leader is back): both go, in order.
    with engine.begin() as conn:
        conn.execute(text("UPDATE messenger.integration_outbox SET next_attempt_at = now()"))
    assert relay.run().to_json() == {"published": 2, "failed": 0, "parked": 0, "pending": 0}
    records = read_topic(kafka_broker, topic, expect=3)
    deal_a = sorted((r for r in records if r.key == "deal-a"), key=lambda r: r.offset)
    assert [r.event_id for r in deal_a] == [first, second]
    assert [r.event_id for r in records if r.key == "deal-b"] == [other]
    assert outbox_rows(engine) == []


@pytest.mark.parametrize(
    "refusal",
    ["illegal-topic", "too-large"],
)
def test_a_row_refused_for_good_is_parked_and_holds_back_its_key(
    rsettings, engine, producers, topic, kafka_broker, caplog, refusal
):
    """Refused as not retriable: parked at once (parked_at, last_error); the later
    rows of its key wait behind it, pass after pass; other keys go on."""
    caplog.set_level(logging.INFO, "reaper")
    rsettings = rsettings.model_copy(update={"kafka_max_request_size": 4096})
    with engine.begin() as conn:
        if refusal == "illegal-topic":
            refused = add_outbox_row(conn, topic="no such topic!", key="deal-a")
        else:  # larger than REAPER_KAFKA_MAX_REQUEST_SIZE
            refused = add_outbox_row(
                conn, topic=topic, key="deal-a", payload={"eventId": "x", "pad": "p" * 8000}
            )
        later = add_outbox_row(conn, topic=topic, key="deal-a")
        other = add_outbox_row(conn, topic=topic, key="deal-b")
    relay = make_relay(rsettings, engine, producers)

    result = relay.run()
    assert (result.published, result.failed, result.parked, result.pending) == (1, 0, 1, 1)
    assert result.outbox_parked == 1 and result.held_back == 1
    rows = {str(r["event_id"]): r for r in outbox_rows(engine)}
    assert rows[refused]["parked_at"] is not None and rows[refused]["published_at"] is None
    assert rows[refused]["attempts"] == 1
    expected = "ValueError" if refusal == "illegal-topic" else "MessageSizeTooLargeError"
    assert expected in rows[refused]["last_error"]
    assert other not in rows  # acknowledged: gone; on Kafka, below
    assert rows[later]["published_at"] is None and rows[later]["attempts"] == 0
    [parked] = log_events(caplog, "relay.row_parked")
    assert parked["event_id"] == refused
    # The parked row is never claimed again, and its key's later row stays behind it.
    again = relay.run()
    assert again.to_json() == {"published": 0, "failed": 0, "parked": 0, "pending": 1}
    assert again.outbox_parked == 1
    assert [r.event_id for r in read_topic(kafka_broker, topic, expect=1)] == [other]


def test_a_later_event_goes_only_after_its_parked_predecessor(
    rsettings, engine, producers, topic, kafka_broker
):
    """Across batches: rows of the parked key claimed in a later batch still wait.
    Requeued while Kafka still refuses it, the row is parked again and the key stays
    held; requeued once the cause is fixed, both go, in commit order."""
    small = rsettings.model_copy(update={"kafka_max_request_size": 4096, "relay_batch_size": 2})
    with engine.begin() as conn:
        big = add_outbox_row(
            conn, topic=topic, key="deal-a", payload={"eventId": "x", "pad": "p" * 8000}
        )
        fillers = [add_outbox_row(conn, topic=topic, key=f"deal-{i}") for i in range(4)]
        later = add_outbox_row(conn, topic=topic, key="deal-a")  # a batch of its own
    relay = make_relay(small, engine, producers)
    first = relay.run()
    assert (first.published, first.parked, first.pending) == (4, 1, 1)
    assert sorted(r.event_id for r in read_topic(kafka_broker, topic, expect=4)) == sorted(fillers)

    def requeue() -> int:
        with engine.begin() as conn:
            return Queries(conn).requeue_outbox(big)

    assert requeue() == 1
    still = relay.run()  # still too large: parked again, the later row still waits
    assert (still.published, still.parked, still.pending) == (0, 1, 1)

    assert requeue() == 1
    fixed = make_relay(
        small.model_copy(update={"kafka_max_request_size": 1_048_576}), engine, producers
    )
    done = fixed.run()
    assert (done.published, done.parked, done.pending, done.outbox_parked) == (2, 0, 0, 0)
    records = read_topic(kafka_broker, topic, expect=6)
    deal_a = [r.headers["event-id"] for r in records if r.key == "deal-a"]
    assert deal_a == [big, later]


def test_a_row_out_of_attempts_is_parked(rsettings, engine, producers, topic):
    rsettings = rsettings.model_copy(update={"relay_max_attempts": 3})
    with engine.begin() as conn:
        stuck = add_outbox_row(conn, topic=topic, key="deal-a")
    slot = FailingSlot(rsettings, {})
    producers.slots.append(slot)
    relay = Relay(rsettings, engine=engine, producers=slot)
    for attempt in range(1, 4):
        slot.failures[stuck] = kafka_errors.NotEnoughReplicasError()
        with engine.begin() as conn:
            conn.execute(text("UPDATE messenger.integration_outbox SET next_attempt_at = NULL"))
        result = relay.run()
        [row] = outbox_rows(engine)
        assert row["attempts"] == attempt
        assert (row["parked_at"] is not None) == (attempt == 3), attempt
    assert result.parked == 1 and result.failed == 0
    assert "parked after 3 attempts" in row["last_error"]


def test_backoff_grows_and_is_capped(rsettings, engine, producers, topic):
    with engine.begin() as conn:
        event_id = add_outbox_row(conn, topic=topic, key="k")
    slot = FailingSlot(rsettings, {})
    producers.slots.append(slot)
    relay = Relay(rsettings, engine=engine, producers=slot)
    for attempt in range(5):
        slot.failures[event_id] = kafka_errors.NotEnoughReplicasError()
        with engine.begin() as conn:
            conn.execute(text("UPDATE messenger.integration_outbox SET next_attempt_at = NULL"))
        before = datetime.now(UTC)
        relay.run()
        after = datetime.now(UTC)
        [row] = outbox_rows(engine)
        assert row["attempts"] == attempt + 1
        expected = min(1.0, 0.2 * 2**attempt)  # 0.2, 0.4, 0.8, then the 1 s cap
        # the failure was marked somewhere between before and after
        earliest = (row["next_attempt_at"] - after).total_seconds()
        latest = (row["next_attempt_at"] - before).total_seconds()
        assert earliest - 0.01 <= expected <= latest + 0.01, (attempt, earliest, latest)


# -- Kafka down ---------------------------------------------------------------


@pytest.mark.process
def test_broker_down_then_back_drains_everything(database_url, engine, producers, caplog):
    caplog.set_level(logging.INFO, "reaper")
    broker = Tansu().start()
    try:
        topic = "pin.messenger.conference-ended.v1"
        create_topic(broker.bootstrap, topic)
        settings = relay_settings(database_url, broker.bootstrap, topic)
        relay = make_relay(settings, engine, producers)
        with engine.begin() as conn:
            f.conference(conn, idle=timedelta(minutes=5))
        reap(settings, engine)
        assert relay.run().published == 1  # the producer is connected

        broker.stop()
        with engine.begin() as conn:
            rooms = [f.conference(conn, idle=timedelta(minutes=5)) for _ in range(3)]
        reap(settings, engine, T0 + timedelta(minutes=1))
        started = time.monotonic()
        down = relay.run()
        elapsed = time.monotonic() - started
        assert (down.published, down.failed, down.pending) == (0, 3, 3)
        assert down.kafka_unavailable and down.oldest_pending_age_seconds > 0
        assert elapsed < 3 * settings.kafka_timeout.total_seconds()  # fails fast, generously
        pending = outbox_rows(engine)  # the first one left at its acknowledgement
        assert len(pending) == 3 and all(r["published_at"] is None for r in pending)
        # backed off with why, but Kafka being down is no attempt charged to the rows
        assert all(r["attempts"] == 0 and r["last_error"] for r in pending)
        assert log_events(caplog, "relay.kafka_unavailable")
        assert metrics.sample("messenger_outbox_pending") == 3
        assert metrics.sample("messenger_outbox_oldest_pending_age_seconds") > 0

        broker.start()  # same port, empty memory storage
        create_topic(broker.bootstrap, topic)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if relay.run().pending == 0:
                break
            time.sleep(0.3)
        assert outbox_rows(engine) == []  # every row gone at its acknowledgement
        assert metrics.sample("messenger_outbox_pending") == 0
        assert metrics.sample("messenger_outbox_oldest_pending_age_seconds") == 0
        records = read_topic(broker.bootstrap, topic, expect=3)
        conferences = Counter(r.value["payload"]["conferenceId"] for r in records)
        assert {room["id"] for room in rooms} <= set(conferences)
        assert {str(r["event_id"]) for r in pending} <= {r.event_id for r in records}
    finally:
        broker.stop()


# -- failures in the middle of a pipelined pass ---------------------------------


def add_spread_rows(engine: Engine, topic: str, keys: int, per_key: int) -> list[tuple[str, str]]:
    """``keys`` deals with ``per_key`` events each, interleaved: (key, event id) in
    commit order. With more deals than a batch holds, batches overlap: while one
    settles, the next claims the deals it does not hold."""
    rows = []
    with engine.begin() as conn:
        for _ in range(per_key):
            for k in range(keys):
                rows.append((f"deal-{k}", add_outbox_row(conn, topic=topic, key=f"deal-{k}")))
    return rows


def published_prefixes(engine: Engine, rows: list[tuple[str, str]]) -> dict[str, int]:
    """Per key of ``rows`` (key, event id, in commit order): how many of its rows
    are published, i.e. gone from the outbox (deleted at their acknowledgement);
    asserts they are the first ones (nothing overtook an earlier row of its deal)
    and that every row still there is pending. The caller checks that the gone
    ones are on Kafka."""
    left = {str(r["event_id"]): r for r in outbox_rows(engine)}
    assert all(r["published_at"] is None for r in left.values())
    by_key: dict[str, list[bool]] = {}
    for key, event_id in rows:
        by_key.setdefault(key, []).append(event_id not in left)
    prefixes = {}
    for key, published in by_key.items():
        count = sum(published)
        assert published == [True] * count + [False] * (len(published) - count), key
        prefixes[key] = count
    return prefixes


def gone_ones(rows: list[tuple[str, str]], prefixes: dict[str, int]) -> set[str]:
    """The event ids of the rows ``published_prefixes`` counted as published."""
    seen: Counter[str] = Counter()
    gone = set()
    for key, event_id in rows:
        if seen[key] < prefixes[key]:
            gone.add(event_id)
        seen[key] += 1
    return gone


@pytest.mark.process
def test_discarding_a_producer_with_records_in_flight_returns_at_once(database_url, caplog):
    """Kafka gone while records are in flight (a pipelined pass's next batch):
    dropping the producer neither raises nor waits; its records fail at their
    delivery timeout and the dropped producer is closed after them."""
    broker = Tansu().start()
    try:
        topic = "pin.messenger.conference-ended.v1"
        create_topic(broker.bootstrap, topic)
        slot = ProducerSlot(relay_settings(database_url, broker.bootstrap, topic))
        producer = slot.get()
        producer.send(topic, key=b"deal", value=b"{}").get(timeout=10)  # the batch before
        assert broker.proc is not None
        broker.proc.kill()
        broker.proc.wait()
        in_flight = producer.send(topic, key=b"deal", value=b"{}")

        started = time.monotonic()
        slot.discard("Kafka unavailable: test")
        assert time.monotonic() - started < 0.5
        [closer] = [t for t in threading.enumerate() if t.name == "kafka-discard"]

        with pytest.raises(KafkaTimeoutError):
            in_flight.get(timeout=10)  # the delivery timeout: 4 s here
        closer.join(timeout=10)
        assert not closer.is_alive()
        assert [e["reason"] for e in log_events(caplog, "kafka.producer_discarded")] == [
            "Kafka unavailable: test"
        ]
        assert log_events(caplog, "kafka.flush_failed") == []  # closed, not given up
    finally:
        broker.stop()


@pytest.mark.process
def test_broker_stopping_mid_pass_marks_only_acknowledged_rows_in_order(
    database_url, engine, producers
):
    """Kafka goes away while batches are in flight: the pass ends, what was
    acknowledged is deleted and nothing else, no row is charged or parked, each
    deal's published rows are its first ones; the next pass, Kafka back, sends the
    rest in order. The killed broker's storage goes with it, so what was on Kafka
    is what it acknowledged with an offset (acks=all)."""
    broker = Tansu().start()
    port = broker.port
    try:
        topic = "pin.messenger.conference-ended.v1"
        create_topic(broker.bootstrap, topic)
        settings = relay_settings(database_url, broker.bootstrap, topic, relay_batch_size=100)
        rows = add_spread_rows(engine, topic, keys=400, per_key=10)
        bus = Bus()
        killed = threading.Event()

        def kill_broker_once(fact: RelayBatchCommitted) -> None:
            if fact.published and not killed.is_set():
                killed.set()
                assert broker.proc is not None
                broker.proc.kill()  # at once, mid-pass: later batches are in flight

        bus.subscribe(RelayBatchCommitted, kill_broker_once)
        slot = AckedSlot(settings)
        producers.slots.append(slot)
        relay = Relay(settings, engine=engine, producers=slot, bus=bus)
        started = time.monotonic()
        down = relay.run()
        assert time.monotonic() - started < 30
        broker.stop()
        assert killed.is_set() and down.kafka_unavailable and 0 < down.published < len(rows)
        assert down.parked == 0 and down.pending == len(rows) - down.published
        prefixes = published_prefixes(engine, rows)
        assert sum(prefixes.values()) == down.published
        assert gone_ones(rows, prefixes) <= slot.acked  # deleted only once on Kafka
        assert all(r["parked_at"] is None for r in outbox_rows(engine))

        broker = Tansu(port=port).start()  # Kafka is back (empty: a new broker)
        create_topic(broker.bootstrap, topic)
        with engine.begin() as conn:  # due again now, not after the back-off
            conn.execute(text("UPDATE messenger.integration_outbox SET next_attempt_at = NULL"))
        back = relay.run()
        assert (back.published, back.pending, back.parked) == (len(rows) - down.published, 0, 0)
        records = read_topic(broker.bootstrap, topic, expect=back.published)
        for key, done in prefixes.items():
            sent = [r.event_id for r in sorted(records, key=lambda r: r.offset) if r.key == key]
            assert sent == [e for k, e in rows if k == key][done:], key
    finally:
        broker.stop()


@pytest.mark.parametrize("how", ["stop-asked", "pass-bound"])
def test_a_pass_ended_mid_way_settles_its_batches_in_flight(
    rsettings, engine, producers, topic, kafka_broker, how
):
    """A warm shutdown (the stop event) or REAPER_RELAY_MAX_PASS_DURATION in the
    middle of a pass: no new claim, the batches in flight are awaited and marked,
    so every record on Kafka is a published row (none sent twice, none left
    unmarked) and each deal's published rows are its first ones."""
    bound = timedelta(seconds=1) if how == "pass-bound" else timedelta(seconds=60)
    settings = rsettings.model_copy(
        update={"relay_batch_size": 100, "relay_max_pass_duration": bound}
    )
    rows = add_spread_rows(engine, topic, keys=400, per_key=10)
    stop = threading.Event()
    bus = Bus()

    def slow_close(fact: RelayBatchCommitted) -> None:
        if how == "stop-asked":
            stop.set()  # after the first batch: the one claimed meanwhile still settles
        else:
            time.sleep(0.3)  # batches close slowly: the pass's bound comes first

    bus.subscribe(RelayBatchCommitted, slow_close)
    relay = make_relay(settings, engine, producers, bus=bus, stop_event=stop)
    started = time.monotonic()
    result = relay.run()
    assert time.monotonic() - started < bound.total_seconds() + 5
    assert 0 < result.published < len(rows) and not result.timed_out
    assert result.pending == len(rows) - result.published
    prefixes = published_prefixes(engine, rows)
    assert sum(prefixes.values()) == result.published
    records = read_topic(kafka_broker, topic, expect=result.published + 1, timeout=3)
    assert len(records) == result.published
    assert {r.event_id for r in records} == gone_ones(rows, prefixes)
    with engine.connect() as conn:  # nothing is left locked: all of it claimable again
        claimable = Queries(conn).claim_outbox_batch(10_000, relay_lock(conn))
        conn.rollback()
    assert len(claimable) == result.pending


def test_a_record_refused_mid_pass_is_parked_and_the_pass_goes_on(
    rsettings, engine, producers, topic, kafka_broker
):
    """A record Kafka refuses for good in the middle of a pass of many batches in
    flight: parked, its deal's later rows wait behind it, every other row is
    published in order."""
    settings = rsettings.model_copy(
        update={"relay_batch_size": 100, "kafka_max_request_size": 4096}
    )
    # more deals than a batch holds: while one batch settles the next is claimed
    # and sent (deals of the first one wait behind it), so batches overlap
    rows = add_spread_rows(engine, topic, keys=250, per_key=4)
    refused_key, refused_id = rows[len(rows) // 2]
    with engine.begin() as conn:  # too large to send
        conn.execute(
            text(
                "UPDATE messenger.integration_outbox SET payload = payload"
                " || jsonb_build_object('pad', repeat('p', 8000)) WHERE event_id = CAST(:e AS uuid)"
            ),
            {"e": refused_id},
        )
    mine = [e for k, e in rows if k == refused_key]
    behind = len(mine) - mine.index(refused_id) - 1
    result = make_relay(settings, engine, producers).run()
    assert (result.parked, result.failed) == (1, 0)
    assert (result.published, result.pending) == (len(rows) - 1 - behind, behind)
    prefixes = published_prefixes(engine, rows)
    assert prefixes[refused_key] == mine.index(refused_id)
    records = sorted(
        read_topic(kafka_broker, topic, expect=result.published), key=lambda r: r.offset
    )
    for key, done in prefixes.items():
        assert [r.event_id for r in records if r.key == key] == [e for k, e in rows if k == key][
            :done
        ], key


MARK_REFUSED = """
CREATE FUNCTION messenger.test_refuse_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'this mark is refused'; END $$;
CREATE TRIGGER test_refuse_mark BEFORE DELETE ON messenger.integration_outbox FOR EACH ROW
    WHEN (OLD.event_id = CAST('{event_id}' AS uuid))
    EXECUTE FUNCTION messenger.test_refuse_mark();
"""


def test_a_mark_the_database_refuses_mid_pass_loses_nothing_and_keeps_the_order(
    rsettings, engine, producers, topic, kafka_broker, caplog
):
    """The database refuses one batch's mark while the next batch, claimed and sent
    meanwhile, is in flight: the pass ends (relay.db_failed), both batches roll
    back, so only rows whose own acknowledgement came in an earlier committed batch
    are published (each deal's first ones), none is charged or parked; the next
    pass sends the rest again (at least once) and every deal's events reach Kafka
    in commit order."""
    caplog.set_level(logging.INFO, "reaper")
    settings = rsettings.model_copy(update={"relay_batch_size": 100})
    # more deals than a batch holds: while one batch settles the next is claimed
    # and sent (deals of the first one wait behind it), so batches overlap
    rows = add_spread_rows(engine, topic, keys=250, per_key=4)
    _, refused_id = rows[len(rows) // 2]
    with engine.begin() as conn:
        conn.exec_driver_sql(MARK_REFUSED.format(event_id=refused_id))
    try:
        down = make_relay(settings, engine, producers).run()
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "DROP TRIGGER test_refuse_mark ON messenger.integration_outbox;"
                " DROP FUNCTION messenger.test_refuse_mark()"
            )
    assert down.database_failed and 0 < down.published < len(rows) // 2 + 100
    assert (down.failed, down.parked, down.pending) == (0, 0, len(rows) - down.published)
    [failed] = log_events(caplog, "relay.db_failed")
    assert "this mark is refused" in failed["error"]
    prefixes = published_prefixes(engine, rows)
    pending = outbox_rows(engine)
    assert [r for r in pending if r["attempts"] or r["last_error"] or r["parked_at"]] == []
    sent = read_topic(kafka_broker, topic, expect=down.published + 1, timeout=5)
    # sent but rolled back: the refused batch and the one in flight behind it
    assert len(sent) > down.published
    published = gone_ones(rows, prefixes)
    assert published <= {r.event_id for r in sent}  # deleted only after its own ack

    again = make_relay(settings, engine, producers).run()
    assert (again.published, again.pending, again.parked) == (len(rows) - down.published, 0, 0)
    records = sorted(
        read_topic(kafka_broker, topic, expect=len(sent) + again.published), key=lambda r: r.offset
    )
    for key in prefixes:
        seen: list[str] = []
        for record in records:
            if record.key == key and record.event_id not in seen:
                seen.append(record.event_id)
        assert seen == [e for k, e in rows if k == key], key  # a duplicate never reorders


def test_unreachable_kafka_fails_fast_and_marks_nothing_published(
    database_url, engine, producers, caplog
):
    caplog.set_level(logging.INFO, "reaper")
    settings = relay_settings(
        database_url, f"127.0.0.1:{free_port()}", "t", kafka_timeout=timedelta(seconds=2)
    )
    with engine.begin() as conn:
        for i in range(3):
            add_outbox_row(conn, topic="t", key=f"k{i}")
    started = time.monotonic()
    result = make_relay(settings, engine, producers).run()
    assert time.monotonic() - started < 10
    assert result.to_json() == {"published": 0, "failed": 3, "parked": 0, "pending": 3}
    rows = outbox_rows(engine)
    assert all(r["published_at"] is None and r["attempts"] == 0 for r in rows)
    assert all(r["next_attempt_at"] is not None for r in rows)
    assert all("KafkaTimeoutError" in r["last_error"] for r in rows)
    [line] = log_events(caplog, "relay.kafka_unavailable")
    assert line["rows"] == 3
    # backing off: the next pass does not even try
    assert make_relay(settings, engine, producers).run().failed == 0


def test_a_kafka_outage_longer_than_the_attempts_parks_nothing(database_url, engine, producers):
    """Measured before: every pass during an outage charged each row an attempt,
    so an outage of ~15 min (20 attempts with back-off) parked the whole backlog."""
    settings = relay_settings(
        database_url,
        f"127.0.0.1:{free_port()}",
        "t",
        kafka_timeout=timedelta(seconds=2),
        relay_max_attempts=2,
    )
    with engine.begin() as conn:
        for i in range(3):
            add_outbox_row(conn, topic="t", key=f"k{i}")
    relay = make_relay(settings, engine, producers)
    for _ in range(4):  # twice the attempts a row has
        with engine.begin() as conn:
            conn.execute(text("UPDATE messenger.integration_outbox SET next_attempt_at = NULL"))
        result = relay.run()
        assert (result.published, result.failed, result.pending) == (0, 3, 3)
    rows = outbox_rows(engine)
    assert all(r["parked_at"] is None and r["attempts"] == 0 for r in rows)
    assert all("KafkaTimeoutError" in r["last_error"] for r in rows)


def test_missing_topic_is_named(rsettings, engine, producers, caplog):
    """Tansu creates any topic it is asked about, so this checks the diagnosis the
    relay makes when a send times out while the brokers answer, on a producer whose
    brokers are connected but know no partition of the topic (as Kafka answers with
    allow_auto_create_topics off)."""
    caplog.set_level(logging.INFO, "reaper")
    with engine.connect() as holder, holder.begin():
        lock = PassLock(relay_lock(holder), Heartbeat(None, period_s=1.0, give_up_s=0.0))
        batches = RelayBatches(rsettings, engine, producers.slot(rsettings), process_bus, lock)
    missing = f"never.created.{uuid.uuid4().hex[:6]}"

    class Connected:
        def bootstrap_connected(self) -> bool:
            return True

        def partitions_for(self, topic: str) -> set[int]:
            if topic == missing:
                raise KafkaTimeoutError("Failed to update metadata after 5.0 secs.")
            return {0}

    class Unreachable(Connected):
        def bootstrap_connected(self) -> bool:
            return False

    topics = (missing, rsettings.conference_ended_topic)
    rows = [type("OutboxRow", (), {"topic": t})() for t in topics]
    # stand-ins with only what _unavailable asks of a producer
    connected, unreachable = cast(KafkaProducer, Connected()), cast(KafkaProducer, Unreachable())
    timed_out = Unavailable("unreachable", "KafkaTimeoutError: Failed to update metadata")
    batches._unavailable(timed_out, rows, connected)
    [line] = log_events(caplog, "relay.topic_missing")
    assert line["topic"] == missing and missing in line["reason"]
    assert not log_events(caplog, "relay.kafka_unavailable")

    batches._unavailable(timed_out, rows, unreachable)
    assert len(log_events(caplog, "relay.kafka_unavailable")) == 1


def test_soft_time_limit_ends_the_pass_and_marks_nothing(database_url, engine, producers, caplog):
    """Celery's soft limit arrives as an exception by signal; the relay's own
    error handling must not swallow it as a Kafka failure of the rows."""
    caplog.set_level(logging.INFO, "reaper")
    black_hole = socket.socket()  # accepts connections, never answers
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(16)
    bootstrap = f"127.0.0.1:{black_hole.getsockname()[1]}"
    settings = relay_settings(database_url, bootstrap, "t", kafka_timeout=timedelta(seconds=20))
    with engine.begin() as conn:
        add_outbox_row(conn, topic="t", key="k")

    def soft_limit(*_):
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, soft_limit)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    started = time.monotonic()
    try:
        result = make_relay(settings, engine, producers).run()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        black_hole.close()
    assert time.monotonic() - started < 8
    assert result.timed_out and result.to_json() == {
        "published": 0,
        "failed": 0,
        "parked": 0,
        "pending": 1,
    }
    [row] = outbox_rows(engine)
    assert (row["attempts"], row["last_error"], row["published_at"]) == (0, None, None)
    assert log_events(caplog, "relay.time_limit")
    assert not log_events(caplog, "relay.kafka_unavailable")


# -- at least once, never twice in a pass --------------------------------------

KILLED_RELAY = """
import os, sys
from reaper.config import Settings
from reaper.queries import Queries
from reaper.relay import Relay

def killed(self, ids):
    os._exit(137)  # sent and acknowledged, never marked

Queries.acknowledge_outbox = killed
Relay(Settings()).run()
"""


def test_relay_killed_between_send_and_mark_resends_the_same_event(
    rsettings, engine, producers, topic, kafka_broker
):
    with engine.begin() as conn:
        f.conference(conn, idle=timedelta(minutes=5))
    reap(rsettings, engine)
    env = {
        **os.environ,
        "REAPER_DATABASE_URL": rsettings.database_url,
        "REAPER_KAFKA_BOOTSTRAP_SERVERS": rsettings.kafka_bootstrap_servers,
        "REAPER_KAFKA_TIMEOUT": "4",
    }
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_RELAY], cwd=ROOT, env=env, capture_output=True, timeout=60
    )
    assert proc.returncode == 137, proc.stderr.decode()[-2000:]
    [row] = outbox_rows(engine)
    assert row["published_at"] is None and row["attempts"] == 0
    assert len(read_topic(kafka_broker, topic, expect=1)) == 1  # it did reach Kafka

    assert make_relay(rsettings, engine, producers).run().published == 1
    assert outbox_rows(engine) == []  # gone once its own acknowledgement came
    records = read_topic(kafka_broker, topic, expect=2)
    assert [r.event_id for r in records] == [str(row["event_id"])] * 2
    assert len({r.event_id for r in records}) == 1  # what a deduplicating consumer keeps


def test_two_pipelines_under_one_relay_lock_publish_each_row_once(
    database_url, engine, producers, topic, kafka_broker
):
    """A pass claims its next batch beside the batches in flight, and the claim
    alone keeps them apart: SKIP LOCKED, and a key left out while an earlier row
    of it is pending. Two pipelines at once under one relay lock (each as a pass
    runs it: reaper/relay_pipeline.py) press on that harder than one pass does."""
    settings = relay_settings(database_url, kafka_broker, topic, relay_batch_size=25)
    deal = f.new_id()
    with engine.begin() as conn:
        f.bulk_conferences(conn, 300)
        same_deal = [
            f.conference(conn, idle=timedelta(minutes=5, seconds=-i), deal_id=deal)["id"]
            for i in range(8)
        ]
    reap(settings, engine)
    rows = outbox_rows(engine)
    assert len(rows) == 308
    barrier = threading.Barrier(2)
    results: list[RelayResult] = []
    give_up_s = budgets.relay_pass_give_up(settings).total_seconds()
    with pass_lock(
        engine,
        settings,
        take=Queries.try_relay_lock,
        wait_for_marks=Queries.wait_relay_marks,
        give_up_s=give_up_s,
    ) as lock:
        assert lock is not None

        def run() -> None:
            slot = producers.slot(settings)
            batches = RelayBatches(settings, engine, slot, process_bus, lock)
            result = RelayResult()
            barrier.wait()
            relay_pipeline.run(batches, result, batch_size=25, more=lambda: True, bus=process_bus)
            results.append(result)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert len(results) == 2 and all(r.published > 0 for r in results), "both took part"
    # A pipeline ends when a claim with nothing in flight finds nothing; rows of
    # a key the other one held back at that moment wait for the next pass (seen
    # under load: 6 of 308). What must never happen is a row sent twice.
    together = sum(r.published for r in results)
    follow_up = make_relay(settings, engine, producers).run()
    assert together + follow_up.published == 308
    figure(f"two pipelines at once published {together} of 308, the next pass the rest")
    records = read_topic(kafka_broker, topic, expect=308)
    counts = Counter(r.event_id for r in records)
    assert len(counts) == 308 and max(counts.values()) == 1
    ordered = sorted((r for r in records if r.key == deal), key=lambda r: r.offset)
    by_event = {str(r["event_id"]): r["id"] for r in rows}
    assert [by_event[r.event_id] for r in ordered] == sorted(by_event[r.event_id] for r in ordered)
    assert [r.value["payload"]["conferenceId"] for r in ordered] == same_deal


def test_one_pass_at_a_time_the_other_only_measures(rsettings, engine, producers, caplog):
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:
        for i in range(3):
            add_outbox_row(conn, topic=rsettings.conference_ended_topic, key=f"k{i}")
    with engine.connect() as holder:
        holder.begin()
        assert Queries(holder).try_relay_lock()  # a pass "in flight" elsewhere
        result = make_relay(rsettings, engine, producers).run()
        assert result.skipped and result.to_json() == {
            "published": 0,
            "failed": 0,
            "parked": 0,
            "pending": 3,
        }
        assert log_events(caplog, "relay.skipped")
        holder.rollback()
    assert make_relay(rsettings, engine, producers).run().to_json() == {
        "published": 3,
        "failed": 0,
        "parked": 0,
        "pending": 0,
    }


# -- retention -----------------------------------------------------------------


def test_retention_deletes_old_published_rows_in_batches(rsettings, engine, producers, caplog):
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:
        conn.execute(
            text(
                """
                INSERT INTO messenger.integration_outbox
                  (event_id, topic, message_key, payload, created_at, published_at, attempts)
                SELECT gen_random_uuid(), 't', 'k' || g, '{}',
                       now() - make_interval(days => d.days),
                       CASE WHEN d.published THEN now() - make_interval(days => d.days) END,
                       CASE WHEN d.published THEN 1 ELSE 0 END
                FROM generate_series(1, :n) g
                CROSS JOIN (VALUES (8, true), (6, true)) AS d(days, published)
                """
            ),
            {"n": 2500},
        )
        add_outbox_row(conn, topic="bad topic!", key="old-but-pending")
        conn.execute(
            text(
                "UPDATE messenger.integration_outbox SET created_at = now() - interval '30 days'"
                " WHERE message_key = 'old-but-pending'"
            )
        )
    result = make_relay(rsettings, engine, producers).run()
    assert result.deleted == 2500
    with engine.connect() as conn:
        left = conn.execute(
            text(
                "SELECT count(*) FILTER (WHERE published_at < now() - interval '7 days'),"
                " count(*) FILTER (WHERE published_at IS NULL), count(*)"
                " FROM messenger.integration_outbox"
            )
        ).one()
    assert tuple(left) == (0, 1, 2501)
    assert log_events(caplog, "relay.retention_deleted")[0]["count"] == 2500


# -- the producer ----------------------------------------------------------------


def test_producer_keeps_idempotence_and_full_acks(rsettings):
    config = producer_config(rsettings)
    assert config["enable_idempotence"] is True and config["acks"] == "all"
    assert config["max_block_ms"] < rsettings.relay_max_pass_duration.total_seconds() * 1000
    producer = KafkaProducer(**config)
    try:
        # kafka-python silently drops idempotence on a conflicting setting
        assert producer.config["enable_idempotence"] is True
        assert producer.config["acks"] == -1
    finally:
        producer.close(timeout=2)


def test_producer_security_settings_are_passed(tmp_path, database_url):
    cafile = tmp_path / "ca.pem"
    cafile.write_text("x")
    settings = Settings(
        database_url=database_url,
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="SCRAM-SHA-512",
        kafka_sasl_username="reaper",
        kafka_sasl_password="s3cret",
        kafka_ssl_cafile=str(cafile),
    )
    config = producer_config(settings)
    assert config["security_protocol"] == "SASL_SSL"
    assert (config["sasl_mechanism"], config["sasl_plain_username"]) == ("SCRAM-SHA-512", "reaper")
    assert config["sasl_plain_password"] == "s3cret"
    assert (config["ssl_cafile"], config["ssl_check_hostname"]) == (str(cafile), True)
    assert "s3cret" not in repr(settings)
    plain = producer_config(Settings(database_url=database_url))
    assert plain["security_protocol"] == "PLAINTEXT" and "sasl_mechanism" not in plain


def test_the_process_slot_serves_the_settings_it_is_given(database_url, engine, monkeypatch):
    """The process's producer slot once served its first caller's settings to every
    later one: a relay given another Kafka sent to the first one's brokers (a
    relay after one with the tests' default bootstrap found Kafka unreachable)."""
    from reaper import kafka

    monkeypatch.setattr(kafka, "_process_slot", None)
    first = Settings(database_url=database_url, kafka_bootstrap_servers="127.0.0.1:1")
    same = first.model_copy()
    other = first.model_copy(update={"kafka_bootstrap_servers": "127.0.0.1:2"})
    slot = kafka.process_slot(first)
    assert kafka.process_slot(same) is slot  # a worker's settings: one slot, one producer
    replaced = kafka.process_slot(other)
    assert replaced is not slot and replaced.settings.kafka_bootstrap_servers == "127.0.0.1:2"
    assert Relay(other, engine=engine).producers is replaced


FORKED_SEND = """
import os, sys
from reaper.config import Settings
from reaper.kafka import close_producer
from tests.support.kafka import get_producer

settings = Settings()
parent = get_producer(settings)
parent.send(sys.argv[1], key=b"parent", value=b"{}").get(timeout=10)
pid = os.fork()
if pid == 0:
    child = get_producer(settings)
    assert child is not parent, "the child must not reuse the parent's producer"
    child.send(sys.argv[1], key=b"child", value=b"{}").get(timeout=10)
    close_producer()
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert get_producer(settings) is parent
close_producer()
assert get_producer(settings) is not parent
close_producer()
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_one_producer_per_process_created_after_the_fork(rsettings, topic, kafka_broker):
    env = {
        **os.environ,
        "REAPER_DATABASE_URL": rsettings.database_url,
        "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker,
        "REAPER_KAFKA_TIMEOUT": "4",
    }
    proc = subprocess.run(
        [sys.executable, "-c", FORKED_SEND, topic],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert sorted(r.key for r in read_topic(kafka_broker, topic, expect=2)) == ["child", "parent"]


# -- figures ---------------------------------------------------------------------


def test_relay_throughput_figures(database_url, engine, producers, topic, kafka_broker):
    """Prints the relay's events/second on this machine next to kafka-python alone
    sending the same records with the same settings, measured before and after the
    relay and averaged (the machine is shared; no timing assertion)."""
    settings = relay_settings(database_url, kafka_broker, topic)
    count = 5_000
    with engine.begin() as conn:
        f.bulk_conferences(conn, count)
    reap(settings.model_copy(update={"batch_size": 1000}), engine)
    # The same records as the relay will send them, straight from memory.
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT id, event_id::text, topic, message_key, attempts, payload::text,"
                " payload ->> 'eventType', payload ->> 'correlationId'"
                " FROM messenger.integration_outbox ORDER BY id"
            )
        )
        records = [
            (row.message_key.encode(), row.value.encode(), headers(row))
            for row in map(OutboxRow._make, rows)
        ]
    baseline_topic = f"{topic}.baseline"
    create_topic(kafka_broker, baseline_topic)
    producer = producers.slot(settings).get()
    producer.partitions_for(baseline_topic)

    def baseline() -> float:
        started = time.perf_counter()
        for i in range(0, count, settings.relay_batch_size):
            futures = [
                producer.send(baseline_topic, key=key, value=value, headers=headers)
                for key, value, headers in records[i : i + settings.relay_batch_size]
            ]
            for future in futures:
                future.get(timeout=10)
        return time.perf_counter() - started

    before = baseline()
    relay = make_relay(settings, engine, producers)
    relay.producers.get().partitions_for(topic)  # connected outside the measurement
    started = time.perf_counter()
    published = 0
    while published < count:
        result = relay.run()
        assert result.failed == 0
        published += result.published
    elapsed = time.perf_counter() - started
    alone = (before + baseline()) / 2
    assert published == count
    assert len(read_topic(kafka_broker, topic, expect=count, timeout=60, settle=0.2)) == count
    figure(
        f"relay: {count} events in {elapsed:.2f} s = {count / elapsed:,.0f} events/s; "
        f"kafka-python alone, same records and settings: {count / alone:,.0f} events/s; "
        f"ratio {alone / elapsed:.2f} (batch {settings.relay_batch_size}, Tansu memory broker, "
        "acks=all, idempotent)"
    )
