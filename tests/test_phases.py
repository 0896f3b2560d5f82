"""The phases' cases (docs/design.md#the-three-phases), one test each, on real PostgreSQL
(the cycle around them is tests/test_cycle.py's)."""

from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta

from sqlalchemy import Engine, text

from reaper import budgets
from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.db import transaction
from reaper.events import BatchSelected, Bus, CycleResult
from reaper.phases import IN_ORDER, ORDER
from reaper.runs import COUNT_KEYS
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.facts import log_events, log_records
from tests.support.figures import figure


def reap(settings: Settings, engine: Engine, as_of=T0, **kwargs) -> CycleResult:
    return Reaper(settings, engine=engine, **kwargs).run_cycle(as_of)


def reported_stops(bus: Bus) -> list:
    """The stop rows the phases report (BatchSelected.stops), as they commit."""
    stops: list = []
    bus.subscribe(BatchSelected, lambda fact: stops.extend(fact.stops))
    return stops


def claim_due_stops(engine: Engine) -> list[tuple[str, str, str]]:
    """What a stop pass would claim now (a window reaching back to T0)."""
    with transaction(engine, budgets.quick(Settings())) as queries:
        rows = queries.claim_stops_due(
            phases=IN_ORDER, window_s=100 * 365 * 86400, lease_s=60, limit=100, holder_pid=None
        )
    return sorted((r.recording_id, r.conference_id, r.end_reason) for r in rows)


def stop_columns(engine: Engine) -> set[tuple[object, object, int]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT stop_requested_at, stop_next_attempt_at, stop_attempts"
                " FROM messenger.call_recordings WHERE stop_requested_at IS NULL"
            )
        )
        return {tuple(r) for r in rows}


def test_empty_batch_is_a_noop(settings, engine):
    with engine.begin() as conn:
        live = f.conference(conn, idle=timedelta(seconds=10))  # within the grace
        ended = f.conference(
            conn, status="Ended", end_reason="Normal", ended_at=T0 - timedelta(hours=1)
        )
    result = reap(settings, engine)
    assert result["skipped"] is False
    assert {k: result[k] for k in COUNT_KEYS} == dict.fromkeys(COUNT_KEYS, 0)
    with engine.connect() as conn:
        assert f.statuses(conn) == {live["id"]: ("Active", None), ended["id"]: ("Ended", "Normal")}
        assert f.session_row(conn, live["id"])["updated_at"] == live["updated_at"]
        assert f.outbox(conn) == [] and f.realtime(conn) == []


