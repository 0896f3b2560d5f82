"""A relay pass's batches (:class:`RelayBatches`): each in a transaction of its own,
from its claim to its commit.

1. **claim** due rows (``FOR UPDATE SKIP LOCKED``, oldest first, at most one
   row per message key ahead of an earlier pending row of that key), starting
   where the pass's :class:`~reaper.relay_floor.ClaimFloor` says;
2. **send** the first round: the oldest row of every key, as one burst, each
   record with its partition given (the default partitioner's choice, computed
   for the batch's keys at once: reaper/partitions.py);
3. **await** every acknowledgement of the round (``future.get`` per record),
   then send the next round (the next row of each acknowledged key);
4. **mark**: delete each row at its own acknowledgement
   (``messenger.acknowledge_outbox``: a sent row leaves the outbox, no new row
   version), back off each row that failed, park each row Kafka refused for
   good; commit.

The batches in flight never share a key (a claim leaves out a key with an
earlier pending row), so a deal's events never overtake each other. Killed
between the send and the mark, a batch's transaction rolls back, its rows are
still there, and the next pass re-sends the same ``eventId`` (at least once;
consumers dedupe by it). A row deleted is one whose own acknowledgement
arrived, in a transaction that commits only behind the fence: so a deal's next
event is claimed only once its earlier one is gone, which it is only once Kafka
has it. The claims and the marks are fenced on the pass's lock session: a
relay that lost the lock claims nothing more, and a batch it settles afterwards
commits nothing (its rows are sent again by the pass that took over). See
docs/design.md#the-outbox-relay.

Errors are classified by kafka-python's public ``KafkaError.retriable``:
Kafka unreachable ends the pass at once; a retriable failure backs the row
off; a record refused for good (too large, an invalid topic) is parked, and
holds back the later rows of its key until an operator requeues it (nothing
overtakes it; docs/design.md#parked-events); any other non-retriable error means
the producer itself is broken: the row backs off and the producer is replaced.
A row that failed ``REAPER_RELAY_MAX_ATTEMPTS`` times is parked too.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from contextlib import suppress
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from kafka import KafkaProducer
from kafka import errors as kafka_errors
from sqlalchemy import Connection, Engine, RootTransaction
from sqlalchemy.exc import SQLAlchemyError

from reaper import budgets
from reaper.config import Settings
from reaper.db import begin
from reaper.errors import describe
from reaper.events import (
    Bus,
    RelayBatchCommitted,
    RelayKafkaUnavailable,
    RelayResult,
    RelayTopicMissing,
)
from reaper.kafka import ProducerSlot, Unavailable, diagnose
from reaper.lease import Heartbeat, PassLock
from reaper.logs import get_logger, log
from reaper.partitions import Partitions, key_hashes
from reaper.queries import OutboxRow, Queries
from reaper.relay_floor import ClaimFloor
from reaper.traceids import traceparent

logger = get_logger("relay")

# "Kafka is not there", not "this record was refused": the pass stops at once
# instead of waiting out every remaining record.
UNAVAILABLE = (kafka_errors.KafkaTimeoutError, kafka_errors.KafkaConnectionError)
# The record itself can never be accepted (docs/design.md#parked-events).
REFUSED_FOR_GOOD = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.InvalidRecordError,
    kafka_errors.CorruptRecordError,
    kafka_errors.InvalidTopicError,
)


def refused_for_good(exc: BaseException) -> bool:
    """The record can never be accepted: Kafka's own verdict on it, or the producer
    refusing its arguments (an illegal topic name, a bad header) before sending."""
    if isinstance(exc, kafka_errors.KafkaError):
        return isinstance(exc, REFUSED_FOR_GOOD)
    return isinstance(exc, ValueError | TypeError)


def breaks_the_producer(exc: BaseException) -> bool:
    """A failure that is neither retriable nor about one record: the producer
    (its idempotent session) is broken and must be replaced."""
    return (
        isinstance(exc, kafka_errors.KafkaError)
        and not exc.retriable
        and not isinstance(exc, REFUSED_FOR_GOOD)
    )


@dataclass
class BatchReport:
    claimed: int = 0
    published: list[int] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)  # backed off, an attempt charged
    # Kafka could not be reached: backed off, no attempt charged (not the row's fault)
    unreached: dict[int, str] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)  # parked: refused for good
    out_of_attempts: int = 0  # of the failures, parked for having no attempt left
    held_back: int = 0
    unavailable: BaseException | None = None
    producer_broken: bool = False
    # the relay lock was gone when the batch came to its marks: nothing committed
    fenced: bool = False

    def add_to(self, result: RelayResult) -> None:
        """This settled batch's part of the pass: the one place totals are added up."""
        result.lock_lost = result.lock_lost or self.fenced
        result.published += len(self.published)
        result.failed += len(self.failures) + len(self.unreached) - self.out_of_attempts
        result.parked += len(self.refused) + self.out_of_attempts
        result.held_back += self.held_back
        result.kafka_unavailable = result.kafka_unavailable or self.unavailable is not None


