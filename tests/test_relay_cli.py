"""``reaper relay --once``: one relay pass in the calling process, through the real
CLI, against real PostgreSQL and the test broker."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from reaper.queries import Queries
from reaper.relay import PASS_CONNECTIONS
from tests.support.kafka import create_topic, read_topic
from tests.support.ports import free_port
from tests.support.processes import ROOT

pytestmark = pytest.mark.process

REAPER = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "reaper")


def relay_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [REAPER, "relay", *args],
        cwd=ROOT,
        env={**os.environ, "REAPER_KAFKA_TIMEOUT": "3", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def add_rows(engine: Engine, topic: str, keys: list[str], *, pad: int = 0) -> list[str]:
    ids = []
    with engine.begin() as conn:
        for key in keys:
            event_id = str(uuid.uuid4())
            payload = {"eventId": event_id, "eventType": "test", "correlationId": "c"}
            if pad:
                payload["pad"] = "p" * pad
            conn.execute(
                text(
                    "INSERT INTO messenger.integration_outbox"
                    " (event_id, topic, message_key, payload)"
                    " VALUES (:e, :t, :k, CAST(:p AS jsonb))"
                ),
                {"e": event_id, "t": topic, "k": key, "p": json.dumps(payload)},
            )
            ids.append(event_id)
    return ids


def outbox(engine: Engine) -> list[dict]:
    with engine.connect() as conn:
        return [
            dict(r._mapping)
            for r in conn.execute(
                text(
                    "SELECT event_id::text, published_at, parked_at, attempts"
                    " FROM messenger.integration_outbox ORDER BY id"
                )
            )
        ]


def plain_lines(stderr: str) -> list[str]:
    """stderr without the JSON log lines: what the command itself says."""
    return [line for line in stderr.splitlines() if line and not line.startswith("{")]


@pytest.fixture
def topic(kafka_broker: str) -> str:
    name = f"test.relay-cli.{uuid.uuid4().hex[:10]}"
    create_topic(kafka_broker, name)
    return name


def test_relay_once_publishes_the_backlog_and_prints_its_result(engine, kafka_broker, topic):
    ids = add_rows(engine, topic, ["deal-a", "deal-a", "deal-b"])
    env = {"REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker}
    done = relay_cli("--once", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"published": 3, "failed": 0, "parked": 0, "pending": 0}
    assert outbox(engine) == []  # each row deleted at its acknowledgement; on Kafka:
    records = read_topic(kafka_broker, topic, expect=3)
    deal_a = sorted((r for r in records if r.key == "deal-a"), key=lambda r: r.offset)
    assert [r.event_id for r in deal_a] == ids[:2]
    assert {r.event_id for r in records} == set(ids)
    logged = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert any(line["event"] == "relay.completed" for line in logged)

    again = relay_cli("--once", env=env)  # nothing left: a readable line, exit 0
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "published 0, failed 0, parked 0, pending 0"


# The pass, watched from inside the CLI's process: the connections it found open,
# whether start-up's objects were frozen, and the connections it opened itself.
WATCHED_PASS = textwrap.dedent(
    """
    import gc, json, sys
    from sqlalchemy import event
    from reaper import cli, relay

    run = relay.Relay.run

    def watched(self):
        opened = []
        event.listen(self.engine, "connect", lambda *_: opened.append(1))
        found = {"idle": self.engine.pool.checkedin(), "frozen": gc.get_freeze_count()}
        result = run(self)
        print(json.dumps({**found, "opened": len(opened)}), file=sys.stderr)
        return result

    relay.Relay.run = watched
    sys.exit(cli.main(["relay", "--once", "--json"]))
    """
)


def test_relay_once_opens_its_connections_and_freezes_start_up_before_the_pass(
    engine, kafka_broker, topic
):
    """As a worker's pass after its first: the connections a pass holds at once
    are open (the pass opens none), and what start-up built is frozen, out of
    the pass's garbage collections."""
    add_rows(engine, topic, ["deal-a", "deal-b", "deal-c"])
    done = subprocess.run(
        [str(Path(REAPER).with_name("python")), "-c", WATCHED_PASS],
        cwd=ROOT,
        env={**os.environ, "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["published"] == 3
    [found] = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"idle"')]
    assert found["idle"] >= PASS_CONNECTIONS
    assert found["frozen"] > 0
    assert found["opened"] == 0


def test_relay_once_counts_a_parked_event_and_still_exits_0(engine, kafka_broker, topic):
    add_rows(engine, topic, ["deal-a"], pad=4000)  # larger than the request size below
    add_rows(engine, topic, ["deal-a", "deal-b"])
    env = {"REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker, "REAPER_KAFKA_MAX_REQUEST_SIZE": "2048"}
    done = relay_cli("--once", "--json", env=env)
    assert done.returncode == 0, done.stderr
    # deal-a's later event stays behind its parked one (docs/design.md#parked-events)
    assert json.loads(done.stdout) == {"published": 1, "failed": 0, "parked": 1, "pending": 1}


def test_relay_once_without_kafka_is_one_line_and_exit_1(engine, topic):
    add_rows(engine, topic, ["deal-a", "deal-b"])
    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    done = relay_cli("--once", "--json", env={"REAPER_KAFKA_BOOTSTRAP_SERVERS": bootstrap})
    assert time.monotonic() - started < 30
    assert done.returncode == 1
    assert done.stdout == ""
    [line] = plain_lines(done.stderr)
    assert line.startswith(f"reaper: Kafka {bootstrap} could not be reached")
    rows = outbox(engine)
    assert all(r["published_at"] is None and r["attempts"] == 0 for r in rows)


def test_relay_once_without_a_database_is_one_line_and_exit_1(kafka_broker):
    unreachable = f"postgresql+psycopg2://postgres@127.0.0.1:{free_port()}/reaper"
    done = relay_cli(
        "--once",
        env={"REAPER_DATABASE_URL": unreachable, "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker},
    )
    assert done.returncode == 1
    assert done.stdout == ""
    [line] = plain_lines(done.stderr)
    assert line.startswith("reaper: database postgresql+psycopg2://postgres@127.0.0.1:")


def test_relay_once_beside_a_running_pass_only_counts(engine, kafka_broker, topic):
    """One pass at a time: while another holds the relay lock, --once publishes
    nothing, says so in one line and exits 0 (the other pass is doing the work)."""
    add_rows(engine, topic, ["deal-a"])
    with engine.connect() as holder:
        holder.begin()
        assert Queries(holder).try_relay_lock()
        done = relay_cli("--once", "--json", env={"REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker})
        holder.rollback()
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"published": 0, "failed": 0, "parked": 0, "pending": 1}
    [line] = plain_lines(done.stderr)
    assert line.startswith("reaper: another relay pass is running")


def test_relay_without_once_is_refused():
    done = relay_cli(env={})
    assert done.returncode == 2
    assert "only --once" in done.stderr