def test_empty_room_ends_with_event_and_realtime_row(settings, engine, caplog):
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(seconds=91), peak_participant_count=3)
        alice = f.participant(
            conn,
            room["id"],
            joined_at=T0 - timedelta(minutes=20),
            left_at=T0 - timedelta(seconds=91),
        )
        bob = f.participant(conn, room["id"], joined_at=T0 - timedelta(minutes=15))  # never left
    result = reap(settings, engine)
    assert result["empty_timeout_count"] == 1
    with engine.connect() as conn:
        row = f.session_row(conn, room["id"])
        assert (row["status"], row["end_reason"]) == ("Ended", "EmptyTimeout")
        assert row["ended_at"] == row["updated_at"] == T0
        assert row["duration_seconds"] == int((T0 - room["started_at"]).total_seconds())
        assert row["active_participant_count"] == 0
        left = conn.execute(
            text("SELECT user_id::text, left_at FROM messenger.conference_participants")
        ).all()
        assert {(u, t) for u, t in left} == {
            (alice["user_id"], T0 - timedelta(seconds=91)),
            (bob["user_id"], T0),
        }
        [event] = f.outbox(conn)
        [push] = f.realtime(conn)
    assert event["topic"] == "pin.messenger.conference-ended.v1"
    assert event["message_key"] == room["deal_id"]
    assert event["published_at"] is None and event["attempts"] == 0
    assert event["payload"] == {
        "eventId": str(event["event_id"]),
        "eventType": "pin.messenger.conference-ended.v1",
        "occurredAt": "2026-12-02T10:00:00Z",
        "correlationId": result["run_id"],
        "aggregateId": room["deal_id"],
        "payload": {
            "conferenceId": room["id"],
            "chatId": room["chat_id"],
            "dealId": room["deal_id"],
            "tenantId": room["tenant_id"],
            "mediaType": "Video",
            "status": "Ended",
            "endReason": "EmptyTimeout",
            "startedByUserId": room["started_by_user_id"],
            "startedAt": "2026-12-02T09:30:05Z",
            "endedAt": "2026-12-02T10:00:00Z",
            "durationSeconds": 1795,
            "peakParticipantCount": 3,
            "participants": [
                {
                    "userId": alice["user_id"],
                    "joinedAt": "2026-12-02T09:40:00Z",
                    "leftAt": "2026-12-02T09:58:29Z",
                },
                {
                    "userId": bob["user_id"],
                    "joinedAt": "2026-12-02T09:45:00Z",
                    "leftAt": "2026-12-02T10:00:00Z",
                },
            ],
            "participantsOmitted": 0,
            "wasRecorded": False,
            "recordingId": None,
        },
    }
    assert (push["kind"], push["target_kind"], push["session_kind"]) == (
        "ConferenceEnded",
        "ChatGroup",
        "Conference",
    )
    assert (str(push["chat_id"]), str(push["conference_id"])) == (room["chat_id"], room["id"])
    assert push["payload"] == {
        "conferenceId": room["id"],
        "chatId": room["chat_id"],
        "status": "Ended",
        "endReason": "EmptyTimeout",
        "signal": "Ended",
    }
    [reaped] = log_events(caplog, "conference.reaped")
    assert reaped == {
        "run_id": result["run_id"],
        "phase": "empty_room",
        "conference_id": room["id"],
        "chat_id": room["chat_id"],
        "deal_id": room["deal_id"],
        "status": "Ended",
        "end_reason": "EmptyTimeout",
        "duration_seconds": 1795,
    }
    assert log_events(caplog, "cycle.started")[0]["as_of"] == "2026-12-02T10:00:00Z"
    assert log_events(caplog, "cycle.completed")[0]["empty_timeout_count"] == 1
    assert {e["phase"] for e in log_events(caplog, "batch.selected")} == set(ORDER)


def test_grace_boundary_is_inclusive(settings, engine):
    with engine.begin() as conn:
        at = f.conference(conn, idle=timedelta(seconds=90))
        before = f.conference(conn, idle=timedelta(seconds=89, microseconds=999_999))
    reap(settings, engine)
    with engine.connect() as conn:
        assert f.statuses(conn) == {
            at["id"]: ("Ended", "EmptyTimeout"),
            before["id"]: ("Active", None),
        }


def test_someone_joined_within_grace_is_left_alone(settings, engine):
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=10), participants=1)
    result = reap(settings, engine)
    assert result["empty_timeout_count"] == 0
    with engine.connect() as conn:
        assert f.statuses(conn) == {room["id"]: ("Active", None)}
        assert f.outbox(conn) == []


def test_provision_timeout_fails_without_integration_event(settings, engine):
    with engine.begin() as conn:
        stuck = f.conference(conn, status="Provisioning", age=timedelta(minutes=2))
        fresh = f.conference(conn, status="Provisioning", age=timedelta(seconds=119))
    result = reap(settings, engine)
    assert result["provision_failed_count"] == 1
    with engine.connect() as conn:
        row = f.session_row(conn, stuck["id"])
        assert (row["status"], row["end_reason"], row["ended_at"]) == ("Failed", "Error", T0)
        assert row["started_at"] is None and row["duration_seconds"] is None
        assert f.statuses(conn)[fresh["id"]] == ("Provisioning", None)
        assert f.outbox(conn) == []
        [push] = f.realtime(conn)
    assert push["kind"] == "ConferenceSignal"
    assert push["payload"]["signal"] == "Failed"
    assert str(push["conference_id"]) == stuck["id"]


