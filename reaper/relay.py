"""The outbox relay: pending ``integration_outbox`` rows to Kafka (``reaper.relay_outbox``).

A pass is a pipeline of batches, each in its own transaction, in five steps:

1. **claim** due rows (``FOR UPDATE SKIP LOCKED``, oldest first, at most one
   row per message key ahead of an earlier pending row of that key);
2. **send** the first round: the oldest row of every key, as one burst, each
   record with its partition given (the default partitioner's choice, computed
   for the batch's keys at once: reaper/partitions.py);
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

While one batch is sent, a thread of its own claims the next, and another
settles (awaits, marks, commits) each batch once it is sent, so neither a
claim nor a settle holds up the sends; a claim waits for the settle of the
batch before the one being sent, so at most two batches' transactions are open
at once. The batches in flight never share a key (a claim leaves out a key
with an earlier pending row), so a deal's events never overtake each other.
The first claim is an eighth of a batch and each one after it twice the one
before, up to ``REAPER_RELAY_BATCH_SIZE``: the first sends do not wait for a
whole batch's claim.

Killed between the send and the mark, a batch's transaction rolls back, its
rows are still there, and the next pass re-sends the same ``eventId`` (at
least once; consumers dedupe by it). A row deleted is one whose
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
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from kafka import KafkaProducer
from kafka import errors as kafka_errors
from sqlalchemy import Connection, Engine, RootTransaction
from sqlalchemy.exc import SQLAlchemyError

from reaper import budgets
from reaper.clock import Monotonic, monotonic
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
from reaper.partitions import Partitions, key_hashes
from reaper.queries import OutboxRow, Queries
from reaper.traceids import traceparent

logger = get_logger("relay")

# What a pass holds at once: the relay lock's transaction, the batch being sent
# or settled and the next one, claimed.
PASS_CONNECTIONS = 3
RETENTION_BATCH = 1_000
RETENTION_MAX_BATCHES = 20
# The longest a claimable row waits for a claim that walks from the oldest
# pending row, while a pass goes on: claims in between start after the batch
# claimed before them (ClaimFloor) and pass over what was not claimable when
# the walk went by.
FULL_WALK_EVERY_S = 1.0
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


class ClaimFloor:
    """Where a pass's next claim starts its walk of the pending rows.

    A claim walks the pending rows in id order. Rows deleted since the last
    vacuum are still in the pending index, and while a snapshot older than
    their deletion is held anywhere in the database (a report, a backup) no
    scan can mark them dead: a walk from the oldest pending row visits every
    one of them in the heap again, each claim, and the rows a pass deletes
    pile up in front of its own later claims. So a claim starts right after
    the batch claimed before it. Below that point it would miss what was not
    claimable when the earlier walk went by: a back-off that ran out, a later
    row of a key whose earlier row was in flight, a row whose transaction
    committed after rows with higher ids. Those wait for the next walk from
    the start: the pass's first claim, one at least every ``every_s``, and one
    whenever a claim with no batch in flight finds nothing after the last batch
    (:meth:`claim`), so a pass never ends on a walk that started above a
    claimable row. A claim beside a batch in flight that finds nothing does not
    end the pass, and walks no further. Per-key order does not depend
    on where a walk starts: the claim's probes for an earlier row of a key are
    never floored.
    """

    def __init__(self, every_s: float = FULL_WALK_EVERY_S, clock: Monotonic = monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self.next_id = 0  # after the last batch claimed; 0: from the start
        self.walked_at: float | None = None  # the last walk from the start

    def start(self) -> int:
        """The id the next claim starts from: 0 when a walk from the start is due."""
        now = self.clock()
        if self.walked_at is None or now - self.walked_at >= self.every_s:
            return self.from_start()
        return self.next_id

    def from_start(self) -> int:
        self.walked_at = self.clock()
        return 0

    def claimed(self, rows: list[OutboxRow]) -> None:
        """The next claim starts after these (in id order, as the claim returns them)."""
        if rows:
            self.next_id = rows[-1].id + 1

    def claim(self, run: Callable[[int], list[OutboxRow]], *, may_end: bool) -> list[OutboxRow]:
        """``run`` (a claim from a given id) from where this says; with ``may_end`` (no
        batch in flight, so finding nothing ends the pass) from the start again when
        the walk from the floor found nothing."""
        start = self.start()
        rows = run(start)
        if not rows and start and may_end:
            rows = run(self.from_start())
        self.claimed(rows)
        return rows


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

        def more() -> bool:
            """Whether the pass may claim another batch."""
            return not (time.monotonic() >= deadline or self.stop_event.is_set() or lock.lost)

        def claim_after(settle: Future[BatchReport] | None, size: int) -> InFlight | None:
            """The next batch, claimed once ``settle`` (of the batch sent before the
            one being sent) is done: two batches' transactions at most; none when
            the pass is to end."""
            if settle is not None and (settle.exception() is not None or _ends(settle.result())):
                return None
            return batches.claim(size) if more() else None

        # Three threads: this one sends each batch's first round; the settler
        # awaits, marks and commits each batch once it is sent; the claimer claims
        # the next batch meanwhile. The sends need the GIL; psycopg2 and the
        # acknowledgement waits release it. No claim waits for this thread: with
        # room for one batch's transaction only (a small pool behind PgBouncer),
        # the next claim waits for the commit of the batch before, no longer.
        settler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-settle")
        claimer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-claim")
        sending: InFlight | None = None  # claimed; this thread sends it
        claiming: Future[InFlight | None] | None = None
        settles: deque[Future[BatchReport]] = deque()  # sent, not yet counted
        size = first_claim(self.settings.relay_batch_size)
        try:
            sending = batches.claim(size)
            while sending is not None:
                size = min(2 * size, self.settings.relay_batch_size)
                claiming = claimer.submit(claim_after, settles[-1] if settles else None, size)
                batches.send(sending)
                ended = sending.report.unavailable is not None
                # the settler's from here: a time limit while this thread waits
                # for the claim must not roll back what it is committing
                sent, sending = sending, None
                settles.append(settler.submit(batches.settle, sent))
                sending, claiming = claiming.result(), None
                while len(settles) > 1:  # done: the claim waited for them
                    report = _settled(settles)
                    report.add_to(result)
                    ended = ended or _ends(report)
                if ended:
                    break
                if sending is None:
                    # A short batch is not the end (while a drain writes events the
                    # pass follows it a batch behind), nor is a claim beside a batch
                    # in flight that found nothing: it left out the keys behind that
                    # batch. Only a claim with nothing in flight ends the pass.
                    report = _settled(settles)
                    report.add_to(result)
                    if not _ends(report) and more():
                        sending = batches.claim(size, may_end=True)
            while settles:
                _settled(settles).add_to(result)
        except SoftTimeLimitExceeded:
            # The batch being sent and the one claimed roll back (their rows go
            # again next pass); a batch being settled is committed (finally).
            result.timed_out = True
        except SQLAlchemyError as exc:
            self._database_failed(result, exc)
        finally:
            # A claim not started is cancelled, and every batch not sent is rolled
            # back; a batch being settled finishes on its own (bounded by the Kafka
            # timeout) and is counted.
            if sending is not None:
                sending.abandon()
            claimer.shutdown(wait=True, cancel_futures=True)
            claimed = _claimed(claiming)
            if claimed is not None:
                claimed.abandon()
            settler.shutdown(wait=True)
            for settle in settles:
                failure = settle.exception()
                if failure is None:
                    settle.result().add_to(result)
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
    """One pass's batches: each claimed in a transaction of its own (:meth:`claim`,
    on the claimer thread but for the first), its first round sent by the calling
    thread (:meth:`send`), then awaited, marked and committed on the settler
    (:meth:`settle`), as cycle.PhaseBatches is for a phase's batches."""

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
                lambda start: queries.claim_outbox_batch(size, self.lock.holder_pid, start),
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


