"""The relay pass's pipeline: what each thread does, the size of its claims, the
rows it reads by position, and the acknowledgements it reads without a wait.
Real PostgreSQL and the test broker; no worker processes."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from kafka import errors as kafka_errors
from sqlalchemy import text

from reaper import queries as queries_module
from reaper.events import Bus, RelayBatchCommitted, RelayCloseFailed
from reaper.queries import OutboxRow, Queries
from reaper.relay_batches import RelayBatches, _acknowledgement, headers
from reaper.relay_pipeline import first_claim
from tests.support.kafka import read_topic
from tests.test_relay import (  # the relay tests' fixtures and helpers
    add_outbox_row,
    make_relay,
    outbox_rows,
    producers,
    relay_lock,
    rsettings,
    topic,
)

__all__ = ["producers", "rsettings", "topic"]  # fixtures, used by name


def add_rows(engine, topic: str, count: int) -> list[str]:
    with engine.begin() as conn:
        return [add_outbox_row(conn, topic=topic, key=f"deal-{i}") for i in range(count)]


def test_the_first_claim_is_an_eighth_of_a_batch_and_each_next_twice_the_last(
    rsettings, engine, producers, topic, kafka_broker
):
    rsettings = rsettings.model_copy(update={"relay_batch_size": 16})
    ids = add_rows(engine, topic, 60)  # one key each: nothing is left out of a claim
    bus = Bus()
    claimed: list[int] = []
    bus.subscribe(RelayBatchCommitted, lambda fact: claimed.append(fact.claimed))

    result = make_relay(rsettings, engine, producers, bus=bus).run()

    assert result.published == 60
    assert claimed == [2, 4, 8, 16, 16, 14]
    assert {r.event_id for r in read_topic(kafka_broker, topic, expect=60)} == set(ids)
    assert outbox_rows(engine) == []


def test_the_first_claim_is_never_empty_for_a_small_batch_size():
    assert [first_claim(size) for size in (1, 7, 8, 2000, 10_000)] == [1, 1, 1, 250, 1250]


def test_the_next_batch_is_claimed_on_a_thread_of_its_own_while_this_one_is_sent(
    rsettings, engine, producers, topic, kafka_broker, monkeypatch
):
    """The k-th send waits (up to 5 s) for the (k+1)-th claim to have returned:
    with the claims on the sending thread, after its sends, none would."""
    rsettings = rsettings.model_copy(update={"relay_batch_size": 8})
    add_rows(engine, topic, 40)
    done = threading.Condition()
    claims: list[str] = []  # the thread of each claim, in the order they returned
    overlapped: list[bool] = []
    real_claim, real_send = RelayBatches.claim, RelayBatches.send

    def claim(self: RelayBatches, size: int, **kwargs: Any) -> Any:
        flight = real_claim(self, size, **kwargs)
        with done:
            claims.append(threading.current_thread().name)
            done.notify_all()
        return flight

    def send(self: RelayBatches, flight: Any) -> None:
        with done:
            following = len(overlapped) + 2
            overlapped.append(done.wait_for(lambda: len(claims) >= following, timeout=5))
        real_send(self, flight)

    monkeypatch.setattr(RelayBatches, "claim", claim)
    monkeypatch.setattr(RelayBatches, "send", send)

    result = make_relay(rsettings, engine, producers).run()

    assert result.published == 40
    assert overlapped == [True] * 8  # claims of 1, 2, 4, 8, 8, 8, 8 and 1 rows
    # the first claim and the one that ends the pass (none in flight) are this thread's
    assert claims[0] == claims[-1] == threading.current_thread().name
    assert len(claims) == 10 and all(name.startswith("relay-claim") for name in claims[1:-1])


def test_a_claim_beside_a_batch_in_flight_that_finds_nothing_does_not_end_the_pass(
    rsettings, engine, producers, topic, kafka_broker
):
    """Two rows of one key: the claim beside the first batch (its one row) leaves
    out the row behind it and finds nothing; the pass claims again once the
    first is settled, and sends the second."""
    rsettings = rsettings.model_copy(update={"relay_batch_size": 8})  # first claim: 1 row
    with engine.begin() as conn:
        first = add_outbox_row(conn, topic=topic, key="deal-a")
        second = add_outbox_row(conn, topic=topic, key="deal-a")
    result = make_relay(rsettings, engine, producers).run()
    assert result.published == 2
    records = read_topic(kafka_broker, topic, expect=2)
    assert [r.event_id for r in sorted(records, key=lambda r: r.offset)] == [first, second]


def test_a_claim_reads_its_rows_by_name_as_outbox_rows(engine, topic):
    with engine.begin() as conn:
        event_id = add_outbox_row(
            conn,
            topic=topic,
            key="deal-a",
            payload={"eventId": "e", "eventType": "t", "correlationId": "run-1"},
        )
    with engine.begin() as conn:
        [row] = Queries(conn).claim_outbox_batch(10, relay_lock(conn))
    assert isinstance(row, OutboxRow)
    assert (row.event_id, row.topic, row.message_key, row.attempts) == (
        event_id,
        topic,
        "deal-a",
        0,
    )
    assert (row.event_type, row.correlation_id) == ("t", "run-1")
    assert row.value == '{"eventId": "e", "eventType": "t", "correlationId": "run-1"}'


def test_a_claim_whose_columns_are_not_the_rows_fields_is_refused(engine, topic, monkeypatch):
    """The rows are read by position: a statement whose columns moved fails the
    claim instead of sending a payload as a key."""
    written = queries_module.statement
    claim = written("claim_outbox_batch", None, ()).text
    swapped = claim.replace(
        "SELECT c.id, c.event_id::text AS event_id, c.topic, c.message_key,",
        "SELECT c.id, c.event_id::text AS event_id, c.message_key, c.topic,",
    )
    assert swapped != claim

    def with_columns_swapped(name: str, phase: Any, order: Any) -> Any:
        return text(swapped) if name == "claim_outbox_batch" else written(name, phase, order)

    # every named query is run through queries.statement
    monkeypatch.setattr(queries_module, "statement", with_columns_swapped)
    with engine.begin() as conn:
        add_outbox_row(conn, topic=topic, key="deal-a")
    with engine.begin() as conn, pytest.raises(RuntimeError, match="message_key"):
        Queries(conn).claim_outbox_batch(10, relay_lock(conn))


def test_records_of_one_cycle_share_their_header_values_and_keep_their_order():
    rows = [
        OutboxRow(i, f"e{i}", "t", "k", 0, "{}", "pin.x.v1", "b6f1c8a4-3f2e-4c1a-9d7e-2b5a6c7d8e9f")
        for i in range(2)
    ]
    first, second = (headers(row) for row in rows)
    assert [name for name, _ in first] == [
        "event-id",
        "event-type",
        "correlation-id",
        "traceparent",
    ]
    assert first[0] == ("event-id", b"e0") and second[0] == ("event-id", b"e1")
    assert first[1:] == second[1:]
    assert first[1] is second[1]  # built once for the cycle, not per record
    without = headers(OutboxRow(3, "e3", "t", "k", 0, "{}", None, None))
    assert without == [("event-id", b"e3"), ("event-type", b""), ("correlation-id", b"")]


class _Future:
    """What the relay reads of kafka-python's future: ``is_done``, ``exception``, ``get``."""

    def __init__(self, *, done: bool, error: BaseException | None = None) -> None:
        self.is_done = done
        self.exception = error
        self.waited = False

    def get(self, timeout: float | None = None) -> None:
        self.waited = True
        raise kafka_errors.KafkaTimeoutError(f"not acknowledged within {timeout}")


