"""Every pass taken over in seconds (docs/reliability.md): the outbox relay and the
stop-signal pass hold their locks as the phases do (reaper/lease.py).

A pass is hit mid-way: frozen (SIGSTOP), or its lock connection silently cut
(iptables, tests/support/netfault.py). A real ``celery -A reaper worker -B``
must go on with the work within one polling interval plus 15 s, with the
default REAPER_RUN_LEASE; the pass that was hit must commit nothing after the
successor took its lock, even once woken.

The observable: the hit pass reaches the database through a proxy, so every
commit it makes carries one of the proxy's ports (``inet_client_port()``). A
deferred trigger (fired at the commit) writes each commit that marks an outbox
row published, or changes a recording's stop state, with that port and the
commit's time. A commit by the hit pass after the successor took the lock is
the failure. Every event must be on Kafka, in order per deal (a resend is
allowed: consumers dedupe by eventId).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine, make_url, text

from tests.support.facts import output_events
from tests.support.figures import figure
from tests.support.kafka import create_topic, read_topic
from tests.support.netfault import Proxy, SilentServer
from tests.support.pgbouncer import PgBouncer
from tests.support.processes import REAPER, ROOT, Worker, wait_until

pytestmark = pytest.mark.process

# The defaults: REAPER_POLLING_INTERVAL 30 s, REAPER_RUN_LEASE 10 s. The issue's
# bound: a pass hit mid-way is replaced within one polling interval plus 15 s.
BOUND = 30 + 15
# How long a test waits for the successor at all: the "before" figures (90 s
# and more, docs/reliability.md) were measured with these tests.
PATIENCE = 150
BACKLOG = 20_000
DEALS = 200
RELAY_LOCK = "messenger.conference-room-reaper.relay"
STOP_LOCK = "messenger.conference-room-reaper.recorder"

COMMITS = """
CREATE TABLE messenger.test_commits (tbl text, id text, port integer, at timestamptz);
CREATE FUNCTION messenger.test_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO messenger.test_commits
        VALUES (TG_TABLE_NAME, OLD.id::text, inet_client_port(), clock_timestamp());
    ELSE
        INSERT INTO messenger.test_commits
        VALUES (TG_TABLE_NAME, NEW.id::text, inet_client_port(), clock_timestamp());
    END IF;
    RETURN NULL;
END $$;
-- a pending row deleted: the relay's mark of a row Kafka acknowledged
CREATE CONSTRAINT TRIGGER test_commit AFTER DELETE ON messenger.integration_outbox
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (OLD.published_at IS NULL)
    EXECUTE FUNCTION messenger.test_commit();
CREATE CONSTRAINT TRIGGER test_commit AFTER UPDATE ON messenger.call_recordings
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    EXECUTE FUNCTION messenger.test_commit();
"""
NO_COMMITS = """
DROP TRIGGER IF EXISTS test_commit ON messenger.integration_outbox;
DROP TRIGGER IF EXISTS test_commit ON messenger.call_recordings;
DROP FUNCTION IF EXISTS messenger.test_commit();
DROP TABLE IF EXISTS messenger.test_commits;
"""


@pytest.fixture
def commits(engine: Engine) -> Iterator[Engine]:
    """The commits' record (above), removed whatever the test did."""
    with engine.begin() as conn:
        conn.execute(text(NO_COMMITS))
        conn.execute(text(COMMITS))
    try:
        yield engine
    finally:
        with engine.begin() as conn:
            conn.execute(text(NO_COMMITS))


def seed_outbox(engine: Engine, topic: str, count: int = BACKLOG) -> None:
    """``count`` events of DEALS deals, set-based; ``n`` is each event's place."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload)"
                " SELECT e.id, :topic, 'deal-' || (e.n % :deals),"
                "        jsonb_build_object('eventId', e.id, 'eventType', 'test',"
                "                           'correlationId', 'takeover', 'n', e.n)"
                " FROM (SELECT gen_random_uuid() AS id, n"
                "       FROM generate_series(0, :count - 1) AS n) e ORDER BY e.n"
            ),
            {"topic": topic, "deals": DEALS, "count": count},
        )


def seed_due_stops(engine: Engine, count: int) -> None:
    """``count`` rooms the reaper just ended, each with a recording still running."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messenger.conference_sessions (id, chat_id, deal_id, tenant_id,"
                " media_type, status, end_reason, started_by_user_id, created_at, started_at,"
                " ended_at, last_activity_at, updated_at, active_participant_count,"
                " peak_participant_count)"
                " SELECT gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),"
                "        gen_random_uuid(), 'Video', 'Ended', 'EmptyTimeout', gen_random_uuid(),"
                "        now() - interval '10 min', now() - interval '9 min',"
                "        now() - make_interval(secs => n * 0.001), now() - interval '5 min',"
                "        now(), 0, 1"
                " FROM generate_series(1, :count) AS n"
            ),
            {"count": count},
        )
        conn.execute(
            text(
                "INSERT INTO messenger.call_recordings (id, conference_id, status)"
                " SELECT gen_random_uuid(), id, 'Recording' FROM messenger.conference_sessions"
            )
        )


