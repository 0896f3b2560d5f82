"""Connections that die silently: no reset, no reply, as after a failover, a
dropped NAT entry or a partition (issue 15).

The fast tests check that every connection carries its bounds (libpq's connect
timeout, keepalives and TCP user timeout; Redis socket and connect timeouts,
keepalive, TCP user timeout and health checks) and that a connection to a
server that accepts and never answers gives up within them. The process tests
cut every connection of a real ``worker -B`` through a proxy
(tests/support/netfault.py: iptables drops every packet of the connections
open at that moment, on both legs, while new connections pass) and measure how
soon closing resumes; and run every CLI verb against a silent server.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import kombu
import kombu.exceptions
import pytest
from kombu.transport.redis import Channel as RedisChannel
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.exc import OperationalError

from reaper import budgets
from reaper.broker import transport_options
from reaper.config import Settings
from reaper.db import alembic_config, engine_of, ensure_database
from tests.conftest import REDIS_URL
from tests.support import factory as f
from tests.support.activity import BATCH_RUNNING
from tests.support.facts import count_events
from tests.support.figures import figure
from tests.support.ledger import assert_clean
from tests.support.netfault import Proxy, SilentServer
from tests.support.ports import free_port
from tests.support.processes import Worker, run_cli, wait_until

pytestmark = pytest.mark.long  # minutes: started first (tests/support/runner.py)

CONNECT_TIMEOUT = 2.0


def silent_url(server: SilentServer) -> str:
    return database_at(server.port)


def database_at(port: int) -> str:
    return f"postgresql+psycopg2://postgres@127.0.0.1:{port}/reaper"


# -- fast: the bounds are really on the connections ------------------------------------


def test_database_connections_carry_the_client_side_bounds(database_url):
    settings = Settings(
        database_url=database_url, database_connect_timeout=3, database_tcp_timeout=9
    )
    with engine_of(settings).connect() as conn:
        dsn = conn.connection.dbapi_connection.get_dsn_parameters()  # type: ignore[union-attr]
    assert dsn["connect_timeout"] == "3"
    assert dsn["keepalives"] == "1"
    assert dsn["tcp_user_timeout"] == "9000"
    assert dsn["keepalives_idle"] == "3"  # a third of the TCP timeout
    assert dsn["keepalives_interval"] == "2"  # 4 probes over the other two thirds (rounded)
    assert dsn["keepalives_count"] == str(budgets.KEEPALIVE_PROBES)


def test_migrations_connect_with_the_same_bounds(database_url):
    peer = budgets.Peer(connect=timedelta(seconds=3), silence=timedelta(seconds=9))
    url = make_url(alembic_config(database_url, peer).get_main_option("sqlalchemy.url") or "")
    assert url.query["connect_timeout"] == "3"
    assert url.query["tcp_user_timeout"] == "9000"
    assert url.query["keepalives"] == "1"
    # and the migrations' environment connects with them (it is the session's database)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            dsn = conn.connection.dbapi_connection.get_dsn_parameters()  # type: ignore[union-attr]
    finally:
        engine.dispose()
    assert (dsn["connect_timeout"], dsn["tcp_user_timeout"]) == ("3", "9000")


def test_migrate_gives_up_on_a_silent_server_within_its_connect_timeout():
    from alembic import command

    peer = budgets.Peer(connect=timedelta(seconds=1), silence=timedelta(seconds=5))
    with SilentServer() as server:
        for attempt in (
            lambda: ensure_database(silent_url(server), peer),
            lambda: command.upgrade(alembic_config(silent_url(server), peer), "head"),
        ):
            started = time.monotonic()
            with pytest.raises(OperationalError, match="timeout expired"):
                attempt()
            assert time.monotonic() - started < 1 + 2  # the connect timeout, and a margin
        assert server.accepted >= 2  # both reached the server: the bound ended the wait


def test_broker_connections_carry_the_bounds(services):
    from reaper.celery_app import app

    settings = Settings()
    # what the worker, its beat and every producer get: the app's transport options
    assert transport_options(settings).items() <= app.conf.broker_transport_options.items()
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert isinstance(channel, RedisChannel)  # the broker is Redis
        client = channel.client
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == settings.broker_tcp_timeout.total_seconds()
        assert kwargs["socket_connect_timeout"] == settings.broker_connect_timeout.total_seconds()
        assert kwargs["health_check_interval"] == (
            settings.broker_health_check_interval.total_seconds()
        )
        assert client.ping()
        redis_conn = client.connection_pool.get_connection()
        try:
            sock = redis_conn._sock
            assert sock is not None
            assert sock.gettimeout() == settings.broker_tcp_timeout.total_seconds()
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == (
                settings.broker_tcp_timeout.total_seconds() * 1000
            )
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == round(
                settings.broker_tcp_timeout.total_seconds() / 3
            )
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == (
                budgets.KEEPALIVE_PROBES
            )
        finally:
            client.connection_pool.release(redis_conn)


def test_a_publish_to_a_silent_broker_gives_up_within_its_timeout():
    settings = Settings(broker_tcp_timeout=2, broker_connect_timeout=1)
    with SilentServer() as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        with kombu.Connection(url, transport_options=transport_options(settings)) as conn:
            started = time.monotonic()
            with pytest.raises(kombu.exceptions.OperationalError, match="Timeout reading"):
                producer = conn.Producer()
                producer.publish({"x": 1}, routing_key="reaper-net-test", retry=False)
            waited = time.monotonic() - started
    # A new connection's start waits on a few replies (its health-check PING, the
    # handshake; three with redis-py 8.1), each within the timeout: a bounded
    # multiple of it, never for ever.
    assert waited < 4 * 2 + 2, waited


# -- process: the CLI against a server that accepts and never answers -----------------

TENANT = "00000000-0000-0000-0000-0000000000aa"
VERBS = {
    "migrate": ["migrate"],
    "status": ["status"],
    "plan": ["plan"],
    "reap --once": ["reap", "--once"],
    "pause": ["pause", "--reason", "network test"],
    "resume": ["resume"],
    "policy set": ["policy", "set", "--tenant", TENANT, "--empty-room-grace", "60"],
    "policy unset": ["policy", "unset", "--tenant", TENANT],
    "policy list": ["policy", "list"],
    "outbox parked": ["outbox", "parked"],
    "outbox requeue": ["outbox", "requeue", "--all"],
}
# The CLI's budget against a silent server: one connect timeout (the first
# connection that fails ends the command) over the same command's time against
# a port that refuses at once, measured in the same run (the process's own start
# and imports take seconds on a loaded machine), plus slack for a machine
# whose load changes between the two runs.
CLI_BUDGET = CONNECT_TIMEOUT + 3.0


@pytest.mark.process
def test_every_cli_verb_gives_up_on_a_silent_database_with_one_line(capsys):
    with SilentServer() as server:
        env = {
            "REAPER_DATABASE_URL": silent_url(server),
            "REAPER_DATABASE_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT),
        }

        refused = {**env, "REAPER_DATABASE_URL": database_at(free_port())}

        def run(verb: str, env: dict[str, str] = env) -> tuple[str, float, int, str]:
            started = time.monotonic()
            done = run_cli(*VERBS[verb], env=env, timeout=CLI_BUDGET + 60)
            return verb, time.monotonic() - started, done.returncode, done.stderr

        with ThreadPoolExecutor(max_workers=3) as pool:
            baseline = {
                verb: took for verb, took, _, _ in pool.map(lambda verb: run(verb, refused), VERBS)
            }
            results = list(pool.map(run, VERBS))
        accepted = server.accepted
    for verb, took, code, stderr in results:
        lines = stderr.strip().splitlines()
        assert code == 1, (verb, code, stderr)
        assert len(lines) == 1, (verb, stderr)
        assert lines[0].startswith("reaper: database "), (verb, stderr)
        assert "timeout expired" in lines[0], (verb, stderr)
        assert took - baseline[verb] < CLI_BUDGET, (verb, took, baseline[verb])
    assert accepted >= len(VERBS)  # every verb reached the server: its bound ended the wait
    slowest = max(took for _, took, _, _ in results)
    figure(
        f"silent database (accepts, never answers): {len(VERBS)} CLI verbs each "
        f"exited 1 with one line, slowest after {slowest:.1f}s, at most "
        f"{max(took - baseline[verb] for verb, took, _, _ in results):.1f}s more than "
        f"against a refusing port (REAPER_DATABASE_CONNECT_TIMEOUT={CONNECT_TIMEOUT:g}s, "
        f"budget {CLI_BUDGET:g}s over that)"
    )


# -- process: every connection of a running worker cut -----------------------------------

FAULT_WINDOW = 60.0

# Each row a reaper batch updates takes 20 ms: a batch of 25 holds its rows for
# half a second, so the cut reliably lands inside one. Other sessions are not slowed.
SLOW_BATCH = """
CREATE FUNCTION messenger.test_slow_batch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('application_name') = 'conference-room-reaper' THEN
        PERFORM pg_sleep(0.02);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_slow_batch BEFORE UPDATE ON messenger.conference_sessions
    FOR EACH ROW EXECUTE FUNCTION messenger.test_slow_batch();
