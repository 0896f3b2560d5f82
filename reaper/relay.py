"""The outbox relay: pending ``integration_outbox`` rows to Kafka (``reaper.relay_outbox``).

A pass is a pipeline of batches, each in its own transaction, in five steps:

1. **claim** due rows (``FOR UPDATE SKIP LOCKED``, oldest first, at most one
   row per message key ahead of an earlier pending row of that key);
2. **send** the first round: the oldest row of every key, as one burst;
3. **await** every acknowledgement of the round (``future.get`` per record),
   then send the next round (the next row of each acknowledged key);
4. **mark**: delete each row at its own acknowledgement
   (``messenger.acknowledge_outbox``: a sent row leaves the outbox, no new row
   version), back off each row that failed, park each row Kafka refused for
   good; commit;
5. after the last batch, **retention** deletes old published rows (the rows a
   relay of release 0.3.0, running beside this one during a deploy, still
   marks ``published_at`` instead of deleting).

Batches follow each other until a claim finds nothing (a short batch is not
the end: during an incident the pass follows the drain a batch behind), the
pass's time is spent, a stop is asked or Kafka is gone.

While one batch is awaited and marked (on a closer thread), the next is
claimed and sent; their keys never overlap, so a deal's events never overtake
each other. Killed between the send and the mark, a batch's transaction rolls
back, its rows are still there, and the next pass re-sends the same
``eventId`` (at least once; consumers dedupe by it). A row deleted is one whose
own acknowledgement arrived, in a transaction that commits only behind the
fence: so a deal's next event is claimed only once its earlier one is gone,
which it is only once Kafka has it. See docs/design.md#the-outbox-relay.

One pass runs at a time across all workers: it holds the relay lock as a phase
holds the run lock (reaper/lease.py), on a lock session its heartbeat keeps
alive, which the server ends after one REAPER_RUN_LEASE of silence. The
heartbeat also speaks on the batches' transactions while they wait on Kafka,
so a frozen or cut-off relay frees its lock and its claimed rows a lease after
it stopped. Its claims and its marks are fenced on the lock session: a relay
that lost the lock claims nothing more, and a batch it settles afterwards
commits nothing (its rows are sent again by the pass that took over).

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
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from kafka import KafkaProducer
from kafka import errors as kafka_errors
from sqlalchemy import Connection, Engine, RootTransaction, Row
from sqlalchemy.exc import SQLAlchemyError

from reaper import budgets
from reaper.config import Settings
from reaper.db import begin, engine_of, transaction
from reaper.errors import describe
from reaper.events import (
    Bus,
    PassLockLost,
    RelayBatchCommitted,
    RelayCloseFailed,
    RelayDbFailed,
    RelayKafkaUnavailable,
    RelayPassCompleted,
    RelayResult,
    RelayRetentionDeleted,
    RelayTopicMissing,
    process_bus,
)
from reaper.kafka import ProducerSlot, Unavailable, diagnose, process_slot
from reaper.lease import Heartbeat, PassLock, pass_lock
from reaper.logs import get_logger, log
from reaper.queries import Queries
from reaper.traceids import traceparent

logger = get_logger("relay")

RETENTION_BATCH = 1_000
RETENTION_MAX_BATCHES = 20
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
    rows: list[Row] = field(default_factory=list)
    report: BatchReport = field(default_factory=BatchReport)
    by_key: OrderedDict[str, deque[Row]] = field(default_factory=OrderedDict)
    producer: KafkaProducer | None = None
    sent: list[tuple[Row, Any]] = field(default_factory=list)

    def abandon(self) -> None:
        """Roll back what is not committed (locks freed, rows left pending) and
        return the connection; safe to call twice."""
        self.heartbeat.untend(self.conn)
        with suppress(SQLAlchemyError):
            if self.transaction.is_active:
                self.transaction.rollback()
        with suppress(SQLAlchemyError):
            self.conn.close()


class Relay:
    """The pass's policy: one pass at a time (the lock), batches in a pipeline until
    there is nothing due, Kafka is gone, a stop is asked or the pass's time is
    spent; then retention and the outbox's gauges. The batches' own work is
    :class:`RelayBatches`."""

    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine | None = None,
        producers: ProducerSlot | None = None,
        bus: Bus | None = None,
        stop_event: Any = None,
        exclusive: bool = True,
    ) -> None:
        self.settings = settings
        self.engine = engine or engine_of(settings)
        self.producers = producers or process_slot(settings)
        self.bus = bus or process_bus
        # Asked to stop (a warm shutdown): no new batch after those in flight.
        self.stop_event = stop_event or threading.Event()
        # One pass at a time across all relays (see try_relay_lock); a test
        # turns it off to check that concurrent passes stay correct too.
        self.exclusive = exclusive

    def run(self) -> RelayResult:
        """One pass, unless another relay's pass is running (then only the gauges)."""
        started = time.monotonic()
        result = RelayResult()
        lock: PassLock | None = None
        try:
            with self._pass_lock() as lock:
                if lock is not None:
                    self._pass(result, lock)
                else:
                    result.skipped = True
        except SQLAlchemyError as exc:
            self._database_failed(result, exc)
        if lock is not None and (lock.error is not None or result.lock_lost):
            result.lock_lost = True
            error = lock.error or "a batch found the relay lock gone at its marks"
            self.bus.emit(PassLockLost(lock="relay", error=error))
        self._measure(result)
        duration_ms = round((time.monotonic() - started) * 1000)
        self.bus.emit(RelayPassCompleted(result=result, duration_ms=duration_ms))
        return result

    @contextmanager
    def _pass_lock(self) -> Iterator[PassLock | None]:
        """The relay lock for one pass (lease.pass_lock), or None when another pass
        holds it. A pass without the lock (``exclusive`` off) still has a heartbeat
        for its batches' transactions."""
        give_up_s = budgets.relay_pass_give_up(self.settings).total_seconds()
        if self.exclusive:
            with pass_lock(
                self.engine,
                self.settings,
                take=Queries.try_relay_lock,
                wait_for_marks=Queries.wait_relay_marks,
                give_up_s=give_up_s,
            ) as lock:
                yield lock
            return
        heartbeat = Heartbeat.per_lease(None, self.settings, give_up_s)
        heartbeat.start()
        try:
            yield PassLock(None, heartbeat)
        finally:
            heartbeat.stop()

    def _pass(self, result: RelayResult, lock: PassLock) -> None:
        """Batches until a claim finds nothing, Kafka is gone, the lock is lost, a
        stop is asked or the pass's time is spent; then retention."""
        deadline = time.monotonic() + self.settings.relay_max_pass_duration.total_seconds()
        batches = RelayBatches(self.settings, self.engine, self.producers, self.bus, lock)
        current: InFlight | None = None
        following: InFlight | None = None
        # One batch is awaited, marked and committed on this thread while the
        # next one is claimed and sent on the calling thread (psycopg2 and the
        # acknowledgement waits release the GIL, the sends need it).
        closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-close")
        closing: Future[BatchReport] | None = None
        try:
            current = batches.claim_and_send()
            while current is not None:
                # A short batch is not the end: while a drain writes events, the
                # pass follows it a batch behind instead of waiting for the next
                # tick. Only a claim that finds nothing ends it.
                more = not (
                    current.report.unavailable is not None
                    or time.monotonic() >= deadline
                    or self.stop_event.is_set()
                    or lock.lost
                )
                closing, current = closer.submit(batches.settle, current), None
                following = batches.claim_and_send() if more else None
                report = closing.result()
                closing = None
                report.add_to(result)
                if report.unavailable is not None or report.fenced:
                    if following is not None:  # sent already: settle it, then stop
                        settling, following = following, None
                        batches.settle(settling).add_to(result)
                    break
                current, following = following, None
                if current is None and more:
                    current = batches.claim_and_send()
        except SoftTimeLimitExceeded:
            # The batches in flight roll back: their rows go again next pass.
            result.timed_out = True
        except SQLAlchemyError as exc:
            self._database_failed(result, exc)
        finally:
            # A batch being closed finishes on its own (bounded by the Kafka
            # timeout); the ones this thread holds are rolled back.
            for flight in (current, following):
                if flight is not None:
                    flight.abandon()
            closer.shutdown(wait=True)
            if closing is not None and not closing.cancelled():
                failure = closing.exception()
                if failure is None:
                    closing.result().add_to(result)
                elif not isinstance(failure, SQLAlchemyError | SoftTimeLimitExceeded):
                    self.bus.emit(RelayCloseFailed(error=describe(failure)))
        if not (result.timed_out or result.lock_lost or lock.lost):
            result.deleted = self._retention(deadline, lock.holder_pid)

    def _database_failed(self, result: RelayResult, exc: SQLAlchemyError) -> None:
        result.database_failed = True
        self.bus.emit(RelayDbFailed(error=describe(exc)))

    def _measure(self, result: RelayResult) -> None:
        try:
            with transaction(self.engine, budgets.quick(self.settings)) as queries:
                stats = queries.outbox_pending_stats()
                vacuum = queries.outbox_vacuum_stats()
            result.pending, result.oldest_pending_age_seconds, result.outbox_parked = stats
            result.outbox_dead_rows, result.oldest_snapshot_age_seconds = vacuum
        except SQLAlchemyError as exc:
            self._database_failed(result, exc)

    def _retention(self, deadline: float, holder_pid: int | None) -> int:
        """Delete published rows older than the retention, a small batch per
        transaction, each fenced as the marks are (nothing once the lock is gone)."""
        # the database compares by its own clock; the fact's cutoff is this process's view
        cutoff = datetime.now(UTC) - self.settings.outbox_retention
        deleted = 0
        try:
            for _ in range(RETENTION_MAX_BATCHES):
                with transaction(self.engine, budgets.quick(self.settings)) as queries:
                    if holder_pid is not None and not queries.relay_marks_fence(holder_pid):
                        break
                    count = queries.delete_published_outbox(
                        self.settings.outbox_retention, RETENTION_BATCH
                    )
                deleted += count
                if count < RETENTION_BATCH or time.monotonic() >= deadline:
                    break
        except SQLAlchemyError as exc:
            self.bus.emit(RelayDbFailed(error=describe(exc)))
        if deleted:
            self.bus.emit(RelayRetentionDeleted(count=deleted, cutoff=cutoff))
        return deleted


