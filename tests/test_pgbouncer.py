"""Behind PgBouncer in transaction pooling mode (docs/design.md#behind-pgbouncer):
the whole cycle, a worker, the relay and the CLI through a real PgBouncer, no
setting of the reaper reaching another client, and the smallest pool a phase
needs."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime, timedelta
from functools import partial

import psycopg2
import pytest
from sqlalchemy import Engine, text

from bench.seed import one_row
from reaper.config import Settings
from reaper.db import engine_of
from reaper.kafka import ProducerSlot
from reaper.relay import Relay
from tests.support import factory as f
from tests.support.facts import output_events
from tests.support.figures import figure
from tests.support.kafka import create_topic, read_topic
from tests.support.ledger import assert_clean, books, tally
from tests.support.pgbouncer import PgBouncer
from tests.support.processes import Worker, run_cli, wait_until

pytestmark = pytest.mark.long  # minutes: started first (tests/support/runner.py)

# Every setting the reaper's transaction budgets set (queries.sql, ``bound``).
BUDGET_SETTINGS = (
    "statement_timeout",
    "lock_timeout",
    "idle_in_transaction_session_timeout",
    "tcp_user_timeout",
    "tcp_keepalives_idle",
    "tcp_keepalives_interval",
    "tcp_keepalives_count",
)
READ_SETTINGS = "SELECT pg_backend_pid(), " + ", ".join(
    f"current_setting('{name}')" for name in BUDGET_SETTINGS
)


def through(bouncer: PgBouncer, **env: str) -> dict[str, str]:
    """The environment of a reaper process whose database is behind ``bouncer``."""
    return {"REAPER_DATABASE_URL": bouncer.url, **env}


def statuses(engine: Engine) -> dict[str, tuple[str, str | None]]:
    with engine.connect() as conn:
        return f.statuses(conn)


def closed_as(engine: Engine, wanted: dict[str, tuple[str, str | None]]) -> bool:
    """Every room in ``wanted`` has the status and end reason given there."""
    now = statuses(engine)
    return all(now[i] == s for i, s in wanted.items())


def seed_every_phase(engine: Engine, as_of: datetime) -> dict[str, tuple[str, str | None]]:
    """Rooms each phase closes and rooms none closes; id -> (status, end_reason) expected."""
    expected: dict[str, tuple[str, str | None]] = {}
    with engine.begin() as conn:
        for _ in range(3):
            room = f.conference(conn, as_of=as_of, idle=timedelta(minutes=5))
            expected[room["id"]] = ("Ended", "EmptyTimeout")
            room = f.conference(conn, as_of=as_of, status="Provisioning", age=timedelta(minutes=3))
            expected[room["id"]] = ("Failed", "Error")
            room = f.conference(conn, as_of=as_of, idle=timedelta(hours=5), participants=2)
            expected[room["id"]] = ("Ended", "Timeout")
        for kwargs in (
            {"idle": timedelta(seconds=30)},  # in its grace
            {"idle": timedelta(minutes=10), "participants": 1},  # occupied, not stale
            {"status": "Provisioning", "age": timedelta(seconds=30)},
        ):
            room = f.conference(conn, as_of=as_of, **kwargs)
            expected[room["id"]] = (room["status"], None)
    return expected


def defaults(database_url: str) -> tuple[str, ...]:
    """The server's defaults of the budget settings, on a direct connection."""
    conn = psycopg2.connect(database_url.replace("postgresql+psycopg2", "postgresql"))
    try:
        with conn.cursor() as cur:
            cur.execute(READ_SETTINGS)
            return tuple(one_row(cur)[1:])
    finally:
        conn.close()


class Watcher(threading.Thread):
    """Another client of the same PgBouncer: reads the budget settings outside
    any transaction, again and again, on whichever server connection it is given."""

    def __init__(self, bouncer: PgBouncer) -> None:
        super().__init__(daemon=True)
        self.conn = bouncer.connect()
        self.conn.autocommit = True  # every read is a transaction of its own
        self.seen: list[tuple[int, tuple[str, ...]]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with self.conn.cursor() as cur:
            while not self.halt.is_set():
                cur.execute(READ_SETTINGS)
                pid, *values = one_row(cur)
                self.seen.append((pid, tuple(values)))
                time.sleep(0.002)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=10)
        self.conn.close()


