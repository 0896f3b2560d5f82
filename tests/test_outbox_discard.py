"""``reaper outbox discard`` (migration 0013, docs/design.md#parked-events): a
parked row Kafka will never accept leaves the outbox for
``messenger.outbox_discards``, kept with who, when and why, and its deal's later
events go on. Only an operator login may; only a parked row is taken."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import DBAPIError

from reaper import metrics
from reaper.errors import sqlstate
from reaper.events import process_bus
from reaper.wiring import Gauges
from tests.support.kafka import create_topic, read_topic
from tests.support.processes import run_cli
from tests.support.roles import function_grants, login
from tests.test_relay_cli import add_rows, relay_cli

WORKER = "reaper_worker"
OPERATOR = "reaper_operator"
FUNCTION = "messenger.discard_outbox(uuid, text, text)"
REASON = "roster larger than any topic limit we will set (INC-42)"


def parked_row(engine: Engine, key: str = "deal-a") -> str:
    """A row the relay parked: refused for good, with its error."""
    event_id = str(uuid.uuid4())
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messenger.integration_outbox"
                " (event_id, topic, message_key, payload, created_at, attempts, last_error,"
                "  parked_at)"
                " VALUES (:e, 'conference.ended', :k, CAST(:p AS jsonb),"
                "         now() - interval '1 hour', 1, 'MessageSizeTooLargeError: too big',"
                "         now() - interval '50 minutes')"
            ),
            {"e": event_id, "k": key, "p": json.dumps({"eventId": event_id, "n": 1})},
        )
    return event_id


def pending_row(engine: Engine) -> str:
    event_id = str(uuid.uuid4())
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload)"
                " VALUES (:e, 'conference.ended', 'deal-p', '{}')"
            ),
            {"e": event_id},
        )
    return event_id


def outbox_state(engine: Engine, event_id: str) -> tuple[Any, ...] | None:
    """(parked_at, attempts) of the outbox row, None when it is gone."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT parked_at, attempts FROM messenger.integration_outbox WHERE event_id = :e"
            ),
            {"e": event_id},
        ).one_or_none()
    return None if row is None else tuple(row)


def discards(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [
            dict(r._mapping)
            for r in conn.execute(
                text(
                    "SELECT event_id::text, topic, message_key, payload, created_at, parked_at,"
                    " attempts, last_error, discarded_at, discarded_by, discarded_login, reason"
                    " FROM messenger.outbox_discards ORDER BY discarded_at"
                )
            )
        ]


def db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        now: datetime = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
    return now


def discard(url: str, *args: str, operator: str = "alice") -> Any:
    return run_cli(
        "outbox",
        "discard",
        *args,
        env={"REAPER_DATABASE_URL": url, "REAPER_OPERATOR": operator},
    )


def plain_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line and not line.startswith("{")]