def first_claim(batch_size: int) -> int:
    """A pass's first claim: an eighth of a batch. Nothing is sent until it returns
    and a claim takes time in proportion to its rows, so the pass starts small;
    each claim after it is twice the one before, up to the batch size, as a claim
    of 2n rows takes about as long as sending n (docs/performance.md#the-claims-ramp)."""
    return max(1, batch_size // 8)


def _settled(settles: deque[Future[BatchReport]]) -> BatchReport:
    """The oldest settle's report, once it is done; a settle that failed stays in
    ``settles`` for the pass's end to report (RelayCloseFailed)."""
    report = settles[0].result()
    settles.popleft()
    return report


def _claimed(claiming: Future[InFlight | None] | None) -> InFlight | None:
    """What a claim left behind once the claimer has stopped."""
    if claiming is None or claiming.cancelled() or claiming.exception() is not None:
        return None
    return claiming.result()


def _ends(report: BatchReport) -> bool:
    """After this settled batch no other is claimed: Kafka is gone, or the relay
    lock is (its marks were fenced)."""
    return report.unavailable is not None or report.fenced


def headers(row: OutboxRow) -> list[tuple[str, bytes]]:
    """The record's headers (docs/design.md#the-kafka-event); ``traceparent``
    continues the cycle's trace in the consumers."""
    return [
        ("event-id", row.event_id.encode()),
        *_shared_headers(row.event_type, row.correlation_id),
    ]


# A batch's records share their event type and come from a few cycles: their
# headers are built once, not per record (built per record they were a fifth of
# the relay's own Python: docs/performance.md, "The relay's own Python per event").
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