"""
NO_SLOW_BATCH = """
DROP TRIGGER IF EXISTS test_slow_batch ON messenger.conference_sessions;
DROP FUNCTION IF EXISTS messenger.test_slow_batch();
"""
IN_BATCH = text(
    f"""
    SELECT count(*) FROM pg_stat_activity
    WHERE datname = current_database() AND application_name = 'conference-room-reaper'
      AND {BATCH_RUNNING}
    """
)
LIVE = text("SELECT id FROM messenger.conference_sessions WHERE status = 'Active'")
LIVE_UNLOCKED = text(
    "SELECT id FROM messenger.conference_sessions WHERE status = 'Active' FOR UPDATE SKIP LOCKED"
)
ENDED = text("SELECT count(*) FROM messenger.conference_sessions WHERE status = 'Ended'")


@pytest.fixture
def direct(engine: Engine, database_url: str) -> Iterator[Engine]:
    """The test's own engine, straight to PostgreSQL (not through the proxy)."""
    direct = create_engine(database_url, connect_args={"application_name": "network-fault-test"})
    yield direct
    direct.dispose()


def locked_rooms(engine: Engine) -> set[str]:
    """Live rooms whose rows another session holds locked now."""
    with engine.connect() as conn, conn.begin() as tx:
        live = {str(r) for r in conn.execute(LIVE).scalars()}
        unlocked = {str(r) for r in conn.execute(LIVE_UNLOCKED).scalars()}
        tx.rollback()
    return live - unlocked