@dataclass
class InFlight:
    """A claimed batch whose transaction is still open."""

    conn: Connection
    transaction: RootTransaction
    heartbeat: Heartbeat  # speaks on the transaction while it waits on Kafka
    rows: list[OutboxRow] = field(default_factory=list)
    report: BatchReport = field(default_factory=BatchReport)
    by_key: OrderedDict[str, deque[OutboxRow]] = field(default_factory=OrderedDict)
    # each key's bytes and its murmur2, hashed with the claim (reaper/partitions.py)
    keys: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    producer: KafkaProducer | None = None
    sent: list[tuple[OutboxRow, Any]] = field(default_factory=list)

    def abandon(self) -> None:
        """Roll back what is not committed (locks freed, rows left pending) and
        return the connection; safe to call twice."""
        self.heartbeat.untend(self.conn)
        with suppress(SQLAlchemyError):
            if self.transaction.is_active:
                self.transaction.rollback()
        with suppress(SQLAlchemyError):
            self.conn.close()


class RelayBatches:
    """One pass's batches: each claimed in a transaction of its own (:meth:`claim`),
    its first round sent (:meth:`send`), then awaited, marked and committed
    (:meth:`settle`), as cycle.PhaseBatches is for a phase's batches. Which
    thread does which is reaper/relay_pipeline.py's."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        producers: ProducerSlot,
        bus: Bus,
        lock: PassLock,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.producers = producers
        self.bus = bus
        self.lock = lock
        # what the claims and the marks are fenced on: a pass holds the relay lock
        assert lock.holder_pid is not None, "a relay pass's batches need the relay lock"
        self.holder_pid: int = lock.holder_pid
        self.kafka_timeout = settings.kafka_timeout.total_seconds()
        self.floor = ClaimFloor()

    # -- claim; send the first round -----------------------------------------

    def claim(self, size: int, *, may_end: bool = False) -> InFlight | None:
        """Claim up to ``size`` due rows in a new transaction; None when nothing is due.
        ``may_end``: no batch is in flight, so finding nothing ends the pass."""
        conn = self.engine.connect()
        tx, queries = begin(conn, budgets.relay_batch(self.settings))
        flight = InFlight(conn, tx, self.lock.heartbeat)
        try:
            queries.relay_planner()
            flight.rows = self.floor.claim(
                lambda start: queries.claim_outbox_batch(size, self.holder_pid, start),
                may_end=may_end,
            )
            flight.report.claimed = len(flight.rows)
            if not flight.rows:  # nothing due, or the lock is gone (the fence)
                flight.abandon()
                return None
            # from here the transaction waits on Kafka: the heartbeat speaks on it
            self.lock.heartbeat.tend(conn)
            for row in flight.rows:  # id order, so each key's queue is in commit order
                flight.by_key.setdefault(row.message_key, deque()).append(row)
            # hashed here, beside the sends of the batch before, not on the sending thread
            keys = [key.encode() for key in flight.by_key]
            hashed = zip(keys, key_hashes(keys), strict=True)
            flight.keys = dict(zip(flight.by_key, hashed, strict=True))
        except BaseException:
            flight.abandon()
            raise
        return flight

    def send(self, flight: InFlight) -> None:
        """Send a claimed batch's first round: the oldest row of every key."""
        try:
            flight.producer = self.producers.get()
        except SoftTimeLimitExceeded:
            raise
        except Exception as exc:  # no producer: Kafka unreachable or misconfigured
            flight.report.unavailable = exc
        else:
            heads = [queue[0] for queue in flight.by_key.values()]
            flight.sent = self._send(flight, heads)

    def _send(self, flight: InFlight, rows: list[OutboxRow]) -> list[tuple[OutboxRow, Any]]:
        """One round: at most one row per key, all sent before any is awaited. Each
        record's partition is given, the one kafka-python's default partitioner
        would choose (reaper/partitions.py)."""
        assert flight.producer is not None
        producer, report = flight.producer, flight.report
        partitions = Partitions(producer)
        sent: list[tuple[OutboxRow, Any]] = []
        for row in rows:
            key, key_hash = flight.keys[row.message_key]
            try:
                future = producer.send(
                    row.topic,
                    key=key,
                    value=row.value.encode(),
                    headers=headers(row),
                    partition=partitions.of(row.topic, key_hash),
                )
            except SoftTimeLimitExceeded:
                raise
            except UNAVAILABLE as exc:  # metadata wait: no broker, or no such topic
                report.unavailable = exc
                break
            except Exception as exc:  # this record refused (too large, bad topic name)
                self._row_failed(row, exc, report)
                continue
            sent.append((row, future))
        return sent

    # -- await the rounds, mark, commit -------------------------------------

    def settle(self, flight: InFlight) -> BatchReport:
        """Await the batch's rounds, mark each row by its own outcome, commit; then
        tell what was committed."""
        report = flight.report
        try:
            if flight.producer is not None and report.unavailable is None:
                self._rounds(flight)
            if report.unavailable is not None:
                problem = (
                    # no producer: the reason kafka-python kept to itself
                    diagnose(self.settings, report.unavailable)
                    if flight.producer is None
                    else Unavailable("unreachable", describe(report.unavailable))
                )
                error = problem.detail
                attempted = (
                    set(report.published)
                    | set(report.failures)
                    | set(report.refused)
                    | set(report.unreached)
                )
                for row in flight.rows:
                    if row.id not in attempted:
                        report.unreached[row.id] = error
                self._unavailable(problem, flight.rows, flight.producer)
                self.producers.discard(f"Kafka unavailable: {error}")
            elif report.producer_broken:
                self.producers.discard("the producer hit a fatal error")
            # the marks follow back to back: the heartbeat leaves the transaction
            self.lock.heartbeat.untend(flight.conn)
            queries = Queries(flight.conn)
            if not queries.relay_marks_fence(self.holder_pid):
                # the lock is gone: commit nothing, the rows go again with its new holder
                return BatchReport(claimed=report.claimed, fenced=True)
            self._mark(queries, report)
            flight.transaction.commit()
        finally:
            flight.abandon()  # rolls back unless committed; returns the connection
        self.bus.emit(
            RelayBatchCommitted(
                claimed=report.claimed,
                published=len(report.published),
                failed=len(report.failures) + len(report.unreached),
                parked=len(report.refused) + report.out_of_attempts,
                error=next(iter(report.failures.values()), None),
                failures=len(report.failures),
                out_of_attempts=report.out_of_attempts,
                max_attempts=self.settings.relay_max_attempts,
            )
        )
        return report

    def _rounds(self, flight: InFlight) -> None:
        """Acknowledge the sent round; then the next row of every key whose row was
        acknowledged, until the batch is done or one Kafka timeout has passed (the
        rest of those keys waits, in order, for a later batch). A key whose row
        failed or was parked sends nothing more: its later rows wait behind it."""
        assert flight.producer is not None
        report = flight.report
        rounds_until = time.monotonic() + self.kafka_timeout
        sent = flight.sent
        while True:
            acked = self._await(sent, report) if sent else []
            if report.unavailable is not None:
                return
            done = {row.id for row in acked}
            following = []
            for queue in flight.by_key.values():
                if queue and queue[0].id in done:
                    queue.popleft()
                    if queue:
                        following.append(queue[0])
            if not following or time.monotonic() >= rounds_until:
                break
            sent = self._send(flight, following)
        # rows behind a failed or parked row of their key (or not reached) wait
        report.held_back = sum(len(q) - 1 for q in flight.by_key.values() if q)

    def _await(self, sent: list[tuple[OutboxRow, Any]], report: BatchReport) -> list[OutboxRow]:
        """Every acknowledgement of a round, within one delivery timeout."""
        deadline = time.monotonic() + self.kafka_timeout + 1.0
        acked = []
        for row, future in sent:
            try:
                _acknowledgement(future, deadline)
            except SoftTimeLimitExceeded:
                raise
            except Exception as exc:
                self._row_failed(row, exc, report)
                if isinstance(exc, UNAVAILABLE):
                    report.unavailable = exc
            else:
                report.published.append(row.id)
                acked.append(row)
        return acked

    def _row_failed(self, row: OutboxRow, exc: BaseException, report: BatchReport) -> None:
        error = describe(exc)
        if isinstance(exc, UNAVAILABLE):
            report.unreached[row.id] = error
            return  # one fact for the whole batch, see _unavailable
        if refused_for_good(exc):
            report.refused[row.id] = error
        else:
            report.failures[row.id] = error
            report.producer_broken = report.producer_broken or breaks_the_producer(exc)
        # A row-level diagnostic, logged where it is seen (docs/design.md#facts-and-logs).
        log(
            logger,
            "relay.row_parked" if row.id in report.refused else "relay.row_failed",
            level=logging.ERROR if row.id in report.refused else logging.WARNING,
            event_id=row.event_id,
            message_key=row.message_key,
            topic=row.topic,
            attempts=row.attempts + 1,
            error=error,
        )

    def _mark(self, queries: Queries, report: BatchReport) -> None:
        if report.published:
            queries.acknowledge_outbox(report.published)
        if report.refused:
            queries.mark_outbox_parked(report.refused)
        initial_s = self.settings.relay_backoff_initial.total_seconds()
        max_s = self.settings.relay_backoff_max.total_seconds()
        attempts = self.settings.relay_max_attempts
        if report.unreached:  # an outage of Kafka never parks a row
            queries.mark_outbox_failed(
                report.unreached,
                charged=False,
                backoff_initial_s=initial_s,
                backoff_max_s=max_s,
                max_attempts=attempts,
            )
        if report.failures:
            parked = queries.mark_outbox_failed(
                report.failures,
                charged=True,
                backoff_initial_s=initial_s,
                backoff_max_s=max_s,
                max_attempts=attempts,
            )
            report.out_of_attempts = len(parked)

    def _unavailable(
        self, problem: Unavailable, rows: list[OutboxRow], producer: KafkaProducer | None
    ) -> None:
        if producer is not None and producer.bootstrap_connected():
            # The brokers answer but know no partitions of the topic: it does
            # not exist (the relay never creates topics).
            missing = sorted({row.topic for row in rows if not _known(producer, row.topic)})
            for topic in missing:
                self.bus.emit(RelayTopicMissing(topic=topic))
            if missing:
                return
        self.bus.emit(
            RelayKafkaUnavailable(
                bootstrap_servers=self.settings.kafka_bootstrap_servers,
                error=problem.detail,
                rows=len(rows),
                cause=problem.cause,
            )
        )


