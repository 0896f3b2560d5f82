"""The run: one cycle at a time, from its first phase to its end.

Two things keep cycles apart (docs/design.md#one-cycle-at-a-time):

- the single-runner advisory lock (``pg_try_advisory_xact_lock``, the key of
  docs/design.md#the-single-runner-lock) is the mutual exclusion of the work:
  a phase holds it, in a transaction on a connection of its own, while its
  batches run on others. It ends with that transaction, so it never travels
  back into the pool. The phase proves it is alive on that connection several
  times per ``REAPER_RUN_LEASE`` (lease.Heartbeat); the server ends a lock
  session that stays silent for a whole lease (``idle_in_transaction_session_
  timeout``) and one whose client stopped acknowledging (``tcp_user_timeout``,
  keepalives). A killed owner's lock is freed at once, a frozen or partitioned
  one's within a lease, a hung one's (alive, never ending) one lease after
  ``REAPER_LOCK_TTL``, when its heartbeat gives up.
- the run row (``messenger.reaper_runs``) says which cycle owns the run
  between its phases, which are separate Celery tasks, often in other
  processes. A cycle takes the run at its head; each of its phases checks that
  the run is still its own, and renews the lease when it ends; the end closes
  it. A cycle that finds the run owned by a live lease is skipped whole; one
  that finds the lock free and the lease expired (the owner died, froze, or
  lost its chain with the broker's queues) closes that run as ``taken_over``
  and takes it.

Every batch statement is fenced by both (the ``fence`` of the phase
statements): it changes nothing unless its run is still open and its phase's
lock session still holds the lock, and it holds the run row while it commits,
so a cycle that takes the run over waits for a batch in flight and no batch of
the old owner commits after it.

The run row is changed only under the lock, or by its own cycle (its end, or
an error counted when a phase could not take the lock).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Connection, Engine, RootTransaction
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError

from reaper import budgets
from reaper.clock import rfc3339, utcnow
from reaper.config import Settings
from reaper.db import begin, transaction
from reaper.errors import describe
from reaper.events import CountKey, Counts, CycleResult
from reaper.lease import Heartbeat
from reaper.phases import PHASES
from reaper.queries import Queries

# An as_of given by hand may be at most this much later than the database's clock.
AS_OF_TOLERANCE = timedelta(seconds=5)
# Finished runs are kept this long (reaper status), then deleted at a run's end.
KEEP_FINISHED = timedelta(days=1)

# The keys of events.Counts, in the result's order: each phase's, then these two.
COUNT_KEYS: tuple[CountKey, ...] = (
    *(phase.count_key for phase in PHASES.values()),
    "skipped_locked_count",
    "failed_count",
)


def counts(values: Mapping[str, int]) -> Counts:
    """The counts of a result from a run's (a key it lacks counts 0). COUNT_KEYS are
    Counts' keys (tests/test_phases_model.py), which is what makes the cast true."""
    return cast(Counts, {key: int(values.get(key, 0)) for key in COUNT_KEYS})


def cycle_result(
    run_id: str,
    as_of: datetime,
    *,
    skipped: bool,
    counted: Counts,
    duration_ms: int,
    paused: list[str],
) -> CycleResult:
    """A cycle's result (docs/design.md#tasks): built here alone."""
    return {
        "run_id": run_id,
        "as_of": rfc3339(as_of),
        "skipped": skipped,
        **counted,
        "duration_ms": duration_ms,
        "paused": paused,
    }


class RunLockBusy(RuntimeError):
    """The lock is held by a session that is not this cycle's (an operator, a stray runner)."""


class AsOfRefused(ValueError):
    """A hand-given as_of is in the database's future: it could close rooms in use."""


def holder(engine: Engine) -> int | None:
    """The backend pid holding the single-runner lock, or None when it is free:
    read from ``pg_locks``, without taking it."""
    with engine.connect() as conn:
        return Queries(conn).run_lock_holder()


def owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Start:
    """What a cycle's head found: the run taken, or why not."""

    run_id: str
    as_of: datetime
    started_at: datetime  # the database's clock
    clock_skew_seconds: float  # the worker's clock minus the database's
    skipped: str | None = None  # why another cycle owns the run
    holder_pid: int | None = None
    owner_run_id: str | None = None
    taken_over: str | None = None  # the run this cycle took over
    taken_over_lease: datetime | None = None