def test_stale_live_ends_with_timeout_and_event(settings, engine):
    with engine.begin() as conn:
        stale = f.conference(conn, idle=timedelta(hours=4), participants=2, age=timedelta(hours=6))
        alive = f.conference(
            conn, idle=timedelta(hours=3, minutes=59), participants=2, age=timedelta(hours=6)
        )
    result = reap(settings, engine)
    assert result["stale_timeout_count"] == 1 and result["empty_timeout_count"] == 0
    with engine.connect() as conn:
        assert f.statuses(conn) == {
            stale["id"]: ("Ended", "Timeout"),
            alive["id"]: ("Active", None),
        }
        [event] = f.outbox(conn)
        assert f.session_row(conn, stale["id"])["active_participant_count"] == 0
    assert event["payload"]["payload"]["endReason"] == "Timeout"
    assert event["payload"]["payload"]["conferenceId"] == stale["id"]


def test_active_recording_is_named_in_the_event_and_reported_for_stop(settings, engine):
    """The phase reports the running recording and marks nothing: its stop is
    durable state (the room ended, the recording running, no stop requested),
    due at once to the stop pass."""
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5))
        old = f.recording(conn, room["id"], status="Available", created_at=T0 - timedelta(hours=1))
        live = f.recording(conn, room["id"], status="Recording")
        done_room = f.conference(conn, idle=timedelta(minutes=5))
        f.recording(conn, done_room["id"], status="Available")
    bus = Bus()
    stops = reported_stops(bus)
    reap(settings, engine, bus=bus)
    assert [(s.recording_id, s.conference_id, s.reason) for s in stops] == [
        (live["id"], room["id"], "EmptyTimeout")
    ]
    with engine.connect() as conn:
        events_by_room = {e["payload"]["payload"]["conferenceId"]: e for e in f.outbox(conn)}
    assert events_by_room[room["id"]]["payload"]["payload"]["wasRecorded"] is True
    assert events_by_room[room["id"]]["payload"]["payload"]["recordingId"] == live["id"]
    assert events_by_room[done_room["id"]]["payload"]["payload"]["wasRecorded"] is True
    assert old["id"] != live["id"]
    # the batch statement marked nothing: no stop requested, no attempt, no lease
    assert stop_columns(engine) == {(None, None, 0)}
    assert claim_due_stops(engine) == [(live["id"], room["id"], "EmptyTimeout")]


def test_every_running_recording_of_a_room_is_stopped_once(settings, engine):
    """One read of a room's recordings serves the event and the stop signals: all
    running ones are reported and due, one already asked to stop is not, the
    latest names the event; a room without recordings says so."""
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5))
        hours = [T0 - timedelta(hours=n) for n in range(4)]
        first = f.recording(conn, room["id"], status="Recording", created_at=hours[2])
        second = f.recording(conn, room["id"], status="Uploading", created_at=hours[1])
        asked = f.recording(conn, room["id"], status="Recording", created_at=hours[3])
        conn.execute(
            text("UPDATE messenger.call_recordings SET stop_requested_at = :t WHERE id = :id"),
            {"t": T0 - timedelta(minutes=1), "id": asked["id"]},
        )
        bare = f.conference(conn, idle=timedelta(minutes=5))
    bus = Bus()
    stops = reported_stops(bus)
    result = reap(settings, engine, bus=bus)
    assert result["empty_timeout_count"] == 2
    assert sorted(s.recording_id for s in stops) == sorted([first["id"], second["id"]])
    assert [due[0] for due in claim_due_stops(engine)] == sorted([first["id"], second["id"]])
    assert claim_due_stops(engine) == []  # claimed: leased to that pass, not due again
    with engine.connect() as conn:
        events = {
            e["payload"]["payload"]["conferenceId"]: e["payload"]["payload"] for e in f.outbox(conn)
        }
    assert (events[room["id"]]["wasRecorded"], events[room["id"]]["recordingId"]) == (
        True,
        second["id"],
    )
    assert (events[bare["id"]]["wasRecorded"], events[bare["id"]]["recordingId"]) == (False, None)
    assert len(events) == 2