def headers(row: OutboxRow) -> list[tuple[str, bytes]]:
    """The record's headers (docs/design.md#the-kafka-event); ``traceparent``
    continues the cycle's trace in the consumers."""
    return [
        ("event-id", row.event_id.encode()),
        *_shared_headers(row.event_type, row.correlation_id),
    ]


# A batch's records share their event type and come from a few cycles: their
# headers are built once, not per record (built per record they were a fifth of
# the relay's own Python:
# docs/history/performance-notes.md#the-relays-own-python-per-event-6-december-night).
@lru_cache(maxsize=256)
def _shared_headers(
    event_type: str | None, correlation_id: str | None
) -> tuple[tuple[str, bytes], ...]:
    correlation = correlation_id or ""
    shared = (
        ("event-type", (event_type or "").encode()),
        ("correlation-id", correlation.encode()),
    )
    if correlation:
        return (*shared, ("traceparent", traceparent(correlation).encode()))
    return shared


def _acknowledgement(future: Any, deadline: float) -> None:
    """Wait for one record's acknowledgement until ``deadline``; raise what failed
    it. By the time a batch is settled most are in: those are read without a wait
    (``get`` sets up a timer per call)."""
    if not future.is_done:
        future.get(timeout=max(0.0, deadline - time.monotonic()))
    elif future.exception is not None:
        raise future.exception


def _known(producer: KafkaProducer, topic: str) -> bool:
    """Whether the brokers know the topic (public API: waits up to max_block_ms)."""
    try:
        return bool(producer.partitions_for(topic))
    except kafka_errors.KafkaError:
        return False