def db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        return conn.execute(text("SELECT clock_timestamp()")).scalar_one()


def holder(engine: Engine, lock: str) -> int | None:
    """The backend pid holding the pass lock ``lock``, or None."""
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT l.pid FROM pg_locks l"
                " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
                "   AND l.classid::bigint = ((hashtextextended(:k, 0) >> 32) & 4294967295)"
                "   AND l.objid::bigint = (hashtextextended(:k, 0) & 4294967295)"
                "   AND l.database = (SELECT oid FROM pg_database"
                "                     WHERE datname = current_database())"
            ),
            {"k": lock},
        ).scalar()


def client_port(engine: Engine, pid: int) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT client_port FROM pg_stat_activity WHERE pid = :p"), {"p": pid}
        ).scalar_one()


def commits_of(
    engine: Engine, table: str, ports: set[int], *, mine: bool, after: datetime | None = None
) -> list[datetime]:
    """Commit times (the database's clock) of rows of ``table`` committed through
    ``ports`` (``mine``) or through any other port, after ``after``."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT at, port FROM messenger.test_commits"
                " WHERE tbl = :t AND (CAST(:after AS timestamptz) IS NULL OR at > :after)"
                " ORDER BY at"
            ),
            {"t": table, "after": after},
        ).all()
    return [at for at, port in rows if (port in ports) == mine]


def unpublished(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT count(*) FROM messenger.integration_outbox WHERE published_at IS NULL")
        ).scalar_one()


@dataclass
class Pass:
    """A pass in a process of its own (its group, its log), through ``proxy``."""

    proc: subprocess.Popen[bytes]
    log: Path

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def start_pass(args: list[str], env: dict[str, str], log: Path) -> Pass:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Pass(proc, log)


def through(database_url: str, port: int) -> str:
    return make_url(database_url).set(host="127.0.0.1", port=port).render_as_string(False)


def kafka_env(kafka_broker: str, topic: str) -> dict[str, str]:
    return {"REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker, "REAPER_CONFERENCE_ENDED_TOPIC": topic}


def in_order_per_deal(records: list) -> bool:
    """Per deal, the first time each event is seen follows the events' order (a
    resent event may come again later: consumers dedupe by eventId)."""
    seen: dict[str, list[int]] = {}
    firsts: set[str] = set()
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        if r.event_id not in firsts:
            firsts.add(r.event_id)
            seen.setdefault(r.key, []).append(r.value["n"])
    return all(ns == sorted(ns) for ns in seen.values())


@dataclass
class Takeover:
    took_s: float  # from the fault to the successor's first commit
    lock_taken_s: float  # from the fault to the successor holding the lock
    late: int  # commits by the hit pass after the successor took the lock


def successor_goes_on(
    engine: Engine, lock: str, table: str, old_ports: set[int], hit_pid: int, hit_at: datetime
) -> tuple[datetime, datetime]:
    """When (the database's clock) another session took ``lock`` after the hit,
    and when it first committed."""
    taken: list[datetime] = []

    def went_on() -> datetime | None:
        if not taken:
            pid = holder(engine, lock)
            if pid is not None and pid != hit_pid:
                taken.append(db_now(engine))
        theirs = commits_of(engine, table, old_ports, mine=False, after=hit_at)
        return theirs[0] if theirs and taken else None

    first = wait_until(went_on, PATIENCE, "another pass goes on", 0.2)
    return taken[0], first


def relay_hit_mid_pass(
    engine: Engine, kafka_broker: str, tmp_path: Path, database_url: str, fault: str
) -> tuple[Takeover, Pass]:
    """``reaper relay --once`` through a proxy, hit by ``fault`` mid-pass; a worker
    started at the fault takes over. Returns the figures and the hit pass."""
    topic = f"takeover.{fault}.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    seed_outbox(engine, topic)
    with engine.connect() as conn:  # the relay deletes each row at its acknowledgement
        ids = set(
            conn.execute(text("SELECT event_id::text FROM messenger.integration_outbox"))
            .scalars()
            .all()
        )
    proxy = Proxy("127.0.0.1", make_url(database_url).port or 5432, name=f"relay-{fault}")
    proxy.start()
    hit = None
    successor = Worker(
        tmp_path,
        {**kafka_env(kafka_broker, topic), "REAPER_BROKER_KEY_PREFIX": f"{uuid.uuid4().hex}:"},
        name="successor",
    )
    try:
        hit = start_pass(
            [REAPER, "relay", "--once", "--json"],
            {
                **kafka_env(kafka_broker, topic),
                "REAPER_DATABASE_URL": through(database_url, proxy.port),
                # many small batches: the pass is still on when it is hit, and (cut)
                # still on for the lease its lock session outlives the cut by
                "REAPER_RELAY_BATCH_SIZE": "20" if fault == "sigstop" else "4",
            },
            tmp_path / "hit-relay.log",
        )
        wait_until(
            lambda: (
                len(commits_of(engine, "integration_outbox", proxy.service_ports, mine=True)) >= 500
            ),
            60,
            "the relay's pass under way",
            0.05,
        )
        hit_pid = holder(engine, RELAY_LOCK)
        assert hit_pid is not None and unpublished(engine) > BACKLOG // 2, "seed more"
        if fault == "sigstop":
            hit.signal(signal.SIGSTOP)
        else:
            assert proxy.cut({client_port(engine, hit_pid)}) == 1
        hit_at = db_now(engine)
        started = time.monotonic()
        successor.start()
        try:
            taken_at, first = successor_goes_on(
                engine, RELAY_LOCK, "integration_outbox", proxy.service_ports, hit_pid, hit_at
            )
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; {unpublished(engine)} left; the hit pass:\n{hit.output()[-3000:]}"
            ) from None
        hit.signal(signal.SIGCONT)
        hit.proc.wait(timeout=90)
        wait_until(lambda: unpublished(engine) == 0, 90, "every event published", 0.5)
        successor.stop()
        late = commits_of(
            engine, "integration_outbox", proxy.service_ports, mine=True, after=taken_at
        )
        records = read_topic(kafka_broker, topic, expect=BACKLOG, timeout=60)
        with engine.connect() as conn:
            left = conn.execute(text("SELECT count(*) FROM messenger.integration_outbox"))
            assert left.scalar_one() == 0, "every row gone at its acknowledgement"
        assert len(ids) == BACKLOG
        assert {r.event_id for r in records} == ids, "every event on Kafka"
        assert in_order_per_deal(records)
        print(f"[waited {time.monotonic() - started:.1f}s in all]")
        return (
            Takeover(
                took_s=(first - hit_at).total_seconds(),
                lock_taken_s=(taken_at - hit_at).total_seconds(),
                late=len(late),
            ),
            hit,
        )
    finally:
        if hit is not None:
            hit.stop()
        successor.stop()
        proxy.close()


def test_a_frozen_relay_is_replaced_in_seconds_and_woken_commits_nothing(
    commits, kafka_broker, tmp_path, database_url
):
    """SIGSTOP of `reaper relay --once` mid-pass on a backlog: a worker's relay
    goes on within the bound; SIGCONT: the woken pass marks nothing."""
    takeover, hit = relay_hit_mid_pass(commits, kafka_broker, tmp_path, database_url, "sigstop")
    figure(
        f"SIGSTOP of a relay pass mid-backlog ({BACKLOG} events): another "
        f"worker's relay took the lock {takeover.lock_taken_s:.1f}s and published "
        f"{takeover.took_s:.1f}s after the freeze; the woken pass committed "
        f"{takeover.late} marks after that (bound {BOUND}s)"
    )
    assert takeover.took_s <= BOUND, takeover
    assert takeover.late == 0, takeover
    assert output_events(hit.output(), "relay.lock_lost"), hit.output()[-3000:]
    assert hit.proc.returncode == 1


def test_a_relay_whose_lock_connection_is_cut_is_replaced_and_marks_nothing_after(
    commits, kafka_broker, tmp_path, database_url
):
    """iptables drops every packet of the relay's lock connection mid-pass (its
    batches' connections still pass): the server ends the silent lock session, the
    pass's claims and marks are fenced off, a worker's relay goes on."""
    takeover, hit = relay_hit_mid_pass(commits, kafka_broker, tmp_path, database_url, "cut")
    figure(
        f"the relay's lock connection cut mid-backlog ({BACKLOG} events): "
        f"another worker's relay took the lock {takeover.lock_taken_s:.1f}s and published "
        f"{takeover.took_s:.1f}s after the cut; the cut pass committed "
        f"{takeover.late} marks after that (bound {BOUND}s)"
    )
    assert takeover.took_s <= BOUND, takeover
    assert takeover.late == 0, takeover
    assert output_events(hit.output(), "relay.lock_lost"), hit.output()[-3000:]


STOP_PASS = """
import json
from reaper import logs, wiring
from reaper.config import get_settings
from reaper.recorder import StopPass

logs.configure()  # JSON lines, as the worker and the CLI log
settings = get_settings()
wiring.install(settings)
print(json.dumps(StopPass(settings).run().to_json()), flush=True)
"""


def test_a_frozen_stop_pass_is_replaced_in_seconds_and_woken_changes_nothing(
    commits, tmp_path, database_url
):
    """A stop pass (the code reaper.stop_recordings runs) frozen while its calls
    wait on a recorder that never answers: a worker's stop pass goes on within the
    bound; SIGCONT: the woken pass marks nothing."""
    engine = commits
    seed_due_stops(engine, 1000)
    proxy = Proxy("127.0.0.1", make_url(database_url).port or 5432, name="stop-sigstop")
    proxy.start()
    silent = SilentServer().start()
    recorder = {"REAPER_RECORDER_URL": f"http://127.0.0.1:{silent.port}"}
    successor = Worker(
        tmp_path, {**recorder, "REAPER_BROKER_KEY_PREFIX": f"{uuid.uuid4().hex}:"}, name="stops"
    )
    hit = None
    try:
        hit = start_pass(
            [sys.executable, "-c", STOP_PASS],
            {**recorder, "REAPER_DATABASE_URL": through(database_url, proxy.port)},
            tmp_path / "hit-stop.log",
        )
        wait_until(
            lambda: (
                commits_of(engine, "call_recordings", proxy.service_ports, mine=True)
                and silent.accepted >= 10
            ),
            30,
            "the stop pass's calls under way",
            0.05,
        )
        hit_pid = holder(engine, STOP_LOCK)
        assert hit_pid is not None
        hit.signal(signal.SIGSTOP)
        hit_at = db_now(engine)
        successor.start()
        taken_at, first = successor_goes_on(
            engine, STOP_LOCK, "call_recordings", proxy.service_ports, hit_pid, hit_at
        )
        hit.signal(signal.SIGCONT)
        hit.proc.wait(timeout=60)
        time.sleep(2)  # anything the woken pass still commits
        successor.stop()
        late = commits_of(engine, "call_recordings", proxy.service_ports, mine=True, after=taken_at)
        output = hit.output()
    finally:
        if hit is not None:
            hit.stop()
        successor.stop()
        silent.close()
        proxy.close()
    took = (first - hit_at).total_seconds()
    lock_taken = (taken_at - hit_at).total_seconds()
    figure(
        f"SIGSTOP of a stop pass mid-calls: another worker's stop pass took "
        f"the lock {lock_taken:.1f}s and claimed {took:.1f}s after the freeze; the woken "
        f"pass committed {len(late)} changes after that (bound {BOUND}s)"
    )
    assert took <= BOUND, took
    assert late == [], late
    assert output_events(output, "recorder.lock_lost"), output[-3000:]


def test_behind_pgbouncer_with_a_pool_of_one_the_relay_never_goes_on_without_its_lock(
    engine, kafka_broker, database_url, tmp_path
):
    """PgBouncer in transaction mode with one server connection: the relay's lock
    session holds it, so its first claim waits. Its lock session is ended then
    (pg_terminate_backend, as the server's idle bound or a failover would): the
    claim gets the server connection, and must find the lock gone and claim
    nothing; the pass says it lost its lock."""
    topic = f"takeover.bouncer.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    seed_outbox(engine, topic, 2000)
    with PgBouncer(database_url, pool_size=1) as bouncer:
        started = time.monotonic()
        hit = start_pass(
            [REAPER, "relay", "--once", "--json"],
            {**kafka_env(kafka_broker, topic), "REAPER_DATABASE_URL": bouncer.url},
            tmp_path / "bouncer-relay.log",
        )
        try:
            pid = wait_until(lambda: holder(engine, RELAY_LOCK), 30, "the relay lock held", 0.02)
            # Ended once the first claim waits for the server connection, not while
            # the pass still sets its lock up (then the pass fails on its lock
            # session's own statement, a database error, not a lost lock: seen
            # once under load).
            wait_until(lambda: bouncer.waiting_clients() >= 1, 30, "the first claim waiting", 0.02)
            with engine.connect() as conn:
                conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            hit.proc.wait(timeout=60)
        finally:
            hit.stop()
        took = time.monotonic() - started
    output = hit.output()
    figure(f"relay --once behind a pool of 1, lock session ended: {took:.1f}s")
    assert unpublished(engine) == 2000, "published without the lock"
    assert read_topic(kafka_broker, topic, timeout=3) == []
    assert hit.proc.returncode == 1, output[-3000:]
    assert output_events(output, "relay.lock_lost"), output[-3000:]
    assert took < 30, took
