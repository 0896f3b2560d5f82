"""docker-compose.yml's services, run here without Docker: each service's
command and environment exactly as written and interpolated from an env file
(tests/support/compose.py maps only the host names, the ports and the
container paths), against a private PostgreSQL bootstrapped as the postgres
image does (POSTGRES_USER a superuser with a password, POSTGRES_DB, password
authentication over TCP), Redis started from the file's own command, and a
private Kafka-compatible broker with the kafka-topics service's topic.

The migration, as the owner, creates both roles; the one-shot db-logins makes
the worker's login from its secret; the worker closes a room as that login and
its event reaches Kafka; Flower answers only with auth; Redis refuses a client
without the password. What stays unverified without Docker: README
"Deployment"."""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.exc import OperationalError

from reaper.release import SCHEMA_KNOWN
from tests.support import factory as f
from tests.support.compose import Local, load, variables
from tests.support.facts import output_events
from tests.support.kafka import Tansu, create_topic, read_topic
from tests.support.ports import free_port, wait_for_port
from tests.support.processes import ROOT, wait_until
from tests.support.services import PrivatePostgres

pytestmark = pytest.mark.process

BIN = Path(sys.executable).parent
WORKER_LOGIN = "reaper_worker_login"
# The first cycle comes one REAPER_POLLING_INTERVAL after beat starts: 30 s
# as written, which the worker's test shortens (what it asserts, the login, the
# event in Kafka, the health check, does not depend on the interval); the relay
# every 5 s after it. Margins for a loaded machine.
TEST_POLLING_INTERVAL = "3"
FIRST_CYCLE_BOUND = 120.0
RELAY_BOUND = 60.0
# A one-shot service (migrate, db-logins) or a health check: seconds.
ONE_SHOT_BOUND = 120.0


