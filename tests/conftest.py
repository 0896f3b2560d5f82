"""Shared fixtures: a real PostgreSQL database per test session (migrated once),
real Redis, and a real Kafka-compatible broker. A missing service fails the
tests that use it; nothing is skipped. Tests that use no service (pure
functions, files, fakes) request none of these and run without them."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest
from sqlalchemy import Connection, Engine, create_engine, make_url, text

if TYPE_CHECKING:
    from tests.support.pgbouncer import PgBouncer

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SESSION_TAG = uuid.uuid4().hex[:8]

PG_URL = os.environ.get("REAPER_TEST_PG", "postgresql+psycopg2://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("REAPER_TEST_REDIS", "redis://127.0.0.1:6379/0")
TEST_DB_URL = f"{PG_URL}/reaper_test_{SESSION_TAG}"

# Settings read from the environment (the Celery app, subprocesses) point at the
# session's own database and broker key space, never at a developer's.
os.environ.update(
    {
        "REAPER_DATABASE_URL": TEST_DB_URL,
        "REAPER_BROKER_URL": REDIS_URL,
        "REAPER_BROKER_KEY_PREFIX": f"reaper-test-{SESSION_TAG}:",
        # Workers of the tests run the outbox relay too: never against a
        # developer's broker on 9092. Tests that want Kafka pass kafka_broker.
        "REAPER_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
        "REAPER_METRICS_PORT": "0",
    }
)

from reaper.config import Settings  # noqa: E402
from reaper.db import dispose_engines, engine_for, migrate  # noqa: E402
from tests.support.facts import FactRecorder  # noqa: E402
from tests.support.ports import reachable  # noqa: E402

# How the suite runs in several processes, and the figures it reports.
pytest_plugins = ("tests.support.runner",)

TABLES = (
    "messenger.reaper_pauses",
    "messenger.reaper_tenant_windows",
    "messenger.reaper_runs",
    "messenger.realtime_outbox",
    "messenger.integration_outbox",
    "messenger.outbox_discards",
    "messenger.outbox_republishes",
    "messenger.call_recordings",
    "messenger.conference_participants",
    "messenger.conference_sessions",
)


@pytest.fixture(scope="session")
def services() -> None:
    """PostgreSQL and Redis answer, or every test that needs them fails here."""
    pg = make_url(PG_URL)
    redis = urlsplit(REDIS_URL)
    missing = [
        name
        for name, host, port in (
            ("PostgreSQL", pg.host or "localhost", pg.port or 5432),
            ("Redis", redis.hostname or "localhost", redis.port or 6379),
        )
        if not reachable(host, port)
    ]
    if missing:
        pytest.fail(f"required services are not running: {', '.join(missing)} (see README)")


@pytest.fixture(scope="session")
def database_url(services: None) -> Iterator[str]:
    """The session's migrated database. The test process is then a process like
    the CLI: its bus has the subscribers (logs, metrics, traces, the gauges on
    this database), so a test that runs the engine sees its log lines."""
    from reaper import wiring

    migrate(TEST_DB_URL)
    # Commits of this session's database do not wait for the disk (about 2.4 ms
    # each here, 0.7 ms without): nothing here survives a crash on purpose. The
    # tests that crash PostgreSQL do it to a private server of their own
    # (tests/support/services.py), whose commits are what they check.
    admin = create_engine(f"{PG_URL}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(
            text(f'ALTER DATABASE "reaper_test_{SESSION_TAG}" SET synchronous_commit = off')
        )
    admin.dispose()
    wiring.install(Settings(database_url=TEST_DB_URL))
    yield TEST_DB_URL
    dispose_engines()
    admin = create_engine(f"{PG_URL}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "reaper_test_{SESSION_TAG}" WITH (FORCE)'))
    admin.dispose()


def clean(conn: Connection) -> None:
    """Every table of the schema emptied: a test starts from nothing, whatever the
    test before it in this process left (a pause, a policy, an open run)."""
    conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = engine_for(database_url)
    with engine.begin() as conn:
        clean(conn)
    yield engine


@pytest.fixture
def facts() -> Iterator[FactRecorder]:
    """Every fact the engine emits during the test, on the process bus."""
    from reaper.events import process_bus

    recorder = FactRecorder(process_bus)
    yield recorder
    recorder.close()


@pytest.fixture
def refusing_database(engine: Engine) -> Iterator[Engine]:
    """The database refuses to update the conferences given to factory.refuse()
    (a trigger raising, as a legal hold or another team's constraint would)."""
    from tests.support.factory import REFUSING_TRIGGER

    with engine.begin() as conn:
        conn.execute(text(REFUSING_TRIGGER))
    yield engine
    with engine.begin() as conn:
        conn.execute(text("DROP TRIGGER test_refuse ON messenger.conference_sessions"))
        conn.execute(text("DROP FUNCTION messenger.test_refuse()"))
        conn.execute(text("DROP TABLE messenger.test_refused"))


@pytest.fixture
def settings(database_url: str) -> Settings:
    """The documented defaults (docs/design.md#configuration) on the session's database."""
    return Settings(database_url=database_url)


@pytest.fixture(scope="session")
def kafka_broker(services: None) -> Iterator[str]:
    """A Tansu broker (Kafka protocol) on a free port; yields bootstrap servers."""
    from tests.support.kafka import Tansu

    broker = Tansu().start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def pgbouncer(database_url: str) -> Iterator[PgBouncer]:
    """A PgBouncer in transaction pooling mode in front of the session's database
    (docs/design.md#behind-pgbouncer); a test that needs another pool size
    starts its own."""
    from tests.support.pgbouncer import PgBouncer

    bouncer = PgBouncer(database_url).start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


# -- test layers (docs/reliability.md) -------------------------------------------
# The fast layer is every test not marked ``process`` (nor ``soak``): pure
# functions, config, formatting and the SQL statements against the session
# database, in this process. ``process`` tests start processes: workers, the
# CLI, a Kafka-compatible broker, promtool. ``scripts/test -m fast`` runs the
# fast layer alone; a fast test that starts a process fails (below), so the
# layer stays fast by construction.

PROCESS_FIXTURES = {"kafka_broker", "pgbouncer"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)
        if not item.get_closest_marker("process") and not item.get_closest_marker("soak"):
            item.add_marker(pytest.mark.fast)


class _NoProcessInTheFastLayer:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError(
            "a test of the fast layer started a process: mark it pytest.mark.process"
        )


@pytest.fixture(autouse=True)
def _fast_layer_starts_no_process(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    if request.node.get_closest_marker("fast"):
        import subprocess

        monkeypatch.setattr(subprocess, "Popen", _NoProcessInTheFastLayer)
