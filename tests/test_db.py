"""A drain lane's database session (reaper.db.session); the lanes themselves are
tests/test_drain.py's."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import DBAPIError

from reaper.budgets import Budget, Peer
from reaper.db import session, transaction

PEER = Peer(connect=timedelta(seconds=5), silence=timedelta(seconds=12))
BUDGET = Budget(idle=timedelta(seconds=7), statement=timedelta(seconds=3), peer=PEER)
SETTINGS = (
    "statement_timeout",
    "lock_timeout",
    "idle_in_transaction_session_timeout",
    "tcp_user_timeout",
    "tcp_keepalives_idle",
    "tcp_keepalives_interval",
    "tcp_keepalives_count",
)
# What BUDGET sets, as SHOW prints it: the keepalive's first probe after a
# third of the TCP timeout, four probes spread over the rest.
BOUNDED = ("3s", "3s", "7s", "12000", "4", "2", "4")


@pytest.fixture
def one_connection(database_url: str) -> Iterator[Engine]:
    """A pool of exactly one connection: what a session leaves behind is what the
    next user gets."""
    engine = create_engine(database_url, pool_size=1, max_overflow=0, pool_pre_ping=True)
    yield engine
    engine.dispose()


def shown(conn) -> tuple[str, ...]:
    return tuple(conn.execute(text(f"SHOW {name}")).scalar_one() for name in SETTINGS)


def test_every_transaction_of_a_session_is_bounded_and_the_pool_gets_it_back_clean(
    one_connection: Engine,
) -> None:
    with one_connection.connect() as conn:
        defaults = shown(conn)
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    with session(one_connection, BUDGET) as lane:
        for _ in range(2):
            with lane.transaction() as queries:
                assert shown(queries.conn) == BOUNDED
    with one_connection.connect() as conn:
        assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() == pid  # the same one
        assert shown(conn) == defaults


def test_no_budget_outlives_its_transaction(one_connection: Engine) -> None:
    """Behind a pooler in transaction mode a session-level setting would reach
    another client: between two transactions of a lane, and after a plain
    bounded transaction, the connection shows the server's defaults."""
    with one_connection.connect() as conn:
        defaults = shown(conn)
    assert defaults != BOUNDED
    with session(one_connection, BUDGET) as lane:
        with lane.transaction():
            pass
        assert shown(lane.conn) == defaults
        lane.conn.rollback()
    with transaction(one_connection, BUDGET) as queries:
        assert shown(queries.conn) == BOUNDED
    with one_connection.connect() as conn:
        assert shown(conn) == defaults


def test_a_failed_transaction_rolls_back_and_the_session_goes_on(one_connection: Engine) -> None:
    with session(one_connection, BUDGET) as lane:
        with pytest.raises(DBAPIError), lane.transaction() as queries:
            queries.conn.execute(text("CREATE TEMP TABLE lost (x int)"))
            queries.conn.execute(text("SELECT 1 / 0"))
        with lane.transaction() as queries:
            assert queries.conn.execute(text("SELECT to_regclass('lost')")).scalar() is None
            assert shown(queries.conn) == BOUNDED


def test_a_statement_past_the_budget_is_cancelled(one_connection: Engine) -> None:
    tight = Budget(idle=timedelta(seconds=5), statement=timedelta(milliseconds=200), peer=PEER)
    with (
        session(one_connection, tight) as lane,
        pytest.raises(DBAPIError, match="statement timeout"),
        lane.transaction() as queries,
    ):
        queries.conn.execute(text("SELECT pg_sleep(2)"))


def test_a_session_the_server_ended_is_discarded_not_returned(
    one_connection: Engine, engine: Engine
) -> None:
    with session(one_connection, BUDGET) as lane:
        with lane.transaction() as queries:
            pid = queries.conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with engine.begin() as admin:
            admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    with one_connection.connect() as conn:  # a new connection, with the defaults
        assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
        assert shown(conn)[0] == "0"
