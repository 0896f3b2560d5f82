"""Engine, bounded transactions, schema migration and database creation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, RootTransaction, create_engine, make_url, text

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