@dataclass
class Stack:
    tmp: Path
    secrets: dict[str, str]
    compose: dict[str, Any]
    local: Local
    pg: PrivatePostgres
    owner: Engine  # the test's own access, as postgres over the unix socket
    redis_port: int
    kafka: Tansu
    topic: str

    def service(self, name: str) -> dict[str, Any]:
        return self.compose["services"][name]

    def command(self, name: str) -> list[str]:
        return self.local.command(self.service(name)["command"])

    def healthcheck(self, name: str) -> list[str]:
        test = self.service(name)["healthcheck"]["test"]
        argv = test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]]  # CMD-SHELL
        return self.local.command(argv)

    def environment(self, name: str) -> dict[str, str]:
        # what a container has besides the service's environment: a PATH (the
        # image's, here the venv's) and a home
        base = {
            "PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.tmp / "home"),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
        }
        return {**base, **self.local.environment(self.service(name).get("environment") or {})}

    def run(self, name: str, *, health: bool = False) -> subprocess.CompletedProcess[str]:
        """The service's command (or its health check) to its end."""
        argv = self.healthcheck(name) if health else self.command(name)
        return subprocess.run(
            argv,
            cwd=ROOT,
            env=self.environment(name),
            capture_output=True,
            text=True,
            timeout=ONE_SHOT_BOUND,
        )

    def start(self, name: str, **env: str) -> subprocess.Popen[bytes]:
        """The service's command, its environment with ``env`` over it."""
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
        return subprocess.Popen(
            self.command(name),
            cwd=ROOT,
            env={**self.environment(name), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def worker_url(self) -> str:
        return self.local.text(self.service("worker")["environment"]["REAPER_DATABASE_URL"])

    def write_secret(self, name: str, value: str) -> None:
        # as Docker mounts it: the value, no newline added
        (self.tmp / "secrets" / name).write_text(value)


def stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM (a warm shutdown), then whatever is left of its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with contextlib.suppress(ProcessLookupError):  # the pool, beat
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("compose")
    for sub in ("secrets", "var-lib-reaper", "tmp", "home"):
        (tmp / sub).mkdir()
    env_file = {name: secrets.token_hex(16) for name in variables()}
    env_file["FLOWER_BASIC_AUTH"] = f"ops:{secrets.token_hex(12)}"
    compose = load(env_file)
    services = compose["services"]
    pg = PrivatePostgres(password_auth=True).init()
    redis_proc: subprocess.Popen[bytes] | None = None
    kafka = Tansu()
    owner: Engine | None = None
    try:
        # postgres: what the image's entrypoint does with these variables
        image_env = services["postgres"]["environment"]
        owner = create_engine(pg.socket_url(), isolation_level="AUTOCOMMIT")
        with owner.connect() as conn:
            user, password = image_env["POSTGRES_USER"], image_env["POSTGRES_PASSWORD"]
            conn.exec_driver_sql(f"CREATE ROLE {user} SUPERUSER LOGIN PASSWORD '{password}'")
            conn.exec_driver_sql(f"CREATE DATABASE {image_env['POSTGRES_DB']} OWNER {user}")
        owner.dispose()
        owner = create_engine(pg.socket_url(image_env["POSTGRES_DB"]))
        # redis: its command as written, on a free port of the loopback
        redis_port = free_port()
        redis_proc = subprocess.Popen(
            [*services["redis"]["command"], "--port", str(redis_port), "--bind", "127.0.0.1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(redis_port)
        # kafka and kafka-topics: a Kafka-compatible broker, the file's topic
        kafka.start()
        topics = services["kafka-topics"]["command"]
        topic = topics[topics.index("--topic") + 1]
        create_topic(kafka.bootstrap, topic, int(topics[topics.index("--partitions") + 1]))
        local = Local(
            services={
                "postgres": ("127.0.0.1", 5432, pg.port),
                "redis": ("127.0.0.1", 6379, redis_port),
                "kafka": ("127.0.0.1", 9092, kafka.port),
            },
            paths={
                "/run/secrets/": tmp / "secrets",
                "/var/lib/reaper/": tmp / "var-lib-reaper",
                "/tmp/": tmp / "tmp",
            },
            ports={9808: free_port(), 5555: free_port()},
        )
        built = Stack(tmp, env_file, compose, local, pg, owner, redis_port, kafka, topic)
        for name, source in compose["secrets"].items():
            built.write_secret(name, env_file[source["environment"]])
        yield built
    finally:
        if owner is not None:
            owner.dispose()
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait(timeout=10)
        kafka.stop()
        pg.destroy()


@pytest.fixture(scope="module")
def migrated(stack: Stack) -> subprocess.CompletedProcess[str]:
    return stack.run("migrate")


@pytest.fixture(scope="module")
def worker_login(stack: Stack, migrated: subprocess.CompletedProcess[str]) -> str:
    assert migrated.returncode == 0, migrated.stderr
    done = stack.run("db-logins")
    assert done.returncode == 0, done.stderr
    return stack.worker_url()


def role(engine: Engine, name: str) -> dict[str, Any] | None:
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT rolcanlogin, rolsuper, rolcreaterole, rolcreatedb,"
                "       pg_has_role(rolname, 'reaper_worker', 'MEMBER') AS worker,"
                "       pg_has_role(rolname, 'reaper_operator', 'MEMBER') AS operator"
                " FROM pg_roles WHERE rolname = :n"
            ),
            {"n": name},
        ).one_or_none()
    return None if row is None else dict(row._mapping)


def logs_in(url: str) -> str:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT current_user")).scalar_one()
    finally:
        engine.dispose()


def test_the_migration_runs_as_the_owner_and_creates_both_roles_nologin(stack, migrated):
    assert migrated.returncode == 0, migrated.stderr
    # a new database: every migration (no older release runs on it)
    assert migrated.stdout.startswith(f"schema at {SCHEMA_KNOWN}: a new database"), migrated.stdout
    url = make_url(stack.local.text(stack.service("migrate")["environment"]["REAPER_DATABASE_URL"]))
    assert url.username == stack.service("postgres")["environment"]["POSTGRES_USER"]
    for name in ("reaper_worker", "reaper_operator"):
        assert role(stack.owner, name) == {
            "rolcanlogin": False,
            "rolsuper": False,
            "rolcreaterole": False,
            "rolcreatedb": False,
            "worker": name == "reaper_worker",
            "operator": name == "reaper_operator",
        }, name
    with stack.owner.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == (
            SCHEMA_KNOWN
        )


def test_db_logins_makes_the_worker_login_from_the_secret(stack, worker_login):
    assert role(stack.owner, WORKER_LOGIN) == {
        "rolcanlogin": True,
        "rolsuper": False,
        "rolcreaterole": False,
        "rolcreatedb": False,
        "worker": True,
        "operator": False,
    }
    assert logs_in(worker_login) == WORKER_LOGIN
    wrong = make_url(worker_login).set(password="not-the-secret")
    with pytest.raises(OperationalError, match="password authentication failed"):
        logs_in(wrong.render_as_string(hide_password=False))
    original = stack.secrets["REAPER_WORKER_DB_PASSWORD"]
    try:
        # run again with a rotated secret: the same login, the new password
        rotated = secrets.token_hex(16)
        stack.write_secret("reaper_worker_db_password", rotated)
        again = stack.run("db-logins")
        assert again.returncode == 0, again.stderr
        with pytest.raises(OperationalError, match="password authentication failed"):
            logs_in(worker_login)
        new = make_url(worker_login).set(password=rotated).render_as_string(hide_password=False)
        assert logs_in(new) == WORKER_LOGIN
        # an empty secret is refused with one line, and changes nothing
        stack.write_secret("reaper_worker_db_password", "")
        empty = stack.run("db-logins")
        assert empty.returncode == 1
        assert empty.stderr.strip() == "db-logins: the secret reaper_worker_db_password is empty"
        assert logs_in(new) == WORKER_LOGIN
    finally:
        stack.write_secret("reaper_worker_db_password", original)
        assert stack.run("db-logins").returncode == 0
    assert logs_in(worker_login) == WORKER_LOGIN


def test_redis_refuses_a_client_without_the_password(stack):
    anonymous = redis.Redis(port=stack.redis_port, socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    # Celery's remote control goes through the broker too: without the
    # password it reaches nothing
    url = stack.local.text(stack.service("flower")["environment"]["REAPER_BROKER_URL"])
    assert make_url(url).password == stack.secrets["REDIS_PASSWORD"]
    no_password = url.replace(f":{stack.secrets['REDIS_PASSWORD']}@", "@")
    done = subprocess.run(
        [str(BIN / "celery"), "-A", "reaper", "control", "shutdown", "--timeout", "2"],
        cwd=ROOT,
        env={**stack.environment("flower"), "REAPER_BROKER_URL": no_password},
        capture_output=True,
        text=True,
        timeout=ONE_SHOT_BOUND,
    )
    assert done.returncode != 0
    assert "Authentication required" in done.stdout + done.stderr
    assert redis.Redis(port=stack.redis_port, password=stack.secrets["REDIS_PASSWORD"]).ping()


def test_the_worker_closes_a_room_as_its_login_and_the_event_reaches_kafka(stack, worker_login):
    with stack.owner.begin() as conn:
        now = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        room = f.conference(conn, as_of=now, idle=timedelta(minutes=5))
    worker = stack.start("worker", REAPER_POLLING_INTERVAL=TEST_POLLING_INTERVAL)
    try:
        wait_until(
            lambda: worker.poll() is not None or status(stack.owner, room["id"]) != "Active",
            FIRST_CYCLE_BOUND,
            "the first cycle closing the room",
            interval=0.5,
        )
        assert worker.poll() is None, stack.output("worker")[-4000:]
        assert status(stack.owner, room["id"]) == "Ended"
        with stack.owner.connect() as conn:
            users = set(
                conn.execute(
                    text(
                        "SELECT usename FROM pg_stat_activity WHERE datname = current_database()"
                        " AND pid <> pg_backend_pid() AND usename IS NOT NULL"
                    )
                ).scalars()
            )
        assert users == {WORKER_LOGIN}
        wait_until(lambda: published(stack.owner, room["id"]), RELAY_BOUND, "the relay", 0.5)
        records = [
            r
            for r in read_topic(stack.kafka.bootstrap, stack.topic, expect=1, timeout=30)
            if r.value["payload"]["conferenceId"] == room["id"]
        ]
        assert len(records) == 1
        assert records[0].value["payload"]["endReason"] == "EmptyTimeout"
        # the health check as written: /healthz on the metrics port answers 200
        health = stack.run("worker", health=True)
        assert health.returncode == 0, health.stderr
        # beat's schedule file went where the command says (the image user's directory)
        assert list((stack.tmp / "var-lib-reaper").glob("celerybeat-schedule*"))
    finally:
        code = stop(worker)
    assert code == 0, stack.output("worker")[-4000:]
    [reaped] = output_events(stack.output("worker"), "conference.reaped")
    assert reaped["conference_id"] == room["id"]


def status(engine: Engine, conference_id: str) -> str:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT status FROM messenger.conference_sessions WHERE id = :i"),
            {"i": conference_id},
        ).scalar_one()


def published(engine: Engine, conference_id: str) -> bool:
    """The room ended and its event's row gone: the row is written in the
    transaction that ends the room, and deleted at its own Kafka acknowledgement."""
    with engine.connect() as conn:
        left = conn.execute(
            text(
                "SELECT count(*) FROM messenger.integration_outbox"
                " WHERE payload -> 'payload' ->> 'conferenceId' = :i"
            ),
            {"i": conference_id},
        ).scalar()
    return status(engine, conference_id) == "Ended" and left == 0


def get(port: int, path: str, auth: str | None) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_flower_answers_only_with_auth_and_has_no_database_url(stack):
    port = stack.local.ports[5555]
    env = stack.environment("flower")
    assert not any(name.startswith("REAPER_DATABASE") for name in env)
    flower = stack.start("flower")
    try:
        wait_for_port(port, timeout=60)
        auth = stack.secrets["FLOWER_BASIC_AUTH"]
        assert get(port, "/", None) == 401
        assert get(port, "/", "ops:wrong") == 401
        assert get(port, "/", auth) == 200
        assert get(port, "/api/workers", auth) == 200
        health = stack.run("flower", health=True)
        assert health.returncode == 0, health.stderr
    finally:
        stop(flower)
    assert "refusing" not in stack.output("flower")
