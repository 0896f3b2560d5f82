"""The outbox relay: pending ``integration_outbox`` rows to Kafka (``reaper.relay_outbox``).

One pass claims due rows in batches (``FOR UPDATE SKIP LOCKED``, oldest first),
produces them and, in the same transaction, marks each row published only
after Kafka acknowledged that very record. A row that fails gets one attempt
more, its error and an exponential back-off; later rows of the same message
key wait behind it, so a deal's events never overtake each other, while other
keys go on. Killed between the send and the mark, the transaction rolls back
and the next pass re-sends the same ``eventId`` (at least once; consumers
dedupe by it).

Per batch, records go out in rounds: the first pending row of every key, then
(for the keys whose row was acknowledged) the next one, and so on. Within a
round every key has one record, so one round is sent as a burst and then every
acknowledgement is awaited; the usual batch (one event per deal) is one round.

Batches are pipelined: while one is acknowledged, marked and committed (on a
closer thread), the next is claimed and sent; their keys never overlap. One
pass runs at a time across all workers (``try_relay_lock``).
"""

from __future__ import annotations

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
from kafka.errors import KafkaConnectionError, KafkaTimeoutError
from sqlalchemy import Connection, Engine, RootTransaction, Row
from sqlalchemy.exc import SQLAlchemyError

from reaper import metrics
from reaper.config import Settings
from reaper.db import engine_for
from reaper.kafka import ProducerSlot, process_slot
from reaper.lock import millis
from reaper.logs import get_logger, log
from reaper.queries import Queries

logger = get_logger("relay")

RETENTION_BATCH = 1_000
RETENTION_MAX_BATCHES = 20
# Errors meaning "Kafka is not there", not "this record was refused": the pass
# stops at once instead of waiting out every remaining record.
UNAVAILABLE = (KafkaTimeoutError, KafkaConnectionError)


def describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:500] if text else type(exc).__name__


@dataclass
class RelayResult:
    published: int = 0
    failed: int = 0
    pending: int = 0
    oldest_pending_age_seconds: float = 0.0
    deleted: int = 0
    held_back: int = 0
    kafka_unavailable: bool = False
    skipped: bool = False
    timed_out: bool = False

    def to_json(self) -> dict[str, Any]:
        """The task's result (CONTRACT §2)."""
        return {"published": self.published, "failed": self.failed, "pending": self.pending}


@dataclass
class BatchReport:
    claimed: int = 0
    published: list[int] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)
    held_back: int = 0
    unavailable: BaseException | None = None


@dataclass
class InFlight:
    """A claimed batch whose transaction is still open."""

    conn: Connection
    transaction: RootTransaction
    overlapped: bool = False
    rows: list[Row] = field(default_factory=list)
    report: BatchReport = field(default_factory=BatchReport)
    by_key: OrderedDict[str, deque[Row]] = field(default_factory=OrderedDict)
    producer: KafkaProducer | None = None
    sent: list[tuple[Row, Any]] = field(default_factory=list)

    def abandon(self) -> None:
        """Roll back what is not committed (locks freed, rows left pending) and
        return the connection; safe to call twice."""
        with suppress(SQLAlchemyError):
            if self.transaction.is_active:
                self.transaction.rollback()
        with suppress(SQLAlchemyError):
            self.conn.close()


