"""Engine, bounded transactions, schema migration and database creation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import (
    Connection,
    Engine,
    RootTransaction,
    create_engine,
    event,
    make_url,
    text,
)
from sqlalchemy.exc import SQLAlchemyError

from reaper import budgets
from reaper.budgets import Budget, Peer
from reaper.queries import Queries
from reaper.watchdog import WaitExceeded, watchdog

if TYPE_CHECKING:
    from alembic.config import Config

    from reaper.config import Settings

MIGRATIONS = Path(__file__).with_name("migrations")
# Connections opened beyond the pool's size when a burst needs them (a CLI
# command beside a running phase in one process, a test).
POOL_OVERFLOW = 2

_engines: dict[tuple[str, Peer | None, int], Engine] = {}


def engine_for(url: str, *, peer: Peer | None = None, pool_size: int = 4) -> Engine:
    """One pooled engine per URL and process (re-created after a fork, see lifecycle).

    ``peer`` bounds every connection on the worker's side (libpq's connect
    timeout, keepalives and TCP user timeout); the server's side is bounded per
    transaction by its budget. A pooled connection is pinged before use and
    replaced when the server or the network dropped it meanwhile.
    """
    key = (url, peer, pool_size)
    engine = _engines.get(key)
    if engine is None:
        engine = create_engine(
            url,
            pool_size=pool_size,
            max_overflow=POOL_OVERFLOW,
            pool_timeout=budgets.POOL_WAIT.total_seconds(),
            pool_reset_on_return="rollback",
            connect_args={
                "application_name": "conference-room-reaper",
                **(peer.libpq() if peer is not None else {}),
            },
        )
        event.listen(engine, "engine_connect", _bounded_ping)
        _engines[key] = engine
    return engine


def _bounded_ping(conn: Connection) -> None:
    """SQLAlchemy's pre-ping, within budgets.FIRST_ANSWER: a pooled connection the
    server or the network dropped is replaced (the pool connects anew); one that
    gets no answer (a pooler with no server connection free) is NoAnswer."""
    if conn.closed or conn.invalidated:
        return
    dbapi = conn.connection.dbapi_connection
    if dbapi is None:  # no longer checked out of the pool: nothing to ping
        return
    limit = budgets.FIRST_ANSWER.total_seconds()
    try:
        with watchdog.bound(dbapi.fileno(), limit):
            conn.dialect.do_ping(dbapi)
    except WaitExceeded as exc:
        conn.invalidate()
        raise NoAnswer(_no_answer(limit)) from exc
    except conn.dialect.loaded_dbapi.Error:
        conn.invalidate()  # stale: the next statement reconnects


def connections_needed(settings: Settings) -> int:
    """What a process holds at once at the most: a phase's lock session and its
    lanes, plus one for whatever runs beside them (a gauge refresh, /healthz).
    A stop-signal pass holds two (its lock's and its claims'), never beside a
    phase: it is a task of its own (a worker child runs one task at a time)
    and `reaper reap --once` runs it after the cycle."""
    return 1 + settings.drain_lanes + 1


def engine_of(settings: Settings) -> Engine:
    """The engine every part of the reaper uses: bounded connections, and a pool
    that holds what a phase needs at once (connections_needed)."""
    return engine_for(
        settings.database_url, peer=budgets.peer(settings), pool_size=connections_needed(settings)
    )


class NoAnswer(SQLAlchemyError):
    """A transaction could not start within budgets.FIRST_ANSWER."""


def bounded(conn: Connection, budget: Budget) -> Queries:
    """The first statement of a transaction: its budget, within budgets.FIRST_ANSWER.

    A server that has a connection for us answers it at once. When none does
    (a pooler's pool taken, a server or network that went silent without a
    reset), the watchdog ends the wait: one clear error instead of minutes.
    """
    queries = Queries(conn)
    fd = conn.connection.dbapi_connection.fileno()  # type: ignore[union-attr]
    limit = budgets.FIRST_ANSWER.total_seconds()
    try:
        with watchdog.bound(fd, limit):
            queries.bound_transaction(budget)
    except WaitExceeded as exc:
        raise NoAnswer(_no_answer(limit)) from exc
    return queries


def _no_answer(limit: float) -> str:
    return (
        f"the database gave no answer within {limit:g} s at the start of a transaction: "
        "behind a pooler, no server connection was free (a phase holds 1 + "
        "REAPER_DRAIN_LANES at once, docs/design.md#behind-pgbouncer), or the server "
        "or the network is gone"
    )


@contextmanager
def transaction(engine: Engine, budget: Budget) -> Iterator[Queries]:
    """One transaction within ``budget`` (reaper/budgets.py), committed at the end."""
    with engine.begin() as conn:
        yield bounded(conn, budget)


class Session:
    """A connection held for many transactions, each within the session's budget."""

    def __init__(self, conn: Connection, budget: Budget) -> None:
        self.conn = conn
        self.budget = budget

    @contextmanager
    def transaction(self) -> Iterator[Queries]:
        """One transaction, committed at the end (rolled back on an error)."""
        with self.conn.begin():
            yield bounded(self.conn, self.budget)