def logged(stderr: str, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return [line for line in lines if line["event"] == name]


@pytest.fixture
def operator_url(database_url: str, engine: Engine) -> Iterator[str]:
    with login(engine, database_url, OPERATOR, prefix="reaper_oper") as url:
        yield url


@pytest.fixture
def worker_url(database_url: str, engine: Engine) -> Iterator[str]:
    with login(engine, database_url, WORKER) as url:
        yield url


@pytest.mark.process
def test_an_operator_discards_a_parked_row_kept_with_who_when_and_why(engine, operator_url):
    event_id = parked_row(engine)
    with engine.connect() as conn:
        before = dict(
            conn.execute(
                text(
                    "SELECT topic, message_key, payload, created_at, parked_at, attempts,"
                    " last_error FROM messenger.integration_outbox WHERE event_id = :e"
                ),
                {"e": event_id},
            )
            .one()
            ._mapping
        )
    started = db_now(engine)
    done = discard(operator_url, "--event-id", event_id, "--reason", f"  {REASON} ")
    assert done.returncode == 0, done.stderr
    login_name = operator_url.split("://", 1)[1].split(":", 1)[0]
    assert done.stdout.strip() == (
        f"discarded {event_id} (deal deal-a, topic conference.ended) by alice as {login_name}: "
        f"{REASON}; kept in messenger.outbox_discards"
    )
    assert outbox_state(engine, event_id) is None  # out of the outbox
    [kept] = discards(engine)
    discarded_at = kept.pop("discarded_at")
    assert started <= discarded_at <= db_now(engine)
    assert kept == {
        "event_id": event_id,
        **before,  # the row as it was, payload included
        "discarded_by": "alice",  # REAPER_OPERATOR
        "discarded_login": login_name,  # the database's session_user, not chosen by the caller
        "reason": REASON,
    }
    [line] = logged(done.stderr, "outbox.discarded")
    assert line["level"] == "WARNING"
    assert {k: line[k] for k in ("event_id", "message_key", "topic", "reason")} == {
        "event_id": event_id,
        "message_key": "deal-a",
        "topic": "conference.ended",
        "reason": REASON,
    }
    assert (line["discarded_by"], line["discarded_login"]) == ("alice", login_name)


@pytest.mark.process
def test_a_pending_row_an_unknown_id_and_a_blank_reason_are_refused(engine, operator_url):
    pending = pending_row(engine)
    parked = parked_row(engine)
    state = outbox_state(engine, pending)

    done = discard(operator_url, "--event-id", pending, "--reason", REASON)
    assert done.returncode == 1, done.stderr
    [line] = plain_lines(done.stderr)
    assert line == (
        f"reaper: outbox event {pending} is still pending (the relay keeps trying it): "
        "only a parked event can be discarded; wait until it is parked"
    )
    assert outbox_state(engine, pending) == state  # untouched

    unknown = str(uuid.uuid4())
    done = discard(operator_url, "--event-id", unknown, "--reason", REASON)
    assert done.returncode == 1, done.stderr
    assert plain_lines(done.stderr) == [f"reaper: no outbox event {unknown}"]

    # usage: refused before the database is asked
    done = discard(operator_url, "--event-id", "not-a-uuid", "--reason", REASON)
    assert done.returncode == 2
    assert plain_lines(done.stderr) == ["reaper: --event-id: 'not-a-uuid' is not a UUID"]
    done = discard(operator_url, "--event-id", parked, "--reason", "   ")
    assert done.returncode == 2
    assert plain_lines(done.stderr) == ["reaper: --reason: a discard needs a reason"]
    assert discard(operator_url, "--event-id", parked).returncode == 2  # --reason is required

    assert outbox_state(engine, parked) is not None and discards(engine) == []


def test_the_function_refuses_a_blank_reason_and_a_published_row(engine):
    """The table's and the function's own checks, whoever calls (here the owner)."""
    parked = parked_row(engine)
    call = "SELECT messenger.discard_outbox(CAST(:e AS uuid), :why, 'alice')"
    with (
        pytest.raises(DBAPIError, match="a discard needs a reason") as refused,
        engine.begin() as conn,
    ):
        conn.execute(text(call), {"e": parked, "why": " "})
    assert sqlstate(refused.value) == "22023"
    with engine.begin() as conn:  # a 0.3.0 relay's published row: on Kafka already
        conn.execute(
            text(
                "UPDATE messenger.integration_outbox SET published_at = now(), parked_at = NULL"
                " WHERE event_id = :e"
            ),
            {"e": parked},
        )
    with (
        pytest.raises(DBAPIError, match="was published: nothing to discard") as refused,
        engine.begin() as conn,
    ):
        conn.execute(text(call), {"e": parked, "why": "why"})
    assert sqlstate(refused.value) == "55000"
    with pytest.raises(DBAPIError, match="ck_outbox_discards_reason"), engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messenger.outbox_discards (event_id, topic, message_key,"
                " payload, created_at, parked_at, attempts, discarded_by, reason)"
                " VALUES (gen_random_uuid(), 't', 'k', '{}', now(), now(), 0, 'x', '')"
            )
        )
    assert discards(engine) == []