def can_update(engine: Engine, ids: set[str]) -> bool:
    """Whether another session can update these rooms now (it waits one second at most)."""
    with engine.connect() as conn, conn.begin() as tx:
        conn.execute(text("SET LOCAL lock_timeout = '1s'"))
        try:
            conn.execute(
                text(
                    "UPDATE messenger.conference_sessions SET updated_at = updated_at"
                    " WHERE id = ANY(CAST(:ids AS uuid[]))"
                ),
                {"ids": sorted(ids)},
            )
        except OperationalError:  # lock_timeout: still held
            return False
        finally:
            tx.rollback()
    return True


def in_batch(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(IN_BATCH).scalar_one()


def ended(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(ENDED).scalar_one()


@pytest.mark.process
def test_every_database_connection_of_a_draining_worker_cut(direct, database_url, tmp_path):
    rooms = 20_000
    with direct.begin() as conn:
        f.bulk_conferences(conn, rooms, as_of=datetime.now(UTC))
        conn.execute(text(SLOW_BATCH))
    target = make_url(database_url)
    proxy = Proxy(target.host or "127.0.0.1", target.port or 5432, name="pg").start()
    worker = Worker(
        tmp_path,
        {
            "REAPER_DATABASE_URL": target.set(host="127.0.0.1", port=proxy.port).render_as_string(
                hide_password=False
            ),
            "REAPER_POLLING_INTERVAL": "2",
            "REAPER_BATCH_SIZE": "25",
            "REAPER_RUN_LEASE": "4",
            "REAPER_DATABASE_TCP_TIMEOUT": "6",
            "REAPER_DATABASE_CONNECT_TIMEOUT": "2",
        },
        name="pg-cut",
    )
    try:
        worker.start()
        wait_until(lambda: ended(direct) > 0, 60, "the drain under way", 0.2)
        wait_until(lambda: in_batch(direct), 30, "a batch in flight", 0.01)
        cut_at = time.monotonic()
        connections = proxy.cut()
        ended_at_cut = ended(direct)
        time.sleep(1)  # the cut statement ends on the server (its reply goes nowhere)
        held = locked_rooms(direct)
        assert held, "the cut landed between batches: no rows held"
        wait_until(lambda: can_update(direct, held), FAULT_WINDOW, "the cut batch's rooms freed")
        freed = time.monotonic() - cut_at
        wait_until(
            lambda: ended(direct) >= ended_at_cut + 2 * 25,
            FAULT_WINDOW,
            "closing resumed after the cut",
            0.2,
        )
        resumed = time.monotonic() - cut_at
        out = worker.output()
    finally:
        worker.stop()
        proxy.close()
        with direct.begin() as conn:
            conn.execute(text(NO_SLOW_BATCH))
    assert proxy.rules() == []
    assert_clean(direct)  # nothing closed twice, no half batch
    figure(
        f"every PostgreSQL connection of a draining worker cut silently "
        f"({connections} connections; REAPER_DATABASE_TCP_TIMEOUT=6s, REAPER_RUN_LEASE=4s, "
        f"polling 2s): the cut batch's {len(held)} rooms updatable by others {freed:.1f}s "
        f"after the cut, closing resumed {resumed:.1f}s after it "
        f"({count_events(out, 'phase.failed')} phase.failed, "
        f"{count_events(out, 'cycle.taken_over')} cycle.taken_over)"
    )


def completed_runs_since(engine: Engine, since: datetime) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM messenger.reaper_runs"
                " WHERE outcome = 'completed' AND started_at > :since"
            ),
            {"since": since},
        ).scalar_one()