class RelayBatches:
    """One pass's batches: what the calling thread claims and sends
    (:meth:`claim_and_send`, a transaction of its own per batch) and what the closer
    thread awaits, marks and commits (:meth:`settle`), as cycle.PhaseBatches is
    for a phase's batches."""

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
        self.kafka_timeout = settings.kafka_timeout.total_seconds()

    # -- claim, send the first round ----------------------------------------

    def claim_and_send(self) -> InFlight | None:
        """Claim a batch in a new transaction and send its first round; None when
        nothing is due."""
        conn = self.engine.connect()
        tx, queries = begin(conn, budgets.relay_batch(self.settings))
        flight = InFlight(conn, tx, self.lock.heartbeat)
        try:
            queries.relay_planner()
            flight.rows = queries.claim_outbox_batch(
                self.settings.relay_batch_size, self.lock.holder_pid
            )
            flight.report.claimed = len(flight.rows)
            if not flight.rows:  # nothing due, or the lock is gone (the fence)
                flight.abandon()
                return None
            # from here the transaction waits on Kafka: the heartbeat speaks on it
            self.lock.heartbeat.tend(conn)
            for row in flight.rows:  # id order, so each key's queue is in commit order
                flight.by_key.setdefault(row.message_key, deque()).append(row)
            try:
                flight.producer = self.producers.get()
            except SoftTimeLimitExceeded:
                raise
            except Exception as exc:  # no producer: Kafka unreachable or misconfigured
                flight.report.unavailable = exc
            else:
                heads = [queue[0] for queue in flight.by_key.values()]
                flight.sent = self._send(flight.producer, heads, flight.report)
        except BaseException:
            flight.abandon()
            raise
        return flight

    def _send(
        self, producer: KafkaProducer, rows: list[Row], report: BatchReport
    ) -> list[tuple[Row, Any]]:
        """One round: at most one row per key, all sent before any is awaited."""
        sent: list[tuple[Row, Any]] = []
        for row in rows:
            try:
                future = producer.send(
                    row.topic,
                    key=row.message_key.encode(),
                    value=row.value.encode(),
                    headers=headers(row),
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
            holder = self.lock.holder_pid
            if holder is not None and not queries.relay_marks_fence(holder):
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
            sent = self._send(flight.producer, following, report)
        # rows behind a failed or parked row of their key (or not reached) wait
        report.held_back = sum(len(q) - 1 for q in flight.by_key.values() if q)

    def _await(self, sent: list[tuple[Row, Any]], report: BatchReport) -> list[Row]:
        """Every acknowledgement of a round, within one delivery timeout."""
        deadline = time.monotonic() + self.kafka_timeout + 1.0
        acked = []
        for row, future in sent:
            try:
                future.get(timeout=max(0.0, deadline - time.monotonic()))
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

    def _row_failed(self, row: Row, exc: BaseException, report: BatchReport) -> None:
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
        self, problem: Unavailable, rows: list[Row], producer: KafkaProducer | None
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


def headers(row: Row) -> list[tuple[str, bytes]]:
    """The record's headers (docs/design.md#the-kafka-event); ``traceparent``
    continues the cycle's trace in the consumers."""
    correlation = row.correlation_id or ""
    out = [
        ("event-id", row.event_id.encode()),
        ("event-type", (row.event_type or "").encode()),
        ("correlation-id", correlation.encode()),
    ]
    if correlation:
        out.append(("traceparent", traceparent(correlation).encode()))
    return out


def _known(producer: KafkaProducer, topic: str) -> bool:
    """Whether the brokers know the topic (public API: waits up to max_block_ms)."""
    try:
        return bool(producer.partitions_for(topic))
    except kafka_errors.KafkaError:
        return False
