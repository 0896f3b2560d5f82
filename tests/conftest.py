"""Shared fixtures: a real PostgreSQL database per test session (migrated once),
real Redis, and a real Kafka-compatible broker. A missing service fails the
run; nothing is skipped."""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from sqlalchemy import Engine, create_engine, make_url, text

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

TABLES = (
    "messenger.realtime_outbox",
    "messenger.integration_outbox",
    "messenger.call_recordings",
    "messenger.conference_participants",
    "messenger.conference_sessions",
)


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _reachable("127.0.0.1", port):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


@pytest.fixture(scope="session", autouse=True)
def services() -> None:
    pg = make_url(PG_URL)
    redis = urlsplit(REDIS_URL)
    missing = [
        name
        for name, host, port in (
            ("PostgreSQL", pg.host, pg.port or 5432),
            ("Redis", redis.hostname, redis.port or 6379),
        )
        if not _reachable(host, port)
    ]
    if missing:
        pytest.fail(f"required services are not running: {', '.join(missing)} (see README)")


@pytest.fixture(scope="session")
def database_url(services: None) -> Iterator[str]:
    migrate(TEST_DB_URL)
    yield TEST_DB_URL
    dispose_engines()
    admin = create_engine(f"{PG_URL}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "reaper_test_{SESSION_TAG}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = engine_for(database_url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
    yield engine


@pytest.fixture
def settings(database_url: str) -> Settings:
    """Defaults of CONTRACT §3 on the session's database."""
    return Settings(database_url=database_url)


@pytest.fixture(scope="session")
def kafka_broker(services: None) -> Iterator[str]:
    """A Tansu broker (Kafka protocol) on a free port; yields bootstrap servers."""
    from tests.kafkatools import Tansu  # it imports this module's helpers

    broker = Tansu().start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()
