"""Engine, bounded transactions, schema migration and database creation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, RootTransaction, create_engine, make_url, text
from sqlalchemy.exc import SQLAlchemyError

from reaper.budgets import Budget
from reaper.queries import Queries

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).with_name("migrations")

_engines: dict[str, Engine] = {}


def engine_for(url: str) -> Engine:
    """One pooled engine per URL and process (re-created after a fork, see celery_app)."""
    engine = _engines.get(url)
    if engine is None:
        engine = create_engine(
            url,
            pool_size=4,
            max_overflow=4,
            pool_pre_ping=True,
            pool_reset_on_return="rollback",
            connect_args={"application_name": "conference-room-reaper"},
        )
        _engines[url] = engine
    return engine


@contextmanager
def transaction(engine: Engine, budget: Budget) -> Iterator[Queries]:
    """One transaction within ``budget`` (reaper/budgets.py), committed at the end."""
    with engine.begin() as conn:
        queries = Queries(conn)
        queries.bound_transaction(budget)
        yield queries


class Session:
    """A connection held for many transactions, each within the session's budget."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    @contextmanager
    def transaction(self) -> Iterator[Queries]:
        """One transaction, committed at the end (rolled back on an error)."""
        with self.conn.begin():
            yield Queries(self.conn)


@contextmanager
def session(engine: Engine, budget: Budget) -> Iterator[Session]:
    """One connection for many transactions, each within ``budget``: a drain lane's.

    A transaction through :func:`transaction` costs five round trips (the pool's
    ping, BEGIN, the budget, the statement, COMMIT); a batch in a session costs
    three, the budget being set once for the session (docs/performance.md). It is
    reset before the connection goes back to the pool, or the connection is
    discarded.
    """
    with engine.connect() as conn:
        Queries(conn).bound_session(budget)
        conn.commit()  # a session setting outlives the transaction that set it
        try:
            yield Session(conn)
        finally:
            try:
                if conn.in_transaction():  # an error left it open
                    conn.rollback()
                Queries(conn).unbound_session()
                conn.commit()
            except SQLAlchemyError:  # the server ended the session: never reuse it
                conn.invalidate()


def begin(conn: Connection, budget: Budget) -> tuple[RootTransaction, Queries]:
    """A transaction within ``budget`` on a connection the caller holds (and ends)."""
    transaction = conn.begin()
    queries = Queries(conn)
    queries.bound_transaction(budget)
    return transaction, queries


def dispose_engines(close: bool = True) -> None:
    for engine in _engines.values():
        engine.dispose(close=close)
    if close:
        _engines.clear()


def alembic_config(url: str) -> Config:
    # Alembic is imported here, not at the top: a reap cycle never needs it and
    # it is a tenth of a second of every `reaper reap --once` start.
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation: a literal % in a password must be doubled.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def ensure_database(url: str) -> bool:
    """Create the URL's database when it does not exist; True if it was created."""
    target = make_url(url)
    admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
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


def migrate(url: str, revision: str = "head") -> None:
    from alembic import command

    ensure_database(url)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)