def test_second_cycle_is_a_guarded_noop(settings, engine):
    with engine.begin() as conn:
        f.conference(conn, idle=timedelta(minutes=5))
        f.conference(conn, status="Provisioning", age=timedelta(minutes=5))
        f.conference(conn, idle=timedelta(hours=5), participants=1)
    first = reap(settings, engine)
    with engine.connect() as conn:
        before = (f.statuses(conn), len(f.outbox(conn)), len(f.realtime(conn)))
    second = reap(settings, engine, as_of=T0 + timedelta(minutes=1))
    assert (
        first["empty_timeout_count"],
        first["provision_failed_count"],
        first["stale_timeout_count"],
    ) == (1, 1, 1)
    assert (
        second["empty_timeout_count"],
        second["provision_failed_count"],
        second["stale_timeout_count"],
    ) == (0, 0, 0)
    with engine.connect() as conn:
        assert (f.statuses(conn), len(f.outbox(conn)), len(f.realtime(conn))) == before
    assert before[1:] == (2, 3)


def test_race_with_end_conference_row_locked_is_skipped_not_waited(settings, engine):
    with engine.begin() as conn:
        busy = f.conference(conn, idle=timedelta(minutes=5))
        free = f.conference(conn, idle=timedelta(minutes=4))
    with f.command_holding(engine, busy["id"]) as (command, tx):
        done = threading.Event()
        result: dict = {}

        def run() -> None:
            result.update(reap(settings, engine))
            done.set()

        runner = threading.Thread(target=run)
        runner.start()
        assert done.wait(10), "the reaper waited on a row lock"
        # the command now ends the conference itself
        command.execute(
            text(
                "UPDATE messenger.conference_sessions SET status='Ended', end_reason='Normal', "
                "ended_at=:t, updated_at=:t WHERE id=:id"
            ),
            {"t": T0, "id": busy["id"]},
        )
        tx.commit()
    assert result["empty_timeout_count"] == 1
    assert result["skipped_locked_count"] == 1
    again = reap(settings, engine)
    assert again["empty_timeout_count"] == 0 and again["skipped_locked_count"] == 0
    with engine.connect() as conn:
        assert f.statuses(conn) == {
            busy["id"]: ("Ended", "Normal"),
            free["id"]: ("Ended", "EmptyTimeout"),
        }
        assert [e["payload"]["payload"]["conferenceId"] for e in f.outbox(conn)] == [free["id"]]


def test_a_row_held_through_full_batches_is_counted_once_the_phase_runs_short(settings, engine):
    """Full batches step over a held row without counting it; the batch that comes
    back short finds it still held: left for the next cycle, counted once."""
    with engine.begin() as conn:
        busy = f.conference(conn, idle=timedelta(minutes=9))  # the oldest: met by every batch
        free = [f.conference(conn, idle=timedelta(minutes=8 - i)) for i in range(4)]
    with f.command_holding(engine, busy["id"]):
        small = settings.model_copy(update={"batch_size": 2, "drain_lanes": 1})
        result = reap(small, engine)
    assert (result["empty_timeout_count"], result["skipped_locked_count"]) == (4, 1)
    again = reap(settings, engine)
    assert (again["empty_timeout_count"], again["skipped_locked_count"]) == (1, 0)
    with engine.connect() as conn:
        assert {i for i, (status, _) in f.statuses(conn).items() if status == "Ended"} == {
            busy["id"],
            *(room["id"] for room in free),
        }


def test_race_with_end_conference_already_ended_is_not_selected(settings, engine):
    with engine.begin() as conn:
        room = f.conference(
            conn, status="Ended", end_reason="Normal", ended_at=T0, idle=timedelta(minutes=5)
        )
    result = reap(settings, engine)
    assert result["empty_timeout_count"] == result["skipped_locked_count"] == 0
    with engine.connect() as conn:
        assert f.statuses(conn) == {room["id"]: ("Ended", "Normal")}


