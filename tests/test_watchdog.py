"""The watchdog: a wait that outlives its bound is ended by shutting its socket."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine, create_engine, make_url, text

from reaper import budgets
from reaper.db import NoAnswer, engine_for, transaction
from reaper.watchdog import TICK_S, WaitExceeded, Watchdog
from tests.support.netfault import Proxy

# A bound ends within a tick of its deadline (TICK_S: the tick it fell in, and the
# next one if the thread was asleep past it). Beyond that, a margin for a thread
# woken late on a CPU shared with the test beside it (the suite runs two at once):
# a watchdog that missed its bound leaves the wait open for ever, not a second.
LATE_S = 2 * TICK_S
SHARED_CPU_S = 1.0


def test_a_wait_past_its_bound_is_ended() -> None:
    watchdog = Watchdog()
    ours, peer = socket.socketpair()
    with ours, peer:
        started = time.monotonic()
        with (
            pytest.raises(WaitExceeded, match=r"no answer within 0\.3 s"),
            watchdog.bound(ours.fileno(), 0.3),
        ):
            if ours.recv(1) == b"":  # the peer never writes: only the shutdown ends it
                raise ConnectionError("closed")
        took = time.monotonic() - started
    assert 0.3 <= took <= 0.3 + LATE_S + SHARED_CPU_S, took


def test_a_wait_within_its_bound_is_left_alone() -> None:
    watchdog = Watchdog()
    ours, peer = socket.socketpair()
    with ours, peer:
        with watchdog.bound(ours.fileno(), 1.0):
            peer.sendall(b"x")
            assert ours.recv(1) == b"x"
        time.sleep(1.0 + LATE_S)  # past the bound: it was closed with the block
        peer.sendall(b"y")
        assert ours.recv(1) == b"y"


@pytest.fixture
def relay(database_url: str) -> Iterator[tuple[Proxy, Engine]]:
    """PostgreSQL behind a relay the test can pause: a pooler that has no server
    connection for its client (the kernel still acknowledges every byte)."""
    url = make_url(database_url)
    with Proxy(url.host or "127.0.0.1", url.port or 5432, name="watchdog") as relay:
        engine = create_engine(url.set(host="127.0.0.1", port=relay.port), pool_pre_ping=False)
        try:
            yield relay, engine
        finally:
            engine.dispose()


def test_a_transaction_nobody_answers_fails_within_the_first_answer_bound(
    relay: tuple[Proxy, Engine], monkeypatch: pytest.MonkeyPatch, settings
) -> None:
    relay_, engine = relay
    monkeypatch.setattr(budgets, "FIRST_ANSWER", timedelta(seconds=0.5))
    with transaction(engine, budgets.quick(settings)) as queries:  # passes while it relays
        queries.database_clock()
    relay_.pause()
    started = time.monotonic()
    with (
        pytest.raises(NoAnswer, match=r"no answer within 0\.5 s .* no server connection was free"),
        transaction(engine, budgets.quick(settings)),
    ):
        pass
    took = time.monotonic() - started
    assert took <= 0.5 + LATE_S + SHARED_CPU_S, took
    relay_.resume()
    with transaction(engine, budgets.quick(settings)) as queries:  # a new connection
        queries.database_clock()


def test_a_pooled_connection_nobody_answers_fails_its_checkout_within_the_bound(
    relay: tuple[Proxy, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's ping before a pooled connection is used is bounded as well."""
    relay_, plain = relay
    engine = engine_for(plain.url.render_as_string(hide_password=False), pool_size=1)
    monkeypatch.setattr(budgets, "FIRST_ANSWER", timedelta(seconds=0.5))
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    relay_.pause()
    started = time.monotonic()
    with pytest.raises(NoAnswer), engine.connect():
        pass
    assert time.monotonic() - started <= 0.5 + LATE_S + SHARED_CPU_S
    relay_.resume()
    engine.dispose()


def test_a_pooled_connection_the_server_ended_is_replaced_unseen(database_url, settings) -> None:
    engine = engine_for(database_url, pool_size=1)
    with engine.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    with engine_for(database_url).begin() as admin:
        admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    with transaction(engine, budgets.quick(settings)) as queries:
        assert queries.conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