def every_server_connection(bouncer: PgBouncer) -> dict[int, tuple[str, ...]]:
    """The budget settings on each server connection PgBouncer holds: one client
    transaction per server connection, all held at once, so each gets its own."""
    pids = bouncer.server_pids()
    clients = [bouncer.connect() for _ in pids]
    seen: dict[int, tuple[str, ...]] = {}
    try:
        for client in clients:
            with client.cursor() as cur:
                cur.execute(READ_SETTINGS)  # opens a transaction: its server stays its own
                pid, *values = one_row(cur)
                seen[pid] = tuple(values)
    finally:
        for client in clients:
            client.close()
    assert pids <= set(seen), f"server connections not read: {pids - set(seen)}"
    return seen


# -- the whole cycle, a worker, the relay, the CLI ----------------------------


def reap_once_closes_every_phase(bouncer: PgBouncer, engine: Engine) -> None:
    expected = seed_every_phase(engine, f.db_now(engine))
    done = run_cli("reap", "--once", "--json", env=through(bouncer))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert (
        result["empty_timeout_count"],
        result["provision_failed_count"],
        result["stale_timeout_count"],
        result["failed_count"],
    ) == (3, 3, 3, 0)
    assert statuses(engine) == expected
    found = books(engine)
    found.assert_clean()  # each closed room has its event (pending: no relay) and push row
    assert (found.tally.integration, found.tally.realtime) == (6, 9)
    with engine.connect() as conn:
        correlations = {r["payload"]["correlationId"] for r in f.outbox(conn)}
    assert correlations == {result["run_id"]}
    assert output_events(done.stderr, "lock.lost") == []


def test_reap_once_through_pgbouncer_closes_every_phase(pgbouncer, engine):
    reap_once_closes_every_phase(pgbouncer, engine)


@pytest.mark.process
def test_reap_once_through_pgbouncer_in_session_mode_closes_every_phase(database_url, engine):
    with PgBouncer(database_url, mode="session") as bouncer:
        config = {row["key"]: row["value"] for row in bouncer.admin("SHOW CONFIG")}
        assert config["pool_mode"] == "session"
        reap_once_closes_every_phase(bouncer, engine)


def test_a_worker_through_pgbouncer_reaps_across_cycles_and_relays_to_kafka(
    pgbouncer, engine, kafka_broker, tmp_path
):
    topic = f"bouncer.conference-ended.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    env = through(
        pgbouncer,
        REAPER_POLLING_INTERVAL="1",
        REAPER_KAFKA_BOOTSTRAP_SERVERS=kafka_broker,
        REAPER_CONFERENCE_ENDED_TOPIC=topic,
        REAPER_KAFKA_TIMEOUT="4",
        REAPER_RELAY_INTERVAL="1",
    )
    worker = Worker(tmp_path, env).start()
    expected: dict[str, tuple[str, str | None]] = {}
    try:
        for _ in range(3):  # one round at a time: each is closed by a cycle of its own
            round_ = seed_every_phase(engine, f.db_now(engine))
            expected.update(round_)
            wanted = {i: s for i, s in expected.items() if s[1] is not None}
            wait_until(partial(closed_as, engine, wanted), 30, "the round closed by the worker")
        ended = [i for i, (status, _) in expected.items() if status == "Ended"]
        records = read_topic(kafka_broker, topic, expect=len(ended), timeout=30)
    finally:
        worker.stop()
    assert statuses(engine) == expected
    # every room closed has its one event, read from the topic (each row deleted
    # at its acknowledgement), and its push row
    verdict = assert_clean(engine, bootstrap=kafka_broker, topic=topic)
    assert verdict.on_kafka == len(ended) and verdict.pending == 0, verdict.summary()
    assert sorted(r.value["payload"]["conferenceId"] for r in records) == sorted(ended)
    with engine.connect() as conn:
        rows = f.outbox(conn)
        runs = conn.execute(
            text("SELECT count(*) FROM messenger.reaper_runs WHERE outcome = 'completed'")
        ).scalar_one()
    assert rows == []  # each deleted at its own acknowledgement: its event is on Kafka
    assert len({r.value["correlationId"] for r in records}) >= 3  # a cycle per round at least
    assert runs >= 3
    out = worker.output()
    assert output_events(out, "lock.lost") == [] and output_events(out, "phase.failed") == []