def test_poison_row_is_isolated_and_the_rest_commits(settings, refusing_database, caplog):
    """Poison: a row the database refuses (docs/design.md#anomalies)."""
    engine = refusing_database
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:
        poison = f.conference(conn, idle=timedelta(minutes=10))
        future = f.conference(conn, idle=timedelta(minutes=9))
        good = f.conference(conn, idle=timedelta(minutes=5))
        f.refuse(conn, poison["id"])
        f.refuse(conn, future["id"])
    result = reap(settings, engine)
    assert result["empty_timeout_count"] == 1
    assert result["failed_count"] == 2  # counted once, though stale_live could see them too
    with engine.connect() as conn:
        assert f.statuses(conn) == {
            poison["id"]: ("Active", None),
            future["id"]: ("Active", None),
            good["id"]: ("Ended", "EmptyTimeout"),
        }
    failed = log_events(caplog, "item.failed")
    assert {e["conference_id"] for e in failed} == {poison["id"], future["id"]}
    assert all(r.levelno == logging.ERROR for r in log_records(caplog, "item.failed"))


def test_poison_rows_filling_a_batch_do_not_block_the_rest(database_url, refusing_database):
    engine = refusing_database
    settings = Settings(database_url=database_url, batch_size=2)
    with engine.begin() as conn:
        for minutes in (20, 19, 18):
            f.refuse(conn, f.conference(conn, idle=timedelta(minutes=minutes))["id"])
        good = [f.conference(conn, idle=timedelta(minutes=m)) for m in (5, 4, 3)]
    result = reap(settings, engine)
    assert result["failed_count"] == 3 and result["empty_timeout_count"] == 3
    with engine.connect() as conn:
        assert all(f.statuses(conn)[g["id"]] == ("Ended", "EmptyTimeout") for g in good)


def test_a_row_read_after_a_refused_batch_is_poison_only_once_refused_alone(
    database_url, refusing_database, monkeypatch
):
    """A lane beside this one may isolate the refused row first, so the rows read
    again after a refused batch can all be good ones; none of them is poison until
    the database has refused it alone (seen under load: a good room failed with its
    batch-mate's error)."""
    import reaper.cycle
    import reaper.phases

    engine = refusing_database
    settings = Settings(database_url=database_url, batch_size=2, drain_lanes=1)
    with engine.begin() as conn:
        bad = f.conference(conn, idle=timedelta(minutes=20))["id"]
        f.refuse(conn, bad)
        good = f.conference(conn, idle=timedelta(minutes=19))["id"]
    read_again = reaper.phases.candidates
    calls = []

    def another_lane_took_the_bad_row(*args, **kwargs):
        calls.append(1)
        return [i for i in read_again(*args, **kwargs) if i != bad]

    monkeypatch.setattr(reaper.cycle, "candidates", another_lane_took_the_bad_row)
    result = reap(settings, engine)
    assert calls, "the refused batch was never read again"
    with engine.connect() as conn:
        assert f.statuses(conn)[good] == ("Ended", "EmptyTimeout")
    assert result["empty_timeout_count"] == 1


def test_backlog_of_5000_drains_in_one_cycle(settings, engine):
    with engine.begin() as conn:
        f.bulk_conferences(conn, 5000)
    result = Reaper(settings, engine=engine).run_cycle(T0)  # real clock: real duration
    assert result["empty_timeout_count"] == 5000
    with engine.connect() as conn:
        counts = conn.execute(
            text(
                "SELECT (SELECT count(*) FROM messenger.conference_sessions WHERE status='Ended'),"
                " (SELECT count(DISTINCT message_key) FROM messenger.integration_outbox),"
                " (SELECT count(*) FROM messenger.realtime_outbox)"
            )
        ).one()
    assert tuple(counts) == (5000, 5000, 5000)
    figure(
        f"5000-room backlog drained in one cycle: {result['duration_ms']} ms "
        f"({json.dumps({k: v for k, v in result.items() if k.endswith('_count')})})"
    )
