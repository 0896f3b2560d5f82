"""Security: only JSON crosses the broker; the worker runs as a least-privilege
role; nothing but ids, enums and times leaves a cycle (no names, emails,
tokens, passwords); PostgreSQL TLS settings in REAPER_DATABASE_URL reach
psycopg2."""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Producer
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.exc import DBAPIError, OperationalError

from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.errors import sqlstate
from tests.support import factory as f
from tests.support.figures import figure
from tests.support.kafka import create_topic, read_topic
from tests.support.processes import ROOT, Worker
from tests.support.services import PrivatePostgres

BIN = Path(sys.executable).parent
ROLE = "reaper_worker"


def now() -> datetime:
    return datetime.now(UTC)


# -- only JSON crosses the broker ---------------------------------------------


class Canary:
    """Unpickling this runs code: it would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.process
def test_pickled_message_is_refused_and_the_worker_goes_on(engine, tmp_path):
    marker = tmp_path / "unpickled"
    worker = Worker(tmp_path, {"REAPER_POLLING_INTERVAL": "1"}, name="pickle").start()
    try:
        worker.wait_for(lambda out: '"cycle.completed"' in out, 20, "a first cycle")
        settings = Settings()
        options = {"global_keyprefix": settings.broker_key_prefix}
        with Connection(settings.broker_url, transport_options=options) as conn:
            producer = Producer(conn)
            task_id = str(uuid.uuid4())
            producer.publish(
                ((Canary(marker),), {}, {"callbacks": None, "errbacks": None, "chain": None}),
                exchange=Exchange("reaper", type="direct"),
                routing_key="reaper",
                serializer="pickle",
                headers={"lang": "py", "task": "reaper.reap", "id": task_id, "root_id": task_id},
                declare=[],
            )
        worker.wait_for(
            lambda out: "application/x-python-serialize" in out and "Refusing" in out,
            20,
            "the refusal",
        )
        refused_at = len(worker.output())
        with engine.begin() as conn:
            room = f.conference(conn, as_of=now(), idle=timedelta(minutes=5))
        worker.wait_for(
            lambda out: '"cycle.completed"' in out[refused_at:] and room["id"] in out[refused_at:],
            20,
            "a cycle after the refusal that reaps a new room",
        )
        assert worker.proc is not None and worker.proc.poll() is None
    finally:
        worker.stop()
    assert not marker.exists(), "the pickled payload was deserialised"
    assert task_id not in worker.output().split("Refusing", 1)[0]  # never ran


# -- the least-privilege role ---------------------------------------------------

TABLES = (
    "conference_sessions",
    "conference_participants",
    "call_recordings",
    "integration_outbox",
    "realtime_outbox",
    "reaper_runs",
    "reaper_pauses",
    "reaper_tenant_windows",
    "reaper_migrations",
    "outbox_discards",
    "outbox_republishes",
)
EXPECTED_TABLE_PRIVILEGES = {
    "conference_sessions": {"SELECT"},
    "conference_participants": {"SELECT"},
    "call_recordings": {"SELECT"},
    # retention deletes through messenger.delete_published_outbox (migration 0009;
    # the DELETE is taken by the contract migration 0011)
    "integration_outbox": {"SELECT", "INSERT"},
    "realtime_outbox": {"SELECT", "INSERT"},
    "reaper_runs": {"SELECT", "INSERT", "DELETE"},
    # the operator's controls: read, never written (migration 0011)
    "reaper_pauses": {"SELECT"},
    "reaper_tenant_windows": {"SELECT"},
    # the schema's record, read by the check at start (migration 0010)
    "reaper_migrations": {"SELECT"},
    # read for messenger_outbox_discarded; only an operator discards (migration 0013)
    "outbox_discards": {"SELECT"},
    # read by the ledger (reaper reconcile); only an operator republishes (migration 0014)
    "outbox_republishes": {"SELECT"},
}
EXPECTED_UPDATE_COLUMNS = {
    "conference_sessions": {
        "status",
        "end_reason",
        "ended_at",
        "updated_at",
        "duration_seconds",
        "active_participant_count",
    },
    "conference_participants": {"left_at"},
    "call_recordings": {"stop_requested_at", "stop_attempts", "stop_next_attempt_at"},
    "integration_outbox": {
        "published_at",
        "attempts",
        "last_error",
        "next_attempt_at",
        "parked_at",
    },
    "realtime_outbox": set(),
    "reaper_runs": {
        "lease_expires_at",
        "phase",
        "counts",
        "excluded",
        "blocked",
        "paused",
        "errors",
        "finished_at",
        "outcome",
        "unknown_phases",
    },
    "reaper_pauses": set(),
    "reaper_tenant_windows": set(),
    "reaper_migrations": set(),
    "outbox_discards": set(),
    "outbox_republishes": set(),
}


def test_worker_role_has_exactly_what_it_needs(engine):
    with engine.connect() as conn:
        role = conn.execute(
            text(
                "SELECT rolcanlogin, rolsuper, rolcreaterole, rolcreatedb FROM pg_roles"
                " WHERE rolname = :r"
            ),
            {"r": ROLE},
        ).one()
        assert tuple(role) == (False, False, False, False)
        for table in TABLES:
            granted = {
                p
                for p in (
                    "SELECT",
                    "INSERT",
                    "UPDATE",
                    "DELETE",
                    "TRUNCATE",
                    "REFERENCES",
                    "TRIGGER",
                )
                if conn.execute(
                    text("SELECT has_table_privilege(:r, :t, :p)"),
                    {"r": ROLE, "t": f"messenger.{table}", "p": p},
                ).scalar()
            }
            assert granted == EXPECTED_TABLE_PRIVILEGES[table], table
            columns = set(
                conn.execute(
                    text(
                        "SELECT column_name FROM information_schema.column_privileges"
                        " WHERE grantee = :r AND table_schema = 'messenger'"
                        " AND table_name = :t AND privilege_type = 'UPDATE'"
                    ),
                    {"r": ROLE, "t": table},
                ).scalars()
            )
            assert columns == EXPECTED_UPDATE_COLUMNS[table], table
        # the revision, read by the check at start (migration 0010), and nothing else of it
        assert {
            p
            for p in ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE")
            if conn.execute(
                text("SELECT has_table_privilege(:r, 'public.alembic_version', :p)"),
                {"r": ROLE, "p": p},
            ).scalar()
        } == {"SELECT"}
        checks = {
            "CREATE on schema messenger": "SELECT has_schema_privilege(:r, 'messenger', 'CREATE')",
            "CREATE on schema public": "SELECT has_schema_privilege(:r, 'public', 'CREATE')",
            "CREATE on the database": (
                "SELECT has_database_privilege(:r, current_database(), 'CREATE')"
            ),
        }
        for what, sql in checks.items():
            assert conn.execute(text(sql), {"r": ROLE}).scalar() is False, what


@pytest.fixture
def login_url(database_url: str, engine: Engine) -> Iterator[str]:
    """A LOGIN role that is a member of reaper_worker, with a password in its URL."""
    name = f"reaper_login_{uuid.uuid4().hex[:8]}"
    password = f"pw-{uuid.uuid4().hex}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {name} LOGIN PASSWORD '{password}' IN ROLE {ROLE}")
    url = make_url(database_url).set(username=name, password=password)
    yield url.render_as_string(hide_password=False)
    with engine.begin() as conn:
        conn.execute(
            text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :n"),
            {"n": name},
        )
        conn.exec_driver_sql(f"DROP ROLE {name}")


def seed_everything(engine: Engine, as_of: datetime) -> dict[str, Any]:
    with engine.begin() as conn:
        empty = f.conference(conn, as_of=as_of, idle=timedelta(minutes=5))
        f.participant(
            conn,
            empty["id"],
            joined_at=as_of - timedelta(minutes=20),
            left_at=as_of - timedelta(minutes=5),
        )
        recorded = f.conference(conn, as_of=as_of, idle=timedelta(minutes=5))
        f.recording(conn, recorded["id"], status="Recording", created_at=as_of)
        stale = f.conference(
            conn, as_of=as_of, idle=timedelta(hours=5), participants=1, age=timedelta(hours=6)
        )
        f.participant(conn, stale["id"], joined_at=as_of - timedelta(hours=6))
        provisioning = f.conference(
            conn, status="Provisioning", as_of=as_of, age=timedelta(minutes=10)
        )
    return {"ended": [empty, recorded, stale], "failed": [provisioning]}


def test_a_cycle_and_a_relay_pass_run_as_a_member_of_the_role(engine, login_url, kafka_broker):
    from reaper.relay import Relay

    rooms = seed_everything(engine, f.T0)
    topic = f"role.conference-ended.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    settings = Settings(
        database_url=login_url, kafka_bootstrap_servers=kafka_broker, conference_ended_topic=topic
    )
    worker_engine = create_engine(login_url)
    try:
        result = Reaper(settings, engine=worker_engine).run_cycle(f.T0)
        assert result["empty_timeout_count"] == 2 and result["stale_timeout_count"] == 1
        assert result["provision_failed_count"] == 1 and result["failed_count"] == 0
        with engine.begin() as conn:  # as the owner: topic of the rows to this test's topic
            conn.execute(text("UPDATE messenger.integration_outbox SET topic = :t"), {"t": topic})
        relay = Relay(settings, engine=worker_engine).run()
        assert relay.published == 3, relay
        assert len(read_topic(kafka_broker, topic, expect=3)) == 3

        denied = [
            "CREATE TABLE messenger.x (id int)",
            "CREATE TABLE public.x (id int)",
            "CREATE SCHEMA x",
            "DROP TABLE messenger.realtime_outbox",
            "ALTER TABLE messenger.conference_sessions ADD COLUMN x int",
            "CREATE INDEX ON messenger.conference_sessions (chat_id)",
            "TRUNCATE messenger.integration_outbox",
            "DELETE FROM messenger.conference_sessions",
            "DELETE FROM messenger.integration_outbox",
            "DELETE FROM messenger.reaper_pauses",
            "INSERT INTO messenger.reaper_tenant_windows (tenant_id, phase, window_length,"
            " updated_at, updated_by) VALUES (gen_random_uuid(), 'stale_live', '1 ms', now(), 'x')",
            "UPDATE messenger.conference_sessions SET chat_id = gen_random_uuid()",
            "UPDATE messenger.integration_outbox SET payload = '{}'",
            "INSERT INTO messenger.conference_sessions (id) VALUES (gen_random_uuid())",
            "CREATE FUNCTION messenger.f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        ]
        for statement in denied:
            with (
                worker_engine.begin() as conn,
                pytest.raises(DBAPIError, match=r"denied|owner") as refused,
            ):
                conn.exec_driver_sql(statement)
            # 42501 insufficient_privilege
            assert sqlstate(refused.value) == "42501", (statement, refused.value)
    finally:
        worker_engine.dispose()
    with engine.connect() as conn:
        assert f.statuses(conn)[rooms["failed"][0]["id"]] == ("Failed", "Error")


# -- nothing but ids leaves a cycle; no secret in any output ----------------------

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
ENUMS = {
    "Audio",
    "Video",
    "Provisioning",
    "Active",
    "Ended",
    "Failed",
    "Normal",
    "EmptyTimeout",
    "Timeout",
    "Error",
    "ConferenceEnded",
    "ConferenceSignal",
    "ChatGroup",
    "Conference",
    "Pending",
    "Recording",
    "Uploading",
    "Available",
    "pin.messenger.conference-ended.v1",
    "empty_room",
    "provision_timeout",
    "stale_live",
    "empty_timeout",
    "provision_failed",
    "stale_timeout",
}
EMAIL = re.compile(r"[\w.+-]+@[\w-]+\.[\w.]+")
TOKEN = re.compile(r"(eyJ[\w-]{10,}\.[\w-]{10,})|(\b[A-Za-z0-9+/]{40,}={0,2})")


# W3C trace context: ids too (the cycle's trace and span)
TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def id_like(value: str) -> bool:
    return bool(UUID.match(value) or TIME.match(value) or TRACEPARENT.match(value)) or (
        value in ENUMS
    )


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def strict(document: Any, where: str, topic: str) -> list[str]:
    """Every string of an event or a payload must be an id, a time or an enum."""
    return [
        f"{where}{path}={value!r}"
        for path, value in leaves(document)
        if isinstance(value, str) and not (id_like(value) or value == topic)
    ]


class Recorder(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.send_response(500)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_a_full_cycle_writes_and_emits_only_ids_and_no_secrets(
    engine, login_url, kafka_broker, tmp_path
):
    password = make_url(login_url).password
    assert password
    topic = f"scan.conference-ended.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    recorder = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=recorder.serve_forever, daemon=True).start()
    env = {
        "REAPER_DATABASE_URL": login_url,
        "REAPER_POLLING_INTERVAL": "1",
        "REAPER_RELAY_INTERVAL": "1",
        "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker,
        "REAPER_CONFERENCE_ENDED_TOPIC": topic,
        "REAPER_RECORDER_URL": f"http://127.0.0.1:{recorder.server_port}",
    }
    rooms = seed_everything(engine, now())
    worker = Worker(tmp_path, env, name="scan").start()
    try:
        records = read_topic(kafka_broker, topic, expect=3, timeout=30)
        worker.wait_for(lambda out: '"relay.published"' in out, 20, "the relay pass")
    finally:
        worker.stop()
        recorder.shutdown()
    outputs = {"worker log": worker.output()}
    cli_env = {**os.environ, **env}
    for args in (["status", "--json"], ["plan", "--json"], ["reap", "--once", "--json"]):
        done = subprocess.run(
            [str(BIN / "reaper"), *args],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        outputs[f"reaper {' '.join(args)}"] = done.stdout + done.stderr
    # the database unreachable: the error lines name the server, never the password
    broken = {**cli_env, "REAPER_DATABASE_URL": login_url.replace("/reaper_test", "/nope")}
    for args in (["status"], ["reap", "--once"]):
        done = subprocess.run(
            [str(BIN / "reaper"), *args], env=broken, capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0
        outputs[f"reaper {' '.join(args)} (no database)"] = done.stdout + done.stderr

    problems: list[str] = []
    for where, out in outputs.items():
        if password in out:
            problems.append(f"{where}: the database password")
        problems += [f"{where}: e-mail {m!r}" for m in EMAIL.findall(out) if "@%h" not in m]
        problems += [f"{where}: token-like {m!r}" for m in TOKEN.findall(out)]

    events = [
        json.loads(line) for line in outputs["worker log"].splitlines() if line.startswith('{"ts"')
    ]
    assert {"conference.reaped", "relay.published", "recorder.stop_failed"} <= {
        e["event"] for e in events
    }
    for event in events:
        if event["event"] in ("conference.reaped", "item.failed", "batch.selected"):
            body = {k: v for k, v in event.items() if k not in ("ts", "level", "logger", "event")}
            problems += strict(body, event["event"], topic)

    with engine.connect() as conn:
        # every integration_outbox row was deleted at its Kafka acknowledgement:
        # its payload is the record's value, scanned below
        left = f.outbox(conn)
        realtime = [r["payload"] for r in f.realtime(conn)]
        errors = (
            conn.execute(
                text(
                    "SELECT last_error FROM messenger.integration_outbox"
                    " WHERE last_error IS NOT NULL"
                )
            )
            .scalars()
            .all()
        )
    assert left == []
    integration = [record.value for record in records]
    for i, payload in enumerate(integration):
        problems += strict(payload, f"integration_outbox[{i}]", topic)
    for i, payload in enumerate(realtime):
        problems += strict(payload, f"realtime_outbox[{i}]", topic)
    for record in records:
        problems += strict(record.value, "kafka value", topic)
        problems += strict(record.headers, "kafka headers", topic)
        assert UUID.match(record.key)
    problems += [f"last_error: {e!r}" for e in errors if password in e or EMAIL.search(e)]
    assert len(integration) == 3 and len(realtime) == 4 and len(records) == 3
    assert problems == []
    strings = sum(isinstance(v, str) for doc in [*integration, *realtime] for _, v in leaves(doc))
    figure(
        f"secret/PII scan of a full cycle: {len(events)} log events, "
        f"{len(outputs)} outputs (worker log, status, plan, reap --once, 2 failing runs), "
        f"{len(integration)}+{len(realtime)} outbox payloads ({strings} strings), "
        f"{len(records)} Kafka records: 0 non-id values, password never shown"
    )
    assert rooms  # seeded as above


# -- PostgreSQL TLS through REAPER_DATABASE_URL -----------------------------------


@pytest.fixture(scope="module")
def tls_pg() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres(tls=True).init()
    try:
        yield pg
    finally:
        pg.destroy()


@pytest.mark.process
def test_postgres_tls_parameters_reach_psycopg2(tls_pg, tmp_path):
    from reaper.db import engine_for, migrate

    ca = tls_pg.root / "ca.crt"
    verified = tls_pg.url(query=f"sslmode=verify-full&sslrootcert={ca}")
    Settings(database_url=verified)  # accepted by the validation
    migrate(verified)
    with engine_for(verified).connect() as conn:
        ssl = conn.execute(
            text("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        ).one()
    assert ssl.ssl is True and ssl.version.startswith("TLS")

    # the whole CLI cycle over TLS
    done = subprocess.run(
        [str(BIN / "reaper"), "reap", "--once", "--json"],
        env={**os.environ, "REAPER_DATABASE_URL": verified},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["skipped"] is False

    # verification really happens: another CA is refused, and so is a wrong host name
    other = tmp_path / "other-ca.crt"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=other",
            "-keyout",
            str(tmp_path / "k"),
            "-out",
            str(other),
        ],
        check=True,
        capture_output=True,
    )
    for query in (
        f"sslmode=verify-full&sslrootcert={other}",
        f"sslmode=verify-full&sslrootcert={ca}&host=127.0.0.2",
    ):
        engine = create_engine(tls_pg.url(query=query))
        with pytest.raises(OperationalError, match=r"certificate|server"):
            engine.connect().close()
        engine.dispose()
    # and sslmode=disable is honoured too (the server accepts both)
    with create_engine(tls_pg.url(query="sslmode=disable")).connect() as conn:
        assert (
            conn.execute(text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")).scalar()
            is False
        )


def test_sslmode_require_against_a_server_without_tls_fails_clearly(database_url):
    engine = create_engine(f"{database_url}?sslmode=require")
    with pytest.raises(OperationalError, match="SSL"):
        engine.connect().close()
    engine.dispose()
