"""The single-runner lock (CONTRACT §7).

A transaction-level advisory lock on its own connection: it ends with that
transaction, so it can never travel back into the pool, and
``idle_in_transaction_session_timeout = LockTtl`` makes PostgreSQL end the
session (and free the lock) of a runner that hangs. A killed runner's
connection closes, which frees it at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from reaper.logs import get_logger, log
from reaper.queries import Queries

logger = get_logger("lock")


def millis(duration: timedelta) -> int:
    return int(duration.total_seconds() * 1000)


@contextmanager
def run_lock(engine: Engine, ttl: timedelta) -> Iterator[int | None]:
    """Yield ``None`` while holding the lock, or the holder's pid when it is taken."""
    conn = engine.connect()
    try:
        transaction = conn.begin()
        queries = Queries(conn)
        queries.bound_transaction(idle_ms=millis(ttl), statement_ms=5_000)
        if not queries.try_run_lock():
            holder = queries.run_lock_holder()
            transaction.rollback()
            yield holder if holder is not None else -1
            return
        try:
            yield None
        finally:
            try:
                transaction.rollback()  # releases the lock; the transaction wrote nothing
            except DBAPIError as exc:
                # The server ended the session: we held it past LockTtl.
                log(logger, "lock.lost", level=40, error=str(exc.orig).strip())
    finally:
        conn.close()


def holder(engine: Engine) -> int | None:
    """The pid holding the lock, or None when it is free (read-only)."""
    with engine.connect() as conn:
        return Queries(conn).run_lock_holder()