@pytest.mark.process
def test_the_relay_publishes_through_pgbouncer_with_a_pool_of_two(
    database_url, engine, kafka_broker
):
    """Two server connections are what a pass needs at the least: its lock's
    transaction, and one batch at a time (the next batch's claim waits for the
    commit of the one before)."""
    topic = f"bouncer.relay.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    keys = [f"deal-{n}" for n in range(40)]
    with engine.begin() as conn:
        for n in range(400):
            event_id = str(uuid.uuid4())
            conn.execute(
                text(
                    "INSERT INTO messenger.integration_outbox (event_id, topic, message_key,"
                    " payload) VALUES (:e, :t, :k, CAST(:p AS jsonb))"
                ),
                {
                    "e": event_id,
                    "t": topic,
                    "k": keys[n % len(keys)],
                    "p": json.dumps({"eventId": event_id, "n": n}),
                },
            )
    with PgBouncer(database_url, pool_size=2) as bouncer:
        settings = Settings(
            database_url=bouncer.url,
            kafka_bootstrap_servers=kafka_broker,
            conference_ended_topic=topic,
            kafka_timeout=timedelta(seconds=4),
            relay_batch_size=50,  # eight batches: the pipeline holds two at once
        )
        through_bouncer = engine_of(settings)  # the relay's own engine
        slot = ProducerSlot(settings)
        try:
            started = time.monotonic()
            result = Relay(settings, engine=through_bouncer, producers=slot).run()
            took = time.monotonic() - started
        finally:
            slot.close(timeout=2)
            through_bouncer.dispose()
        log = bouncer.output()
    assert (result.published, result.failed, result.pending) == (400, 0, 0)
    assert took < 30, f"the pass took {took:.1f}s: it waited for a server connection"
    records = read_topic(kafka_broker, topic, expect=400)
    assert len({r.event_id for r in records}) == 400
    for key in keys:  # in order per key, as through a direct connection
        ns = [r.value["n"] for r in sorted(records, key=lambda r: r.offset) if r.key == key]
        assert ns == sorted(ns)
    assert "query_wait_timeout" not in log


def test_cli_verbs_through_pgbouncer(pgbouncer, engine):
    as_of = f.db_now(engine)
    with engine.begin() as conn:
        room = f.conference(conn, as_of=as_of, idle=timedelta(minutes=5))
        parked_id = str(uuid.uuid4())
        conn.execute(
            text(
                "INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload,"
                " parked_at, last_error) VALUES (:e, 't', 'deal-1', '{}', now(), 'too large')"
            ),
            {"e": parked_id},
        )
    env = through(pgbouncer, REAPER_OPERATOR="bouncer-test")

    def cli(*args: str) -> str:
        done = run_cli(*args, env=env)
        assert done.returncode == 0, f"reaper {' '.join(args)}: {done.stderr[-2000:]}"
        return done.stdout

    status = json.loads(cli("status", "--json"))
    assert status["phases"]["empty_room"]["eligible"] == 1
    assert status["outbox"]["parked"] == 1
    planned = json.loads(cli("plan", "--json"))
    assert [c["conference_id"] for c in planned["phases"]["empty_room"]["conferences"]] == [
        room["id"]
    ]

    cli("pause", "--phase", "empty_room", "--reason", "behind pgbouncer")
    paused = json.loads(cli("status", "--json"))["paused"]
    assert [(p["phase"], p["reason"], p["by"]) for p in paused] == [
        ("empty_room", "behind pgbouncer", "bouncer-test")
    ]
    cli("resume")
    assert json.loads(cli("status", "--json"))["paused"] == []

    tenant = str(uuid.uuid4())
    cli("policy", "set", "--tenant", tenant, "--empty-room-grace", "600")
    [policy] = json.loads(cli("policy", "list", "--json"))
    assert (policy["tenant_id"], policy["empty_room_grace_seconds"]) == (tenant, 600)
    cli("policy", "unset", "--tenant", tenant)
    assert json.loads(cli("policy", "list", "--json")) == []

    [parked] = json.loads(cli("outbox", "parked", "--json"))
    assert (parked["event_id"], parked["error"]) == (parked_id, "too large")
    assert statuses(engine)[room["id"]] == ("Active", None)  # read-only verbs changed nothing


# -- nothing leaks to another client ------------------------------------------


@pytest.mark.process
def test_no_budget_reaches_another_client_of_the_same_pgbouncer(database_url, engine):
    """While a drain of thousands of rooms runs through PgBouncer on four lanes,
    another client of the same PgBouncer sees the server's defaults on every
    server connection it is given, and so does every server connection after."""
    rooms = 4000
    with engine.begin() as conn:
        f.bulk_conferences(conn, rooms, as_of=f.db_now(engine), idle=timedelta(minutes=5))
    server_defaults = defaults(database_url)
    with PgBouncer(database_url, pool_size=8) as bouncer:
        watcher = Watcher(bouncer)
        watcher.start()
        try:
            wait_until(lambda: watcher.seen, 10, "the watcher's first read")
            done = run_cli(
                "reap",
                "--once",
                "--json",
                env=through(
                    bouncer,
                    REAPER_BATCH_SIZE="20",
                    REAPER_DRAIN_LANES="4",
                    REAPER_MAX_RUN_DURATION="90",
                    REAPER_LOCK_TTL="180",
                ),
            )
        finally:
            watcher.stop()
        after = every_server_connection(bouncer)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["empty_timeout_count"] == rooms
    assert len(watcher.seen) >= 100, "the watcher read too seldom to tell"
    leaked = [(pid, values) for pid, values in watcher.seen if values != server_defaults]
    assert leaked == [], (
        f"{len(leaked)} of {len(watcher.seen)} reads saw a budget; first {leaked[0]}, "
        f"defaults {server_defaults} ({', '.join(BUDGET_SETTINGS)})"
    )
    assert len(after) >= 2  # the lock session's and the lanes' server connections at least
    assert {pid: v for pid, v in after.items() if v != server_defaults} == {}