class Relay:
    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine | None = None,
        producers: ProducerSlot | None = None,
        stop_event: threading.Event | None = None,
        exclusive: bool = True,
    ) -> None:
        self.settings = settings
        self.engine = engine or engine_for(settings.database_url)
        self.producers = producers or process_slot(settings)
        self.stop_event = stop_event or threading.Event()
        # One pass at a time across all relays (see try_relay_lock); a test
        # turns it off to check that concurrent passes stay correct too.
        self.exclusive = exclusive
        self.kafka_timeout = settings.kafka_timeout.total_seconds()

    # -- one pass ----------------------------------------------------------

    def run(self) -> RelayResult:
        """One pass, unless another relay's pass is running (then only the gauges)."""
        if not self.exclusive:
            return self._pass()
        try:
            with self._pass_lock() as acquired:
                if acquired:
                    return self._pass()
        except SQLAlchemyError as exc:
            log(logger, "relay.db_failed", level=40, error=describe(getattr(exc, "orig", exc)))
            return RelayResult()
        log(logger, "relay.skipped", reason="another relay pass is running")
        result = RelayResult(skipped=True)
        self._measure(result)
        return result

    @contextmanager
    def _pass_lock(self) -> Iterator[bool]:
        """The relay lock, on a connection of its own that idles during the pass; the
        server ends that session (freeing the lock) if the pass outlives its bound."""
        conn = self.engine.connect()
        try:
            transaction = conn.begin()
            queries = Queries(conn)
            budget = self.settings.relay_max_pass_duration + 6 * self.settings.kafka_timeout
            queries.bound_transaction(idle_ms=millis(budget) + 10_000, statement_ms=5_000)
            acquired = queries.try_relay_lock()
            try:
                yield acquired
            finally:
                with suppress(SQLAlchemyError):
                    transaction.rollback()
        finally:
            conn.close()

    def _pass(self) -> RelayResult:
        """Batches until one comes back short, Kafka is gone or the pass's time is spent.

        Pipelined: while one batch waits for its acknowledgements, the next one
        is claimed and sent, each in its own transaction. Their keys never
        overlap (a row whose key has an earlier pending row outside its own
        batch is not claimed), so per-key order holds.
        """
        started = time.monotonic()
        deadline = started + self.settings.relay_max_pass_duration.total_seconds()
        result = RelayResult()
        current: InFlight | None = None
        following: InFlight | None = None
        # One batch is acknowledged, marked and committed on this thread while
        # the next one is claimed and sent on the calling thread (psycopg2 and
        # the acknowledgement waits release the GIL, the sends need it).
        closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-close")
        closing: Future[BatchReport] | None = None
        try:
            current = self._open(overlapped=False)
            while current is not None:
                going = not (
                    current.report.unavailable is not None
                    or time.monotonic() >= deadline
                    or self.stop_event.is_set()
                )
                # A claim made while another batch was in flight may come back
                # short only because that batch held its keys: not the end.
                more = going and (
                    current.overlapped or current.report.claimed >= self.settings.relay_batch_size
                )
                closing, current = closer.submit(self._close, current), None
                following = self._open(overlapped=True) if more else None
                report = closing.result()
                closing = None
                result.published += len(report.published)
                result.failed += len(report.failures)
                result.held_back += report.held_back
                if report.unavailable is not None:
                    result.kafka_unavailable = True
                    if following is not None:  # sent already: settle it, then stop
                        settling, following = following, None
                        report = self._close(settling)
                        result.published += len(report.published)
                        result.failed += len(report.failures)
                    break
                current, following = following, None
                if current is None and more:
                    current = self._open(overlapped=False)
        except SoftTimeLimitExceeded:
            # The batches in flight roll back: their rows go again next pass.
            log(logger, "relay.time_limit", level=30, published=result.published)
            result.timed_out = True
        except SQLAlchemyError as exc:
            log(logger, "relay.db_failed", level=40, error=describe(getattr(exc, "orig", exc)))
        finally:
            # A batch being closed finishes on its own (bounded by the Kafka
            # timeout); the ones this thread holds are rolled back.
            for flight in (current, following):
                if flight is not None:
                    flight.abandon()
            closer.shutdown(wait=True)
            if closing is not None and not closing.cancelled():
                if closing.exception() is None:
                    report = closing.result()
                    result.published += len(report.published)
                    result.failed += len(report.failures)
                elif not isinstance(closing.exception(), SQLAlchemyError | SoftTimeLimitExceeded):
                    log(logger, "relay.close_failed", level=40, error=describe(closing.exception()))
        if not result.timed_out:
            result.deleted = self._retention(deadline)
        self._measure(result)
        log(
            logger,
            "relay.completed",
            published=result.published,
            failed=result.failed,
            held_back=result.held_back,
            pending=result.pending,
            oldest_pending_age_seconds=round(result.oldest_pending_age_seconds, 3),
            deleted=result.deleted,
            kafka_unavailable=result.kafka_unavailable,
            duration_ms=round((time.monotonic() - started) * 1000),
        )
        return result

    def _measure(self, result: RelayResult) -> None:
        try:
            with self.engine.connect() as conn:
                result.pending, result.oldest_pending_age_seconds = Queries(
                    conn
                ).outbox_pending_stats()
            metrics.set_outbox(result.pending, result.oldest_pending_age_seconds)
        except SQLAlchemyError as exc:
            log(logger, "relay.db_failed", level=40, error=describe(getattr(exc, "orig", exc)))

    # -- one batch: claim and send (open), acknowledge and mark (close) -----

    def _open(self, *, overlapped: bool) -> InFlight | None:
        """Claim a batch in a new transaction and send its first round; None when
        nothing is due. ``overlapped``: another batch of this pass is in flight."""
        conn = self.engine.connect()
        flight = InFlight(conn, conn.begin(), overlapped=overlapped)
        try:
            queries = Queries(conn)
            # The transaction waits on Kafka (its own acknowledgements and the
            # batch before it): bound it so a hung relay's row locks are freed
            # by the server (its rows are then sent again).
            queries.bound_transaction(
                idle_ms=millis(self.settings.kafka_timeout) * 6 + 5_000,
                statement_ms=15_000,
            )
            queries.relay_planner()
            flight.rows = queries.claim_outbox_batch(self.settings.relay_batch_size)
            flight.report.claimed = len(flight.rows)
            if not flight.rows:
                flight.abandon()
                return None
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

    def _close(self, flight: InFlight) -> BatchReport:
        """Await the acknowledgements (and further rounds), mark, commit."""
        report = flight.report
        try:
            if flight.producer is not None and report.unavailable is None:
                self._rounds(flight)
            if report.unavailable is not None:
                error = describe(report.unavailable)
                attempted = set(report.published) | set(report.failures)
                for row in flight.rows:
                    if row.id not in attempted:
                        report.failures[row.id] = error
                self._log_unavailable(report.unavailable, flight.rows, flight.producer)
                self.producers.discard(f"Kafka unavailable: {error}")
            elif self.producers.broken():
                self.producers.discard("the producer hit a fatal error")
            queries = Queries(flight.conn)
            if report.published:
                queries.mark_outbox_published(report.published)
            if report.failures:
                queries.mark_outbox_failed(
                    report.failures,
                    self.settings.relay_backoff_initial.total_seconds(),
                    self.settings.relay_backoff_max.total_seconds(),
                )
            flight.transaction.commit()
        finally:
            flight.abandon()  # rolls back unless committed; returns the connection
        metrics.relay_published(len(report.published))
        if report.published:
            log(logger, "relay.published", count=len(report.published), claimed=report.claimed)
        if report.failures:
            log(
                logger,
                "relay.batch_failed",
                level=30,
                failed=len(report.failures),
                claimed=report.claimed,
                error=next(iter(report.failures.values())),
            )
        return report

    def _rounds(self, flight: InFlight) -> None:
        """Acknowledge the sent round; then the next row of every acknowledged key,
        until the batch is done or one Kafka timeout has passed (the rest of
        those keys waits, in order, for a later batch)."""
        assert flight.producer is not None
        report = flight.report
        rounds_until = time.monotonic() + self.kafka_timeout
        sent = flight.sent
        while sent:
            acked = self._await(sent, report)
            if report.unavailable is not None:
                return
            following = []
            for row in acked:
                queue = flight.by_key[row.message_key]
                queue.popleft()
                if queue:
                    following.append(queue[0])
            if not following or time.monotonic() >= rounds_until:
                break
            sent = self._send(flight.producer, following, report)
        # rows behind a failed row of their key (or not reached) wait for later
        report.held_back = sum(len(q) - 1 for q in flight.by_key.values() if q)

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
                    headers=[
                        ("event-id", row.event_id.encode()),
                        ("event-type", (row.event_type or "").encode()),
                        ("correlation-id", (row.correlation_id or "").encode()),
                    ],
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
        report.failures[row.id] = describe(exc)
        if isinstance(exc, UNAVAILABLE):
            return  # one line for the whole batch, see _log_unavailable
        log(
            logger,
            "relay.row_failed",
            level=30,
            event_id=row.event_id,
            message_key=row.message_key,
            topic=row.topic,
            attempts=row.attempts + 1,
            error=describe(exc),
        )

    def _log_unavailable(
        self, exc: BaseException, rows: list[Row], producer: KafkaProducer | None
    ) -> None:
        metadata = getattr(producer, "_metadata", None)
        if metadata is not None and metadata.brokers():
            # The brokers answer but know no partitions of the topic: it does
            # not exist (the relay never creates topics).
            missing = sorted(
                {row.topic for row in rows if metadata.partitions_for_topic(row.topic) is None}
            )
            for topic in missing:
                log(
                    logger,
                    "relay.topic_missing",
                    level=40,
                    topic=topic,
                    reason=f"Kafka has no topic {topic!r}; create it (the relay never does)",
                )
            if missing:
                return
        log(
            logger,
            "relay.kafka_unavailable",
            level=40,
            bootstrap_servers=self.settings.kafka_bootstrap_servers,
            error=describe(exc),
            rows=len(rows),
        )

    # -- retention ---------------------------------------------------------

    def _retention(self, deadline: float) -> int:
        """Delete published rows older than the retention, a small batch per transaction."""
        cutoff = datetime.now(UTC) - self.settings.outbox_retention
        deleted = 0
        try:
            for _ in range(RETENTION_MAX_BATCHES):
                with self.engine.begin() as conn:
                    count = Queries(conn).delete_published_outbox(cutoff, RETENTION_BATCH)
                deleted += count
                if count < RETENTION_BATCH or time.monotonic() >= deadline:
                    break
        except SQLAlchemyError as exc:
            log(logger, "relay.db_failed", level=40, error=describe(getattr(exc, "orig", exc)))
        if deleted:
            log(logger, "relay.retention_deleted", count=deleted, cutoff=cutoff)
        return deleted
