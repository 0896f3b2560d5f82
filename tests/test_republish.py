"""``messenger.republish_outbox`` (migration 0014, docs/delivery.md): the lost
conference-ended event of a room the reaper ended is put back into the outbox,
built again from the room in the phase's own format, with a new event id, and
recorded with who, when and why. Only the operator role may call it."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.exc import DBAPIError

from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.errors import sqlstate
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.roles import function_grants, login

FUNCTION = "messenger.republish_outbox(uuid, text, text, text)"
CALL = "SELECT * FROM messenger.republish_outbox(CAST(:c AS uuid), :topic, :why, 'alice')"
WHY = "INC-7: the broker lost its log"


def outbox_rows(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [
            dict(r._mapping)
            for r in conn.execute(
                text(
                    "SELECT event_id::text, topic, message_key, payload"
                    " FROM messenger.integration_outbox ORDER BY id"
                )
            )
        ]


def closed_room(settings: Settings, engine: Engine) -> dict[str, Any]:
    """A room the reaper ended (empty_room), with a roster and a recording."""
    with engine.begin() as conn:
        room = f.conference(conn, idle=settings.empty_room_grace * 2)
        f.participant(conn, room["id"], joined_at=T0 - timedelta(minutes=20))
        f.participant(
            conn,
            room["id"],
            joined_at=T0 - timedelta(minutes=19),
            left_at=T0 - timedelta(minutes=12),
        )
        f.recording(conn, room["id"], status="Available")
    assert Reaper(settings, engine=engine).run_cycle(T0)["empty_timeout_count"] == 1
    return room


def lose_the_event(engine: Engine) -> dict[str, Any]:
    """The relay's acknowledgement without the broker keeping it: the row gone."""
    [row] = outbox_rows(engine)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM messenger.integration_outbox"))
    return row


def test_the_event_comes_back_as_the_phase_wrote_it_with_a_new_id(settings, engine):
    room = closed_room(settings, engine)
    lost = lose_the_event(engine)
    with engine.begin() as conn:
        done = conn.execute(
            text(CALL), {"c": room["id"], "topic": lost["topic"], "why": f"  {WHY} "}
        ).one()
    [back] = outbox_rows(engine)
    assert back["event_id"] != lost["event_id"] and str(done.event_id) == back["event_id"]
    assert (back["topic"], back["message_key"]) == (lost["topic"], lost["message_key"])
    assert back["payload"]["eventId"] == back["event_id"]
    # the run that closed it is still recorded: its id is the correlation id again
    assert back["payload"]["correlationId"] == lost["payload"]["correlationId"]
    same = {k: v for k, v in back["payload"].items() if k != "eventId"}
    assert same == {k: v for k, v in lost["payload"].items() if k != "eventId"}
    assert len(back["payload"]["payload"]["participants"]) == 2
    assert back["payload"]["payload"]["wasRecorded"] is True
    assert (done.conference_id, done.end_reason, done.reason, done.republished_by) == (
        uuid.UUID(room["id"]),
        "EmptyTimeout",
        WHY,
        "alice",
    )
    assert done.republished_login == "postgres"


def test_it_refuses_what_is_not_lost_or_not_the_reaper_s(settings, engine):
    room = closed_room(settings, engine)
    topic = outbox_rows(engine)[0]["topic"]
    with engine.begin() as conn:
        live = f.conference(conn)
        failed = f.conference(
            conn, status="Failed", end_reason="Error", ended_at=T0 - timedelta(minutes=1)
        )
        normal = f.conference(
            conn, status="Ended", end_reason="Normal", ended_at=T0 - timedelta(minutes=1)
        )
    cases = [
        (room["id"], topic, WHY, "still in the outbox", "55000"),  # pending: not lost
        (live["id"], topic, WHY, "not ended by the reaper", "55000"),
        (failed["id"], topic, WHY, "not ended by the reaper", "55000"),
        (normal["id"], topic, WHY, "not ended by the reaper", "55000"),
        (f.new_id(), topic, WHY, "no conference", "P0002"),
        (room["id"], topic, " ", "a republish needs a reason", "22023"),
        (room["id"], " ", WHY, "a republish needs the topic", "22023"),
    ]
    for target, to, why, message, state in cases:
        with pytest.raises(DBAPIError, match=message) as refused, engine.begin() as conn:
            conn.execute(text(CALL), {"c": target, "topic": to, "why": why})
        assert sqlstate(refused.value) == state, message
    # a discarded event stays discarded: Kafka refuses it for good
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE messenger.integration_outbox SET parked_at = now(), attempts = 1")
        )
        [event_id] = conn.execute(
            text("SELECT event_id FROM messenger.integration_outbox")
        ).scalars()
        conn.execute(
            text("SELECT messenger.discard_outbox(:e, 'too large', 'bob')"), {"e": event_id}
        )
    with pytest.raises(DBAPIError, match="was discarded") as refused, engine.begin() as conn:
        conn.execute(text(CALL), {"c": room["id"], "topic": topic, "why": WHY})
    assert sqlstate(refused.value) == "55000"
    assert outbox_rows(engine) == []


def test_only_the_operator_may_republish_and_it_is_pinned(engine):
    worker, operator, public, definer, config = function_grants(engine, FUNCTION)
    assert (worker, operator, public, definer) == (False, True, False, True)
    assert config == ["search_path=pg_catalog, pg_temp"]


def test_a_worker_login_is_refused_and_an_operator_login_records_itself(
    settings, engine, database_url
):
    room = closed_room(settings, engine)
    lost = lose_the_event(engine)
    params = {"c": room["id"], "topic": lost["topic"], "why": WHY}
    with login(engine, database_url, "reaper_worker") as url:
        worker = create_engine(url)
        try:
            with (
                pytest.raises(DBAPIError, match="permission denied") as refused,
                worker.begin() as conn,
            ):
                conn.execute(text(CALL), params)
            assert sqlstate(refused.value) == "42501"
        finally:
            worker.dispose()
    assert outbox_rows(engine) == []
    with login(engine, database_url, "reaper_operator", prefix="reaper_oper") as url:
        operator = create_engine(url)
        try:
            with operator.begin() as conn:
                done = conn.execute(text(CALL), params).one()
        finally:
            operator.dispose()
        assert done.republished_login == make_url(url).username
    assert len(outbox_rows(engine)) == 1