# -- the smallest pool ------------------------------------------------------------


def drain_through(
    bouncer: PgBouncer | None, database_url: str, engine: Engine, rooms: int, lanes: int
) -> float:
    """Seconds a ``reaper reap --once`` took to close ``rooms`` eligible rooms (the
    cycle's own duration_ms), directly or through ``bouncer``."""
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE messenger.conference_sessions, messenger.reaper_runs CASCADE"))
        f.bulk_conferences(conn, rooms, as_of=f.db_now(engine), idle=timedelta(minutes=5))
    env = {
        "REAPER_DATABASE_URL": bouncer.url if bouncer else database_url,
        "REAPER_BATCH_SIZE": "20",
        "REAPER_DRAIN_LANES": str(lanes),
        "REAPER_MAX_RUN_DURATION": "90",
        "REAPER_LOCK_TTL": "180",
    }
    done = run_cli("reap", "--once", "--json", env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["empty_timeout_count"] == rooms
    assert output_events(done.stderr, "lock.lost") == []
    return result["duration_ms"] / 1000


@pytest.mark.process
def test_a_phase_drains_through_pools_of_two_three_and_one_per_lane(database_url, engine):
    """The phase's lock session holds one server connection; its lanes share the
    rest between their transactions: two are enough to drain, without waiting
    for any timeout. The rates against a direct connection are printed."""
    rooms, lanes = 3000, 4
    took = {"direct": drain_through(None, database_url, engine, rooms, lanes)}
    for pool in (2, 3, 1 + lanes):
        with PgBouncer(database_url, pool_size=pool) as bouncer:
            took[f"pool {pool}"] = drain_through(bouncer, database_url, engine, rooms, lanes)
    figure(
        f"drain of {rooms} rooms, batch 20, {lanes} lanes, rooms/s: "
        + ", ".join(f"{name} {rooms / s:.0f} ({s:.2f} s)" for name, s in took.items())
    )
    # No run waited for a timeout (REAPER_RUN_LEASE, PgBouncer's query_wait_timeout).
    assert max(took.values()) < 30, took


@pytest.mark.process
def test_a_pool_too_small_for_a_phase_is_said_at_once(database_url, engine):
    """A phase holds its lock session and needs at least one more server
    connection for its batches: with ``default_pool_size = 1`` it can never run.
    ``reaper reap --once`` says so in one line naming the pool, within seconds
    (not after the lock session's lease), and closes nothing without the lock.

    Expected with the run-ownership rework (issue 15, item 4); before it the run
    waited out REAPER_RUN_LEASE in each phase and closed every room without the
    lock (31 s for 2,000 rooms, lock.lost three times, counts 0)."""
    rooms = 2000
    with engine.begin() as conn:
        f.bulk_conferences(conn, rooms, as_of=f.db_now(engine), idle=timedelta(minutes=5))
    with PgBouncer(database_url, pool_size=1) as bouncer:
        started = time.monotonic()
        done = run_cli("reap", "--once", "--json", env=through(bouncer), timeout=600)
        took = time.monotonic() - started
    said = [
        line
        for line in [
            *(e.get("error", "") for e in output_events(done.stderr, "phase.failed")),
            *(ln for ln in done.stderr.splitlines() if not ln.startswith("{")),
        ]
        if "pool" in line.lower() or "connections" in line.lower()
    ]
    figure(f"reap --once with default_pool_size = 1, {rooms} rooms: {took:.1f} s")
    assert took < 30, f"took {took:.1f}s"
    assert said, f"no line names the pool:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr
    assert done.returncode == 1
    assert set(statuses(engine).values()) == {("Active", None)}  # nothing closed
    counted = tally(engine)
    assert (counted.integration, counted.realtime) == (0, 0)
    assert output_events(done.stderr, "conference.reaped") == []
