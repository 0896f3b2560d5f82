"""The ledger (reaper/ledger.py, docs/delivery.md): the pure verdict for every
category, then against the real PostgreSQL (and Tansu, in the process layer)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from reaper.clock import rfc3339
from reaper.cycle import Reaper
from reaper.ledger import Closing, Ledger, Pending, Push, Record, judge, moment, parse_moment
from tests.support import factory as f
from tests.support.factory import T0

SINCE, UNTIL = T0 - timedelta(hours=1), T0 + timedelta(hours=1)


def room(reason: str = "EmptyTimeout", at: datetime = T0, deal: str | None = None) -> Closing:
    status = "Failed" if reason == "Error" else "Ended"
    return Closing(str(uuid.uuid4()), deal or str(uuid.uuid4()), status, reason, at)


def event(c: Closing, event_id: str | None = None, **changed: Any) -> dict[str, Any]:
    payload = {
        "conferenceId": c.conference_id,
        "dealId": c.deal_id,
        "status": c.status,
        "endReason": c.end_reason,
        "endedAt": rfc3339(c.ended_at) if c.ended_at else None,
    }
    payload.update(changed)
    return {"eventId": event_id or str(uuid.uuid4()), "payload": payload}


def record(c: Closing, value: dict[str, Any], offset: int, partition: int = 0) -> Record:
    return Record(c.deal_id, json.dumps(value).encode(), partition, offset, 0)


def pushes(*closings: Closing) -> list[Push]:
    kinds = {"Ended": "ConferenceEnded", "Failed": "ConferenceSignal"}
    return [Push(c.conference_id, kinds[c.status]) for c in closings]


def verdict(closings, pending=(), records=(), push=None, **kw):
    return judge(
        closings,
        pending,
        pushes(*closings) if push is None else push,
        records,
        since=SINCE,
        until=UNTIL,
        **kw,
    )


def test_a_clean_ledger_counts_by_end_reason():
    a, b, c = room(), room("Timeout"), room("Error")
    v = verdict(
        [a, b, c],
        pending=[Pending(str(uuid.uuid4()), b.deal_id, event(b))],
        records=[record(a, event(a), 0)],
    )
    assert v.ok, v.summary()
    assert v.counts() == {
        "lost": 0,
        "unexpected": 0,
        "duplicated": 0,
        "out_of_order": 0,
        "realtime": 0,
        "closings": 3,
        "on_kafka": 1,
        "pending": 1,
        "redelivered": 0,
        "discarded": 0,
        "records": 1,
    }
    assert v.by_end_reason["EmptyTimeout"]["on_kafka"] == 1
    assert v.by_end_reason["Timeout"]["pending"] == 1
    assert v.by_end_reason["Error"]["closed"] == 1
    assert v.summary()[-1] == "clean"
    assert json.loads(json.dumps(v.to_json()))["ok"] is True


def test_lost_a_closed_room_whose_event_is_neither_pending_nor_on_kafka():
    a, b = room(), room("Timeout")
    v = verdict([a, b], records=[record(a, event(a), 0)])
    assert not v.ok and [x.conference_id for x in v.lost] == [b.conference_id]
    assert v.by_end_reason["Timeout"]["lost"] == 1
    assert f"  lost: conference {b.conference_id}" in "\n".join(v.summary())
    assert v.to_json()["examples"]["lost"][0]["conference_id"] == b.conference_id


def test_a_discarded_event_is_on_the_record_not_lost():
    a = room()
    v = verdict([a], discarded={a.conference_id})
    assert v.ok and len(v.discarded) == 1 and v.lost == []


def test_unexpected_events():
    a, failed = room(), room("Error")
    live = Closing(str(uuid.uuid4()), str(uuid.uuid4()), "Active", None, None)
    earlier = room(at=SINCE - timedelta(hours=5))  # closed before the window: out of scope
    stranger = room()  # no such room in the database
    records = [
        record(a, event(a), 0),
        record(a, event(a, endReason="Timeout"), 1),  # closed otherwise
        record(a, event(a, endedAt=rfc3339(T0 + timedelta(seconds=1))), 2),  # another time
        record(failed, event(failed, status="Ended"), 3),  # a Failed room has no event
        record(live, event(live, status="Ended", endReason="EmptyTimeout"), 4),
        record(earlier, event(earlier), 5),
        record(stranger, event(stranger), 6),
        Record(a.deal_id, b"not json", 0, 7, 0),
    ]
    v = verdict([a, failed], records=records, rooms=[live, earlier])
    assert len(v.unexpected) == 6, v.summary()
    assert v.lost == [] and v.duplicated == []
    details = " | ".join(x.detail for x in v.unexpected)
    for said in (
        "it says Ended/Timeout",
        "the room is Failed/Error",
        "the room is Active/None",
        "no such room",
        "unreadable event",
    ):
        assert said in details, said


def test_a_pending_event_of_a_live_room_is_unexpected():
    live = Closing(str(uuid.uuid4()), str(uuid.uuid4()), "Active", None, None)
    bogus = Pending(str(uuid.uuid4()), live.deal_id, event(live, status="Ended"))
    v = verdict([], pending=[bogus], rooms=[live])
    assert [x.conference_id for x in v.unexpected] == [live.conference_id]


def test_duplicated_one_closing_two_event_ids_redelivered_one_id_twice():
    a, b = room(), room()
    first = event(a)
    v = verdict(
        [a, b],
        pending=[Pending(str(uuid.uuid4()), b.deal_id, event(b))],
        records=[
            record(a, first, 0),
            record(a, first, 1),  # the same id again: at-least-once
            record(a, event(a), 2),  # a second id for one closing: a failure
            record(b, event(b), 0, partition=1),  # on Kafka and, another id, pending
        ],
    )
    assert v.redelivered == 1
    assert sorted(x.conference_id for x in v.duplicated) == sorted(
        [a.conference_id, b.conference_id]
    )
    assert v.lost == [] and v.unexpected == []
    # the same id pending and on Kafka (sent, acknowledgement not committed): one event
    same = event(a)
    v = verdict(
        [a], pending=[Pending(same["eventId"], a.deal_id, same)], records=[record(a, same, 0)]
    )
    assert v.ok and v.on_kafka == 1


def test_out_of_order_a_deal_s_events_not_in_the_order_of_its_closings():
    deal = str(uuid.uuid4())
    early, late = room(at=T0, deal=deal), room(at=T0 + timedelta(minutes=1), deal=deal)
    in_order = verdict(
        [early, late], records=[record(early, event(early), 0), record(late, event(late), 1)]
    )
    assert in_order.ok
    swapped = event(early)
    v = verdict([early, late], records=[record(late, event(late), 0), record(early, swapped, 1)])
    assert [x.conference_id for x in v.out_of_order] == [early.conference_id]
    # put back by an operator: after its deal's later events by construction
    v = verdict(
        [early, late],
        records=[record(late, event(late), 0), record(early, swapped, 1)],
        republished={swapped["eventId"]},
    )
    assert v.ok


def test_realtime_exactly_one_push_row_of_the_phase_s_kind():
    a, b, c, failed = room(), room(), room(), room("Error")
    push = [
        Push(a.conference_id, "ConferenceEnded"),
        Push(b.conference_id, "ConferenceEnded"),
        Push(b.conference_id, "ConferenceEnded"),  # two
        Push(failed.conference_id, "ConferenceEnded"),  # the wrong kind
    ]  # c: none
    records = [record(x, event(x), i) for i, x in enumerate((a, b, c))]
    v = verdict([a, b, c, failed], records=records, push=push)
    assert sorted(x.conference_id for x in v.realtime) == sorted(
        [b.conference_id, c.conference_id, failed.conference_id]
    )


def test_fifty_thousand_closings_are_judged_in_a_few_seconds():
    import time

    closings = [room() for _ in range(50_000)]
    records = [record(c, event(c), i) for i, c in enumerate(closings)]
    started = time.monotonic()
    v = verdict(closings, records=records)
    took = time.monotonic() - started
    assert v.ok and v.on_kafka == 50_000
    assert took < 10, took


# -- against PostgreSQL (the topic not read: no relay ran) ----------------------


def test_the_old_check_missed_a_lost_event_the_ledger_catches_it(settings, engine):
    """The plant of issue 36: a room closed whose outbox row is gone, never sent.
    The old VIOLATIONS query (its terms on LEFT JOINs: NULL for a room without
    an integration row) reported nothing; the ledger names the room."""
    with engine.begin() as conn:
        rooms = [f.conference(conn, idle=settings.empty_room_grace * 2) for _ in range(3)]
    assert Reaper(settings, engine=engine).run_cycle(T0)["empty_timeout_count"] == 3
    ledger = Ledger(settings, engine, kafka=False)
    assert ledger.check(SINCE, UNTIL).ok
    victim = rooms[1]["id"]
    with engine.begin() as conn:
        conn.execute(
            text(
                "DELETE FROM messenger.integration_outbox"
                " WHERE payload->'payload'->>'conferenceId' = :c"
            ),
            {"c": victim},
        )
        assert conn.execute(OLD_VIOLATIONS).all() == []  # what the old check said
    v = ledger.check(SINCE, UNTIL)
    assert [x.conference_id for x in v.lost] == [victim], v.summary()
    assert v.pending == 2 and v.by_end_reason["EmptyTimeout"]["lost"] == 1


def test_the_window_and_the_database_s_rows(settings, engine):
    with engine.begin() as conn:
        old = f.conference(conn, as_of=T0 - timedelta(days=1), idle=settings.empty_room_grace * 2)
        live = f.conference(conn, participants=1)
    Reaper(settings, engine=engine).run_cycle(T0 - timedelta(days=1))
    with engine.begin() as conn:
        new = f.conference(conn, idle=settings.empty_room_grace * 2)
    Reaper(settings, engine=engine).run_cycle(T0)
    ledger = Ledger(settings, engine, kafka=False)
    v = ledger.check(SINCE, UNTIL)
    # the room closed the day before is out of the window, its pending event too
    assert v.ok and v.closings == 1 and v.pending == 1, v.summary()
    assert {old["id"], new["id"]}.isdisjoint({x.conference_id for x in v.unexpected})
    # an event written for a room still live
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload)"
                " SELECT gen_random_uuid(), 't', deal_id::text, jsonb_build_object("
                "  'eventId', gen_random_uuid(), 'payload', jsonb_build_object("
                "  'conferenceId', id, 'status', 'Ended', 'endReason', 'EmptyTimeout'))"
                " FROM messenger.conference_sessions WHERE id = :c"
            ),
            {"c": live["id"]},
        )
        conn.execute(
            text("DELETE FROM messenger.realtime_outbox WHERE conference_id = :c"),
            {"c": new["id"]},
        )
    v = ledger.check(SINCE, UNTIL)
    assert [x.conference_id for x in v.unexpected] == [live["id"]]
    assert [x.conference_id for x in v.realtime] == [new["id"]]
    # a room left out (seeded closed by the test): neither judged nor unexpected
    assert (
        Ledger(settings, engine, kafka=False, exclude=[live["id"], new["id"]])
        .check(SINCE, UNTIL)
        .ok
    )


OLD_VIOLATIONS = text(
    """
    WITH integ AS (
        SELECT (payload->'payload'->>'conferenceId')::uuid AS id, count(*) AS n,
               count(DISTINCT event_id) AS events
        FROM messenger.integration_outbox GROUP BY 1
    ), rt AS (
        SELECT conference_id AS id, count(*) AS n,
               count(*) FILTER (WHERE kind = 'ConferenceEnded') AS ended,
               count(*) FILTER (WHERE kind = 'ConferenceSignal') AS signal
        FROM messenger.realtime_outbox GROUP BY 1
    )
    SELECT s.id
    FROM messenger.conference_sessions s
    LEFT JOIN integ i ON i.id = s.id
    LEFT JOIN rt r ON r.id = s.id
    WHERE NOT (
        (s.status = 'Ended' AND i.n = 1 AND i.events = 1 AND r.ended = 1 AND r.n = 1)
        OR (s.status = 'Failed' AND i.n IS NULL AND r.signal = 1 AND r.n = 1)
        OR (s.status IN ('Active', 'Provisioning') AND i.n IS NULL AND r.n IS NULL))
    """
)


def test_since_and_until_take_a_moment_or_a_duration_ago():
    now = datetime(2026, 12, 3, 6, 0, tzinfo=UTC)
    for given, meant in (
        ("2h", now - timedelta(hours=2)),
        ("30m", now - timedelta(minutes=30)),
        ("1d", now - timedelta(days=1)),
        ("1h30m", now - timedelta(minutes=90)),
        ("45s", now - timedelta(seconds=45)),
        ("2026-12-02T22:00:00Z", datetime(2026, 12, 2, 22, tzinfo=UTC)),
        ("2026-12-02T22:00:00", datetime(2026, 12, 2, 22, tzinfo=UTC)),  # UTC without offset
        ("2026-12-02T23:00:00+01:00", datetime(2026, 12, 2, 22, tzinfo=UTC)),
    ):
        assert moment(parse_moment(given), now) == meant, given
    for bad in ("", "2", "h", "-2h", "0m", "yesterday", "2h30"):
        with pytest.raises(ValueError):
            parse_moment(bad)


def test_a_bootstrap_that_times_out_once_is_tried_again_then_the_read_fails():
    """A broker just restarted can let one bootstrap time out; the ledger tries
    budgets.LEDGER_KAFKA_CONNECTS times before it gives no verdict (a campaign
    saw a healed outage end with 'could not read' on one slow bootstrap)."""
    from reaper import budgets
    from reaper.config import Settings
    from reaper.ledger import KafkaUnreadable, connect

    class Refused(Exception):
        pass

    def failing(times: int):
        tries: list[dict[str, Any]] = []

        def consumer(**config: Any) -> object:
            tries.append(config)
            if len(tries) <= times:
                raise Refused(f"timed out bootstrapping (try {len(tries)})")
            return "consumer"

        return consumer, tries

    settings = Settings()
    consumer, tries = failing(budgets.LEDGER_KAFKA_CONNECTS - 1)
    assert connect(settings, consumer, Refused) == "consumer"
    assert len(tries) == budgets.LEDGER_KAFKA_CONNECTS
    consumer, tries = failing(budgets.LEDGER_KAFKA_CONNECTS)
    with pytest.raises(KafkaUnreadable, match="try 3"):
        connect(settings, consumer, Refused)
    assert len(tries) == budgets.LEDGER_KAFKA_CONNECTS