@dataclass
class Run:
    """A cycle's state as one of its phases holds it (under the run lock)."""

    run_id: str
    holder_pid: int  # the backend of the phase's lock session (the batches' fence)
    as_of: datetime
    deadline: datetime
    now: datetime  # the database's clock when the phase took the lock
    counts: dict[str, int]
    excluded: list[str]
    blocked: list[str]
    paused: list[str]
    errors: int
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_row(cls, row: Any) -> Run:
        return cls(
            run_id=row.run_id,
            holder_pid=row.holder_pid,
            as_of=row.as_of,
            deadline=row.deadline,
            now=row.now,
            counts={key: int(row.counts.get(key, 0)) for key in COUNT_KEYS},
            excluded=[str(x) for x in row.excluded],
            blocked=list(row.blocked),
            paused=list(row.paused),
            errors=row.errors,
        )

    @property
    def remaining(self) -> timedelta:
        """What is left of the cycle's REAPER_MAX_RUN_DURATION (never negative)."""
        return max(timedelta(0), self.deadline - self.now)

    def excluded_now(self) -> list[str]:
        with self._lock:
            return list(self.excluded)

    def exclude(self, conference_ids: list[str]) -> list[str]:
        """Leave these out for the rest of the cycle; returns those not already left out
        (two lanes may both have claimed one between a claim and this call)."""
        with self._lock:
            fresh = [c for c in conference_ids if c not in self.excluded]
            self.excluded.extend(fresh)
            return fresh


@dataclass(frozen=True)
class Finished:
    run_id: str
    as_of: datetime
    started_at: datetime
    finished_at: datetime | None
    counts: dict[str, int]
    blocked: list[str]
    paused: list[str]
    errors: int
    duration_ms: int
    lost: bool  # taken over by another cycle before this end

    def result(self) -> CycleResult:
        """The task's result (docs/design.md#tasks)."""
        return cycle_result(
            self.run_id,
            self.as_of,
            skipped=False,
            counted=counts(self.counts),
            duration_ms=self.duration_ms,
            paused=list(self.paused),
        )


def unowned_result(run_id: str, as_of: datetime, *, skipped: bool) -> CycleResult:
    """The result of a cycle that changed nothing: skipped, or failed at its head."""
    return cycle_result(
        run_id, as_of, skipped=skipped, counted=counts({}), duration_ms=0, paused=[]
    )


LOCK_SESSION_ENDED = "the lock session was ended (by the server or the network) during the phase"


class RunLost(RuntimeError):
    """A batch found its run fenced off: the phase's lock session is gone (the server
    ended it, or the network did), or another cycle took the run over."""


class PhaseClaim:
    """The run lock held for one phase, on its own connection, with the run's state.

    :meth:`release` saves what the phase added to the run and commits, which
    ends the lock and renews the run's lease; it returns the error when the
    session had already ended (the server ended it, or the network did). What
    the phase committed is then saved apart, so the run's counts still say it.
    """

    def __init__(
        self,
        conn: Connection,
        tx: RootTransaction,
        run: Run,
        settings: Settings,
        engine: Engine,
        paused: str | None,
    ) -> None:
        self.conn = conn
        self.transaction = tx
        self.run = run
        self.settings = settings
        self.engine = engine
        # why an operator paused this phase (read under the lock), or None
        self.paused = paused
        self.heartbeat = Heartbeat.per_lease(conn, settings, settings.lock_ttl.total_seconds())
        self.heartbeat.start()

    def release(self) -> str | None:
        self.heartbeat.stop()
        run = self.run
        counts = json.dumps(run.counts)
        try:
            if self.heartbeat.lost.is_set():
                # A beat found the session ended (a frozen holder woken after its
                # lease): its failed statement left the connection unusable, and
                # a save on it would raise instead of telling the lost lock.
                lost = LOCK_SESSION_ENDED
            else:
                Queries(self.conn).save_run(
                    run.run_id,
                    counts=counts,
                    excluded=run.excluded,
                    blocked=run.blocked,
                    paused=run.paused,
                    errors=run.errors,
                    lease_s=self.settings.run_lease.total_seconds(),
                )
                self.transaction.commit()
                return None
        except DBAPIError as exc:
            lost = describe(exc)
        finally:
            self.conn.close()
        try:  # the lock is gone with its session; what the batches committed stays
            with transaction(self.engine, budgets.quick(self.settings)) as queries:
                queries.save_run_totals(
                    run.run_id,
                    counts=counts,
                    excluded=run.excluded,
                    blocked=run.blocked,
                    paused=run.paused,
                    errors=run.errors,
                )
        except SQLAlchemyError:
            pass  # the database itself is the failure: the lost lock is told
        return lost