@contextmanager
def session(engine: Engine, budget: Budget) -> Iterator[Session]:
    """One connection for many transactions, each within ``budget``: a drain lane's.

    Holding the connection saves each batch the pool's checkout and ping. The
    budget is set in every transaction, never for the session: behind a pooler
    in transaction mode a session setting lands on whichever server connection
    ran it (docs/design.md#behind-pgbouncer). A connection the server or the
    network ended is discarded by the pool, never reused.
    """
    with engine.connect() as conn:
        yield Session(conn, budget)


def begin(conn: Connection, budget: Budget) -> tuple[RootTransaction, Queries]:
    """A transaction within ``budget`` on a connection the caller holds (and ends)."""
    transaction = conn.begin()
    return transaction, bounded(conn, budget)


def dispose_engines(close: bool = True) -> None:
    for engine in _engines.values():
        engine.dispose(close=close)
    if close:
        _engines.clear()


def alembic_config(url: str, peer: Peer | None = None) -> Config:
    """Alembic's configuration for ``url``; ``peer`` bounds its connection as
    engine_for bounds the reaper's (libpq parameters in the URL, which the
    migrations' environment connects with)."""
    # Alembic is imported here, not at the top: a reap cycle never needs it and
    # it is a tenth of a second of every `reaper reap --once` start.
    from alembic.config import Config

    if peer is not None:
        bounded = make_url(url).update_query_dict({k: str(v) for k, v in peer.libpq().items()})
        url = bounded.render_as_string(hide_password=False)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation: a literal % in a password must be doubled.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def ensure_database(url: str, peer: Peer | None = None) -> bool:
    """Create the URL's database when it does not exist; True if it was created.
    ``peer`` bounds the connection (libpq), as for engine_for."""
    target = make_url(url)
    if target.database is None:
        raise ValueError("the database URL names no database")
    admin = create_engine(
        target.set(database="postgres"),
        isolation_level="AUTOCOMMIT",
        connect_args=peer.libpq() if peer is not None else {},
    )
    try:
        with admin.connect() as conn:
            exists = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": target.database}
            ).scalar()
            if exists:
                return False
            quoted = conn.dialect.identifier_preparer.quote(target.database)
            conn.exec_driver_sql(f"CREATE DATABASE {quoted}")
            return True
    finally:
        admin.dispose()


def migrate(url: str, revision: str = "head", *, peer: Peer | None = None) -> None:
    """Create the database if needed and upgrade it; ``peer`` bounds both
    connections (``reaper migrate`` passes the settings' bounds)."""
    from alembic import command

    ensure_database(url, peer)
    command.upgrade(alembic_config(url, peer), revision)


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)