def test_an_acknowledgement_already_in_is_read_without_a_wait():
    acked = _Future(done=True)
    _acknowledgement(acked, deadline=time.monotonic() + 5)
    assert not acked.waited


def test_a_failure_already_in_is_raised_without_a_wait():
    failed = _Future(done=True, error=kafka_errors.NotLeaderForPartitionError())
    with pytest.raises(kafka_errors.NotLeaderForPartitionError):
        _acknowledgement(failed, deadline=time.monotonic() + 5)
    assert not failed.waited


def test_an_acknowledgement_not_in_yet_is_awaited_until_the_deadline():
    pending = _Future(done=False)
    with pytest.raises(kafka_errors.KafkaTimeoutError):
        _acknowledgement(pending, deadline=time.monotonic() - 1)
    assert pending.waited


def test_a_time_limit_while_waiting_for_a_claim_leaves_the_batch_being_settled_to_its_settle(
    rsettings, engine, producers, topic, kafka_broker, monkeypatch
):
    """The soft time limit lands while this thread waits for the next claim and
    the batch it sent is still being settled: that batch is the settler's, which
    commits it; only the claimed batch rolls back."""
    rsettings = rsettings.model_copy(update={"relay_batch_size": 16})  # first claim: 2 rows
    ids = add_rows(engine, topic, 10)
    real_claim, real_settle = RelayBatches.claim, RelayBatches.settle

    def slow_claim(self: RelayBatches, size: int, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith("relay-claim"):
            time.sleep(2.0)  # the time limit lands while this thread waits for it
        return real_claim(self, size, **kwargs)

    def slow_settle(self: RelayBatches, flight: Any) -> Any:
        time.sleep(1.0)  # still settling when the time limit lands
        return real_settle(self, flight)

    monkeypatch.setattr(RelayBatches, "claim", slow_claim)
    monkeypatch.setattr(RelayBatches, "settle", slow_settle)

    def soft_limit(*_: Any) -> None:
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, soft_limit)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        result = make_relay(rsettings, engine, producers).run()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    assert result.timed_out
    assert result.published == 2  # the first batch, committed by its settle
    assert [r.event_id for r in read_topic(kafka_broker, topic, expect=2)] == ids[:2]
    assert [str(r["event_id"]) for r in outbox_rows(engine)] == ids[2:]


def test_a_settle_that_breaks_is_reported_and_ends_the_pass(
    rsettings, engine, producers, topic, kafka_broker, monkeypatch
):
    """Not a database error (a bug): the pass says so for each batch whose settle
    broke (RelayCloseFailed), claims nothing more, and the error goes up to the
    task."""
    rsettings = rsettings.model_copy(update={"relay_batch_size": 16})
    add_rows(engine, topic, 10)

    def broken(self: RelayBatches, flight: Any) -> Any:
        flight.abandon()
        raise RuntimeError("settle broke")

    monkeypatch.setattr(RelayBatches, "settle", broken)
    bus = Bus()
    failed: list[RelayCloseFailed] = []
    bus.subscribe(RelayCloseFailed, failed.append)
    with pytest.raises(RuntimeError, match="settle broke"):
        make_relay(rsettings, engine, producers, bus=bus).run()
    # the first batch's settle and the second's, sent while the first was settled;
    # no claim after a settle that broke
    assert [fact.error for fact in failed] == ["RuntimeError: settle broke"] * 2
    assert len(outbox_rows(engine)) == 10  # nothing committed; sent again next pass