def database_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        return conn.execute(text("SELECT now()")).scalar_one()


def seed_rooms(engine: Engine, count: int) -> list[str]:
    with engine.begin() as conn:
        return [
            f.conference(conn, as_of=datetime.now(UTC), idle=timedelta(minutes=5))["id"]
            for _ in range(count)
        ]


def ended_of(engine: Engine, ids: list[str]) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM messenger.conference_sessions"
                " WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'Ended'"
            ),
            {"ids": ids},
        ).scalar_one()


@pytest.mark.process
def test_every_redis_connection_of_the_worker_and_its_beat_cut(direct, tmp_path):
    redis = make_url(REDIS_URL.replace("redis://", "postgresql://"))  # host and port only
    proxy = Proxy(redis.host or "127.0.0.1", redis.port or 6379, name="redis").start()
    worker = Worker(
        tmp_path,
        {
            "REAPER_BROKER_URL": f"redis://127.0.0.1:{proxy.port}/{redis.database or 0}",
            "REAPER_POLLING_INTERVAL": "2",
            # A message in flight at the cut (a link of the cycle's chain) is
            # lost with its connection: the run is taken over after this.
            "REAPER_RUN_LEASE": "4",
        },
        name="redis-cut",
    )
    try:
        worker.start()
        first = seed_rooms(direct, 3)
        wait_until(lambda: ended_of(direct, first) == 3, 30, "reaped before the cut", 0.2)
        time.sleep(2)  # a tick more: the beat's and the pool's connections are open too
        since = database_now(direct)
        cut_at = time.monotonic()
        connections = proxy.cut()
        after = seed_rooms(direct, 3)
        wait_until(
            lambda: completed_runs_since(direct, since), FAULT_WINDOW, "a cycle after the cut", 0.2
        )
        next_cycle = time.monotonic() - cut_at
        wait_until(lambda: ended_of(direct, after) == 3, FAULT_WINDOW, "reaped after the cut", 0.2)
        closing = time.monotonic() - cut_at
        assert worker.proc is not None and worker.proc.poll() is None  # the same worker
        out = worker.output()
    finally:
        worker.stop()
        proxy.close()
    assert proxy.rules() == []
    assert "Unrecoverable error" not in out
    assert_clean(direct)
    figure(
        f"every Redis connection of worker -B cut silently ({connections} "
        f"connections; REAPER_BROKER_TCP_TIMEOUT and REAPER_BROKER_HEALTH_CHECK_INTERVAL "
        f"at their defaults, polling 2s): next completed cycle {next_cycle:.1f}s after the "
        f"cut, rooms that became eligible at the cut closed {closing:.1f}s after it "
        f"({out.count('Connection to broker lost')} connection-lost lines, "
        f"{count_events(out, 'cycle.taken_over')} cycle.taken_over)"
    )


# -- the fault itself --------------------------------------------------------------------


@pytest.mark.process
def test_a_cut_silences_open_connections_and_lets_new_ones_pass():
    redis = make_url(REDIS_URL.replace("redis://", "postgresql://"))
    proxy = Proxy(redis.host or "127.0.0.1", redis.port or 6379, name="self").start()
    try:
        before = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        before.sendall(b"PING\r\n")
        assert before.recv(64) == b"+PONG\r\n"
        assert proxy.cut() == 1
        assert len(proxy.rules()) == 4  # both legs, both directions
        before.settimeout(1)
        before.sendall(b"PING\r\n")
        with pytest.raises(TimeoutError):  # no reply, no reset: silence
            before.recv(64)
        after = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        after.sendall(b"PING\r\n")
        assert after.recv(64) == b"+PONG\r\n"  # a new connection passes
        after.close()
        before.close()
    finally:
        proxy.close()
    assert proxy.rules() == []