@pytest.mark.process
def test_a_worker_login_may_not_discard(engine, worker_url):
    event_id = parked_row(engine)
    state = outbox_state(engine, event_id)
    done = discard(worker_url, "--event-id", event_id, "--reason", REASON)
    assert done.returncode == 1
    [line] = plain_lines(done.stderr)
    assert line.startswith("reaper: database ") and "Traceback" not in done.stderr
    assert "permission denied for function discard_outbox" in line
    # nor by hand: neither the function nor a write of the table
    worker = create_engine(worker_url)
    try:
        for statement in (
            f"SELECT messenger.discard_outbox('{event_id}', 'why', 'mallory')",
            "INSERT INTO messenger.outbox_discards (event_id, topic, message_key, payload,"
            " created_at, parked_at, attempts, discarded_by, reason)"
            " VALUES (gen_random_uuid(), 't', 'k', '{}', now(), now(), 0, 'x', 'y')",
            "DELETE FROM messenger.outbox_discards",
        ):
            with (
                pytest.raises(DBAPIError, match="permission denied") as refused,
                worker.begin() as conn,
            ):
                conn.exec_driver_sql(statement)
            assert sqlstate(refused.value) == "42501", statement
    finally:
        worker.dispose()
    assert outbox_state(engine, event_id) == state and discards(engine) == []


def test_only_the_operator_may_run_the_discard_and_it_is_pinned(engine):
    worker, operator, public, definer, config = function_grants(engine, FUNCTION)
    assert (worker, operator, public, definer) == (False, True, False, True)
    assert config == ["search_path=pg_catalog, pg_temp"]


def test_the_gauge_and_reaper_status_count_the_discarded_rows(settings, engine):
    from reaper import overview
    from reaper.control import Controls

    Gauges(engine, settings, process_bus).refresh()
    assert metrics.sample("messenger_outbox_discarded", {}) == 0
    first, second = parked_row(engine, "deal-a"), parked_row(engine, "deal-b")
    controls = Controls(engine, settings)
    controls.discard(first, REASON)
    controls.discard(second, REASON)
    Gauges(engine, settings, process_bus).refresh()
    assert metrics.sample("messenger_outbox_discarded", {}) == 2
    assert metrics.sample("messenger_outbox_parked", {}) == 0
    status = overview.status(engine, settings)
    assert status["outbox"]["discarded"] == 2 and status["outbox"]["parked"] == 0
    assert "outbox discarded          2  (kept in messenger.outbox_discards; runbook)" in (
        overview.format_status(status).splitlines()
    )


@pytest.mark.process
def test_after_the_discard_the_deals_later_events_reach_kafka_in_order(
    engine, kafka_broker, operator_url
):
    topic = f"test.discard.{uuid.uuid4().hex[:10]}"
    create_topic(kafka_broker, topic)
    [too_large] = add_rows(engine, topic, ["deal-a"], pad=4000)  # over the request size below
    later = add_rows(engine, topic, ["deal-a", "deal-a", "deal-a"])
    [other] = add_rows(engine, topic, ["deal-b"])
    env = {"REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker, "REAPER_KAFKA_MAX_REQUEST_SIZE": "2048"}

    done = relay_cli("--once", "--json", env=env)
    assert done.returncode == 0, done.stderr
    # the head is parked and holds its deal's later events back; another deal goes on
    assert json.loads(done.stdout) == {"published": 1, "failed": 0, "parked": 1, "pending": 3}
    assert outbox_state(engine, too_large) is not None
    again = relay_cli("--once", "--json", env=env)  # held for as long as it stays parked
    assert json.loads(again.stdout)["published"] == 0, again.stderr

    done = discard(operator_url, "--event-id", too_large, "--reason", REASON)
    assert done.returncode == 0, done.stderr

    done = relay_cli("--once", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"published": 3, "failed": 0, "parked": 0, "pending": 0}
    records = read_topic(kafka_broker, topic, expect=4)
    deal_a = sorted((r for r in records if r.key == "deal-a"), key=lambda r: r.offset)
    assert [r.event_id for r in deal_a] == later  # in their order, without the discarded one
    assert {r.event_id for r in records} == {*later, other}
    assert too_large not in {r.event_id for r in records}
    [kept] = discards(engine)
    assert (kept["event_id"], kept["message_key"], kept["reason"]) == (too_large, "deal-a", REASON)
    assert kept["discarded_by"] == "alice" and kept["payload"]["pad"] == "p" * 4000
    assert "MessageSizeTooLarge" in kept["last_error"]