class Runs:
    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.lease_s = settings.run_lease.total_seconds()

    def take(self, run_id: str, as_of: datetime | None) -> Start:
        """The head of a cycle: take the run, or find why another cycle has it.

        Raises AsOfRefused before anything else when ``as_of`` is later than the
        database's clock plus AS_OF_TOLERANCE.
        """
        with transaction(self.engine, budgets.quick(self.settings)) as queries:
            before = utcnow()
            now = queries.database_clock()
            after = utcnow()
            skew = ((before - now) + (after - now)).total_seconds() / 2
            if as_of is not None and as_of > now + AS_OF_TOLERANCE:
                raise AsOfRefused(
                    f"as_of {rfc3339(as_of)} is later than the database's clock "
                    f"{rfc3339(now)} plus {AS_OF_TOLERANCE.total_seconds():g} s"
                )
            start = Start(run_id, as_of or now, now, skew)
            if not queries.try_run_lock():
                pid = queries.run_lock_holder()
                return replace(
                    start,
                    skipped="the single-runner lock is held by another session",
                    holder_pid=pid if pid is not None else -1,
                )
            current = queries.open_run()
            if current is not None and current.live:
                return replace(
                    start,
                    skipped=f"cycle {current.run_id} owns the run",
                    owner_run_id=current.run_id,
                )
            if current is not None:
                queries.close_run(current.run_id, "taken_over")
                start = replace(
                    start, taken_over=current.run_id, taken_over_lease=current.lease_expires_at
                )
            if not queries.insert_run(
                run_id=run_id,
                as_of=start.as_of,
                started_at=now,
                max_run_s=self.settings.max_run_duration.total_seconds(),
                lease_s=self.lease_s,
                owner=owner(),
            ):
                raise ValueError(f"run_id {run_id} was used by an earlier cycle")
            return start

    def count_error(self, run_id: str) -> None:
        """A phase of the run failed before it could hold the run (best effort: the
        database may be the failure)."""
        try:
            with transaction(self.engine, budgets.quick(self.settings)) as queries:
                queries.count_run_error(run_id)
        except SQLAlchemyError:
            pass

    def record_unknown(self, run_id: str, phase: str) -> None:
        """The run's chain named ``phase``, which this release does not know."""
        with transaction(self.engine, budgets.quick(self.settings)) as queries:
            queries.record_unknown_phase(run_id, phase)

    def claim(self, run_id: str, phase: str) -> PhaseClaim | None:
        """The run lock and the run's state for one of its phases; None when the
        run is no longer this cycle's (taken over, or ended)."""
        conn = self.engine.connect()
        try:
            tx, queries = begin(conn, budgets.run_lock(self.settings))
            try:
                queries.wait_run_lock()
            except OperationalError as exc:  # lock_timeout or statement_timeout
                raise RunLockBusy(
                    "the single-runner lock is held by another session "
                    f"(backend pid {self._holder()}): {describe(exc)}"
                ) from exc
            row = queries.run_for_phase(run_id, phase)
            if row is None:
                tx.rollback()
                conn.close()
                return None
            paused = queries.phase_pause(phase)
            return PhaseClaim(conn, tx, Run.from_row(row), self.settings, self.engine, paused)
        except BaseException:
            conn.close()
            raise

    def _holder(self) -> int | None:
        """The backend pid holding the lock, or None (best effort: this names the
        holder in an error that is being raised already)."""
        try:
            return holder(self.engine)
        except SQLAlchemyError:
            return None

    def finish(self, run_id: str) -> Finished | None:
        """Close the run (its own end) and read its totals; ``lost`` when another
        cycle had taken it over; None when there is no such run (a chain's last
        link delivered after its run was deleted, KEEP_FINISHED after its end)."""
        with transaction(self.engine, budgets.quick(self.settings)) as queries:
            row = queries.close_run(run_id)
            lost = row is None
            if row is None:
                row = queries.run_state(run_id)
                if row is None:
                    return None
            queries.delete_old_runs(KEEP_FINISHED.total_seconds())
        return Finished(
            run_id=row.run_id,
            as_of=row.as_of,
            started_at=row.started_at,
            finished_at=row.finished_at,
            counts={key: int(row.counts.get(key, 0)) for key in COUNT_KEYS},
            blocked=list(row.blocked),
            paused=list(row.paused),
            errors=row.errors + (1 if lost else 0),
            duration_ms=max(0, round(row.took.total_seconds() * 1000)),
            lost=lost,
        )
