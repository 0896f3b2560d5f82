"""``reaper reconcile`` (docs/delivery.md) against the real PostgreSQL and the
test broker: the ledger read from the topic by timestamps, through the CLI."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, text

from reaper import metrics
from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.ledger import CATEGORIES, Ledger
from reaper.phases import PHASES
from tests.support import factory as f
from tests.support.kafka import create_topic
from tests.support.ports import free_port
from tests.support.processes import run_cli
from tests.support.roles import login
from tests.test_relay_cli import relay_cli

pytestmark = pytest.mark.process


@pytest.fixture
def topic(kafka_broker: str) -> str:
    name = f"test.reconcile.{uuid.uuid4().hex[:10]}"
    create_topic(kafka_broker, name)
    return name


@pytest.fixture
def env(kafka_broker: str, topic: str, database_url: str) -> dict[str, str]:
    return {
        "REAPER_DATABASE_URL": database_url,
        "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker,
        "REAPER_CONFERENCE_ENDED_TOPIC": topic,
        "REAPER_KAFKA_TIMEOUT": "3",
        "REAPER_OPERATOR": "alice",
    }


@pytest.fixture
def operator_url(database_url: str, engine: Engine) -> Iterator[str]:
    with login(engine, database_url, "reaper_operator", prefix="reaper_oper") as url:
        yield url


@pytest.fixture
def worker_url(database_url: str, engine: Engine) -> Iterator[str]:
    with login(engine, database_url, "reaper_worker") as url:
        yield url


def close_rooms(settings: Settings, engine: Engine, n: int) -> list[str]:
    """``n`` rooms closed now (by the database's clock) by a real cycle."""
    now = f.db_now(engine)
    with engine.begin() as conn:
        ids = [
            f.conference(conn, as_of=now, idle=settings.empty_room_grace * 2)["id"]
            for _ in range(n)
        ]
    assert Reaper(settings, engine=engine).run_cycle()["empty_timeout_count"] == n
    return ids


def relay(env: dict[str, str]) -> None:
    done = relay_cli("--once", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["pending"] == 0


def outbox_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(text("SELECT count(*) FROM messenger.integration_outbox")).scalar_one()
        )


def reconcile(env: dict[str, str], *args: str, url: str | None = None) -> Any:
    over = {"REAPER_DATABASE_URL": url} if url else {}
    return run_cli("reconcile", *args, env={**env, **over}, timeout=120)


def logged(stderr: str, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return [line for line in lines if line["event"] == name]


def plain_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line and not line.startswith("{")]


def test_reconcile_finds_a_lost_event_and_republish_puts_it_back(
    settings, engine, env, operator_url, worker_url, kafka_broker, topic
):
    settings = settings.model_copy(
        update={"kafka_bootstrap_servers": kafka_broker, "conference_ended_topic": topic}
    )
    rooms = close_rooms(settings, engine, 3)
    relay(env)
    assert outbox_count(engine) == 0  # acknowledged rows are deleted: Kafka holds them

    clean = reconcile(env, "--since", "2h")
    assert clean.returncode == 0, (clean.stdout, clean.stderr)
    assert clean.stdout.splitlines()[-1] == "clean"
    assert "EmptyTimeout  closed 3, on Kafka 3, pending 0, lost 0" in clean.stdout
    [checked] = logged(clean.stderr, "reconcile.checked")
    assert (checked["ok"], checked["closings"], checked["on_kafka"]) == (True, 3, 3)

    # the plant: a room closed whose event left the outbox without reaching Kafka
    [victim] = close_rooms(settings, engine, 1)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM messenger.integration_outbox"))
    lost = reconcile(env, "--since", "2h", "--json")
    assert lost.returncode == 4, lost.stderr
    data = json.loads(lost.stdout)
    assert data["ok"] is False and data["counts"]["lost"] == 1
    assert data["counts"]["on_kafka"] == 3 and data["by_end_reason"]["EmptyTimeout"]["lost"] == 1
    assert [x["conference_id"] for x in data["examples"]["lost"]] == [victim]
    assert [x["conference_id"] for x in logged(lost.stderr, "reconcile.lost")] == [victim]
    assert victim not in rooms

    # a worker login may check, never put back: one line, nothing read or written
    refused = reconcile(env, "--since", "2h", "--republish", url=worker_url)
    assert refused.returncode == 1 and refused.stdout == ""
    [line] = plain_lines(refused.stderr)
    assert line.startswith("reaper: --republish: login reaper_login_") and (
        "reaper_operator role's only" in line
    ), line
    assert outbox_count(engine) == 0
    assert reconcile(env, "--since", "2h", url=worker_url).returncode == 4

    back = reconcile(
        env,
        "--since",
        "2h",
        "--republish",
        "--reason",
        "INC-9: broker lost a segment",
        url=operator_url,
    )
    assert back.returncode == 4, back.stderr  # what it found; the relay sends it next
    assert f"republished conference {victim}" in back.stdout
    [put] = logged(back.stderr, "reconcile.republished")
    assert (put["conference_id"], put["by"], put["reason"]) == (
        victim,
        "alice",
        "INC-9: broker lost a segment",
    )
    assert outbox_count(engine) == 1
    # pending now: not lost, and a second --republish puts nothing more back
    again = reconcile(env, "--since", "2h", "--republish", url=operator_url)
    assert again.returncode == 0, again.stdout
    assert outbox_count(engine) == 1
    relay(env)
    after = reconcile(env, "--since", "2h", "--json")
    assert after.returncode == 0, after.stdout
    assert json.loads(after.stdout)["counts"]["on_kafka"] == 4


def test_a_timestamp_window_and_the_ledger_read_by_timestamps(
    settings, engine, env, kafka_broker, topic
):
    settings = settings.model_copy(
        update={"kafka_bootstrap_servers": kafka_broker, "conference_ended_topic": topic}
    )
    close_rooms(settings, engine, 2)
    relay(env)
    now = f.db_now(engine)
    # the same check in-process, by the class the CLI runs
    verdict = Ledger(settings, engine).check(now - timedelta(hours=1), now)
    assert verdict.ok and verdict.on_kafka == 2 and verdict.records == 2, verdict.summary()
    # a window after them: no closing, and the records read by timestamp are none
    later = Ledger(settings, engine).check(now + timedelta(minutes=10), now + timedelta(hours=1))
    assert later.ok and later.closings == 0 and later.records == 0, later.summary()
    since = (now - timedelta(hours=1)).isoformat()
    done = reconcile(env, "--since", since, "--until", now.isoformat())
    assert done.returncode == 0 and "closed 2, on Kafka 2" in done.stdout, done.stdout


def test_usage_and_an_unreadable_broker_that_leaves_the_metrics_file(engine, env, tmp_path):
    for args, said in (
        (["--since", "yesterday"], "--since: 'yesterday' is neither a moment"),
        (["--since", "0h"], "--since: '0h' is no time ago"),
        (["--since", "1h", "--until", "2h"], "is not before --until"),
        (["--since", "1h", "--republish", "--reason", " "], "a republish needs a reason"),
    ):
        done = reconcile(env, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert said in plain_lines(done.stderr)[0], (args, done.stderr)
    # no verdict: a --metrics-file keeps the last one, whose window end then ages
    prom = tmp_path / "reaper_reconcile.prom"
    prom.write_text("# the last verdict\n")
    gone = reconcile(
        {**env, "REAPER_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}"},
        "--since",
        "1h",
        "--metrics-file",
        str(prom),
    )
    assert gone.returncode == 5, gone.stderr
    assert prom.read_text() == "# the last verdict\n"
    [line] = plain_lines(gone.stderr)
    assert line.startswith("reaper: Kafka could not be read, no verdict on delivery"), line


def reconcile_metrics(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a --metrics-file, by name and labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(path.read_text())
        for s in family.samples
    }


def test_the_metrics_file_counts_lost_events_per_end_reason(
    settings, engine, env, kafka_broker, topic, tmp_path
):
    settings = settings.model_copy(
        update={"kafka_bootstrap_servers": kafka_broker, "conference_ended_topic": topic}
    )
    close_rooms(settings, engine, 2)
    relay(env)
    prom = tmp_path / "reaper_reconcile.prom"
    clean = reconcile(env, "--since", "2h", "--metrics-file", str(prom))
    assert clean.returncode == 0, clean.stderr
    written = reconcile_metrics(prom)
    assert {name for name, _ in written} == set(metrics.RECONCILE_EXPORTED)
    # every phase's end reason and every category is there at zero: an alert reads a series
    for phase in PHASES.values():
        assert (
            written[("messenger_conf_reaper_reconcile_lost", (("end_reason", phase.end_reason),))]
            == 0
        )
    for category in CATEGORIES:
        assert written[("messenger_conf_reaper_reconcile_findings", (("category", category),))] == 0
    assert written[("messenger_conf_reaper_reconcile_closings", ())] == 2
    until = written[("messenger_conf_reaper_reconcile_until_timestamp_seconds", ())]
    assert abs(until - f.db_now(engine).timestamp()) < 60

    # the plant: a room closed whose event left the outbox without reaching Kafka
    close_rooms(settings, engine, 1)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM messenger.integration_outbox"))
    assert reconcile(env, "--since", "2h", "--metrics-file", str(prom)).returncode == 4
    lost = reconcile_metrics(prom)
    assert lost[("messenger_conf_reaper_reconcile_lost", (("end_reason", "EmptyTimeout"),))] == 1
    assert lost[("messenger_conf_reaper_reconcile_findings", (("category", "lost"),))] == 1
    assert lost[("messenger_conf_reaper_reconcile_closings", ())] == 3

    # a file that cannot be written: the verdict printed, then one line, exit 1
    nowhere = reconcile(env, "--since", "2h", "--metrics-file", str(tmp_path / "no" / "x.prom"))
    assert nowhere.returncode == 1 and "lost 1" in nowhere.stdout, nowhere.stdout
    [line] = plain_lines(nowhere.stderr)
    assert line.startswith("reaper: --metrics-file: FileNotFoundError"), line
