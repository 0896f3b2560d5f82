"""The outbox relay: pending ``integration_outbox`` rows to Kafka (``reaper.relay_outbox``).

A pass (:class:`Relay`) is the policy: one pass at a time across all workers,
its batches in a pipeline until a claim finds nothing (a short batch is not the
end: during an incident the pass follows the drain a batch behind), the pass's
time is spent, a stop is asked or Kafka is gone; then retention deletes old
published rows (the rows a relay of release 0.3.0, running beside this one
during a deploy, still marks ``published_at`` instead of deleting) and the
outbox's gauges are read. Its parts, each in a module of its own:

- reaper/relay_pipeline.py, the machinery: the batches claimed, sent and
  settled on three threads;
- reaper/relay_batches.py, a batch's own work: claim, send, await, mark,
  commit, and what each Kafka error means for a row;
- reaper/relay_floor.py, where each claim starts its walk of the outbox.

One pass runs at a time: it holds the relay lock as a phase holds the run lock
(reaper/lease.py), on a lock session its heartbeat keeps alive, which the server
ends after one REAPER_RUN_LEASE of silence. The heartbeat also speaks on the
batches' transactions while they wait on Kafka, so a frozen or cut-off relay
frees its lock and its claimed rows a lease after it stopped. Its claims and
its marks are fenced on the lock session (reaper/relay_batches.py). See
docs/design.md#the-outbox-relay.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from reaper import budgets, relay_pipeline
from reaper.config import Settings
from reaper.db import engine_of, transaction
from reaper.errors import describe
from reaper.events import (
    Bus,
    PassLockLost,
    RelayDbFailed,
    RelayPassCompleted,
    RelayResult,
    RelayRetentionDeleted,
    process_bus,
)
from reaper.kafka import ProducerSlot, process_slot
from reaper.lease import PassLock, pass_lock
from reaper.queries import Queries
from reaper.relay_batches import RelayBatches

# What a pass holds at once: the relay lock's transaction, the batch being sent
# or settled and the next one, claimed.
PASS_CONNECTIONS = 3
RETENTION_BATCH = 1_000
RETENTION_MAX_BATCHES = 20


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
    ) -> None:
        self.settings = settings
        self.engine = engine or engine_of(settings)
        self.producers = producers or process_slot(settings)
        self.bus = bus or process_bus
        # Asked to stop (a warm shutdown): no new batch after those in flight.
        self.stop_event = stop_event or threading.Event()

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

    def _pass_lock(self) -> AbstractContextManager[PassLock | None]:
        """The relay lock for one pass (lease.pass_lock), or None when another pass
        holds it."""
        return pass_lock(
            self.engine,
            self.settings,
            take=Queries.try_relay_lock,
            wait_for_marks=Queries.wait_relay_marks,
            give_up_s=budgets.relay_pass_give_up(self.settings).total_seconds(),
        )

    def _pass(self, result: RelayResult, lock: PassLock) -> None:
        """Batches until a claim finds nothing, Kafka is gone, the lock is lost, a
        stop is asked or the pass's time is spent; then retention."""
        deadline = time.monotonic() + self.settings.relay_max_pass_duration.total_seconds()
        batches = RelayBatches(self.settings, self.engine, self.producers, self.bus, lock)

        def more() -> bool:
            """Whether the pass may claim another batch."""
            return not (time.monotonic() >= deadline or self.stop_event.is_set() or lock.lost)

        try:
            relay_pipeline.run(
                batches,
                result,
                batch_size=self.settings.relay_batch_size,
                more=more,
                bus=self.bus,
            )
        except SQLAlchemyError as exc:
            self._database_failed(result, exc)
        if not (result.timed_out or result.lock_lost or lock.lost):
            result.deleted = self._retention(deadline, batches.holder_pid)

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

    def _retention(self, deadline: float, holder_pid: int) -> int:
        """Delete published rows older than the retention, a small batch per
        transaction, each fenced as the marks are (nothing once the lock is gone)."""
        # the database compares by its own clock; the fact's cutoff is this process's view
        cutoff = datetime.now(UTC) - self.settings.outbox_retention
        deleted = 0
        try:
            for _ in range(RETENTION_MAX_BATCHES):
                with transaction(self.engine, budgets.quick(self.settings)) as queries:
                    if not queries.relay_marks_fence(holder_pid):
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
