"""A lock held on a connection of its own for as long as its holder proves it is alive.

The run lock's phases (reaper/runs.py), the relay's pass (reaper/relay.py) and
the stop-signal pass (reaper/recorder.py) each hold a transaction-level
advisory lock in a transaction of its own, on a connection of its own (the
*lock session*), while their work runs on other connections. Its budget is
budgets.run_lock: the server ends the lock session once it is silent for a
whole REAPER_RUN_LEASE, which frees the lock. :class:`Heartbeat` speaks on it
several times per lease from a thread of its own, so only a frozen, cut-off or
dead holder goes silent; after a give-up bound (the longest a healthy holder
needs) it stops, so a holder alive but never ending loses the lock one lease
later. A heartbeat may also *tend* other connections whose transactions wait
on something else than the database (a relay batch awaiting Kafka): they are
bounded by the lease too, and so freed a lease after their holder froze.

:class:`PassLock` is the lock of a pass (relay, stop signals): taken without
waiting, with the backend pid of the lock session, which the pass's
statements are fenced on (docs/design.md#the-single-runner-lock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

from sqlalchemy import Connection, Engine, RootTransaction
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from reaper import budgets
from reaper.config import Settings
from reaper.db import begin
from reaper.errors import describe
from reaper.queries import Queries

# How often a holder proves it is alive per REAPER_RUN_LEASE: a late beat or two
# (a busy process, a slow round trip) never costs the lock.
HEARTBEATS_PER_LEASE = 4


class Heartbeat:
    """The holder's proof of life on its lock session, from a thread of its own.

    Every ``period`` it runs one statement on that session (and on each tended
    connection), so the server's idle bound (a whole REAPER_RUN_LEASE of
    silence) ends only a dead, frozen or partitioned holder's sessions. After
    ``give_up`` it stops: a holder that is alive but never ends then loses the
    lock one lease later. A failed beat on the lock session means the lock is
    gone (:attr:`lost`) and ends the beats. The holder's own threads leave the
    lock session alone from the claim until :meth:`stop` has returned, and a
    tended connection from :meth:`tend` until :meth:`untend` has returned.
    """

    def __init__(self, conn: Connection | None, *, period_s: float, give_up_s: float) -> None:
        self.conn = conn  # None: no lock, only tended connections (a pass without a lock)
        self.lost = threading.Event()
        self._period_s = period_s
        self._give_up_at = time.monotonic() + give_up_s
        self._stop = threading.Event()
        self._tended: list[Connection] = []
        # held while a tended connection is beaten, so untend() waits for that beat
        self._guard = threading.Lock()
        self._thread = threading.Thread(target=self._beat, name="reaper-heartbeat", daemon=True)

    @classmethod
    def per_lease(cls, conn: Connection | None, settings: Settings, give_up_s: float) -> Heartbeat:
        """Beats HEARTBEATS_PER_LEASE times per REAPER_RUN_LEASE."""
        period = settings.run_lease.total_seconds() / HEARTBEATS_PER_LEASE
        return cls(conn, period_s=period, give_up_s=give_up_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def tend(self, conn: Connection) -> None:
        """Speak on ``conn``'s transaction too, until :meth:`untend`."""
        with self._guard:
            self._tended.append(conn)

    def untend(self, conn: Connection) -> None:
        """No more beats on ``conn``; returns after a beat in progress on it."""
        with self._guard:
            if conn in self._tended:
                self._tended.remove(conn)

    def _beat(self) -> None:
        while not self._stop.wait(self._period_s):
            if time.monotonic() >= self._give_up_at:
                return
            if self.conn is not None:
                try:
                    Queries(self.conn).run_heartbeat()
                except SQLAlchemyError:
                    # the session is gone: so is the lock; the tended transactions
                    # are left to their lease (they can commit nothing without it)
                    self.lost.set()
                    return
            with self._guard:
                for conn in self._tended:
                    # a tended transaction that failed fails its holder's next statement
                    with suppress(SQLAlchemyError):
                        Queries(conn).run_heartbeat()


@dataclass
class PassLock:
    """A pass's lock, held: the lock session's backend pid (what the pass's claims
    and marks are fenced on; None for a pass that takes no lock) and its heartbeat."""

    holder_pid: int | None
    heartbeat: Heartbeat
    error: str | None = field(default=None)  # why the lock was found lost at the end

    @classmethod
    def unlocked(cls) -> PassLock:
        """The stand-in of a pass that takes no lock: nothing fenced, never lost
        (its heartbeat is never started)."""
        return cls(None, Heartbeat(None, period_s=1.0, give_up_s=0.0))

    @property
    def lost(self) -> bool:
        """The lock session is known to be gone (the heartbeat found it so)."""
        return self.heartbeat.lost.is_set()


@contextmanager
def pass_lock(
    engine: Engine,
    settings: Settings,
    *,
    take: Callable[[Queries], int | None],
    wait_for_marks: Callable[[Queries], None],
    give_up_s: float,
) -> Iterator[PassLock | None]:
    """The lock of one pass, or None when another pass holds it.

    ``take`` tries the lock without waiting and returns the lock session's
    backend pid when it got it. ``wait_for_marks`` then waits, in a savepoint
    that frees what it took, until every transaction of an earlier holder that
    passed its fence has ended (the gate of the marks, queries.sql): whatever
    that holder still commits is committed before this pass begins. A wait
    past the budget's lock_timeout raises (an earlier holder's marks are
    stuck in their commit: the pass is not begun).

    At the end the lock session is rolled back, which frees the lock; when it
    was already gone, :attr:`PassLock.error` says why.
    """
    conn = engine.connect()
    try:
        tx, queries = begin(conn, budgets.run_lock(settings))
        pid = take(queries)
        if pid is None:
            yield None
            return
        savepoint = conn.begin_nested()
        try:
            wait_for_marks(queries)
        finally:
            savepoint.rollback()  # frees what the wait took; the pass lock stays
        heartbeat = Heartbeat.per_lease(conn, settings, give_up_s)
        lock = PassLock(pid, heartbeat)
        heartbeat.start()
        try:
            yield lock
        finally:
            heartbeat.stop()
            lock.error = _release(conn, tx, lost=lock.lost)
    finally:
        conn.close()


def _release(conn: Connection, tx: RootTransaction, *, lost: bool) -> str | None:
    """End the lock session (the lock ends with its transaction); why it had
    ended already, when it had."""
    if lost:
        with suppress(SQLAlchemyError):
            tx.rollback()
        return "the lock session was ended (by the server or the network) during the pass"
    try:
        # an ended session cannot answer: one that does held the lock to the end
        Queries(conn).run_heartbeat()
        tx.rollback()
    except DBAPIError as exc:
        with suppress(SQLAlchemyError):
            tx.rollback()
        return describe(exc)
    return None
