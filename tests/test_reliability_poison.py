"""Odd rows, mixed into batches of good ones (docs/design.md#anomalies).

A room whose started_at gives no duration (missing, later than as_of, infinite,
out of int range) is still a stuck room: it is closed like any other, with a
null duration and a ``conference.anomaly`` WARNING. Poison is only a row the
database itself refuses (here a trigger): the batch is retried in halves until
that row is alone; it is left live, logged ``item.failed``, counted once per
cycle; every other row commits; no phase fails. Odd but valid rows are reaped
normally."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, text

from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.events import PhaseCountKey
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.facts import log_records
from tests.support.figures import figure
from tests.support.ledger import assert_clean

STALE = {"idle": timedelta(hours=5), "age": timedelta(hours=6), "participants": 2}
EMPTY = {"idle": timedelta(minutes=5)}

# name -> (kwargs of factory.conference): closed with durationSeconds null
ANOMALIES: dict[str, dict[str, Any]] = {
    "started_at NULL": {"started_at": None},
    "started_at after as_of": {"started_at": T0 + timedelta(hours=1)},
    "started_at +infinity": {"started_at": "infinity"},
    "started_at -infinity": {"started_at": "-infinity"},
    "started_at 100 years ago (duration overflows int)": {"started_at": T0 - timedelta(days=36525)},
}


def _roster_far_future(conn: Connection, row: dict) -> None:
    f.participant(conn, row["id"], joined_at=T0 + timedelta(days=1))


def _roster_big(conn: Connection, row: dict) -> None:
    conn.execute(
        text(
            "INSERT INTO messenger.conference_participants (conference_id, user_id, joined_at)"
            " SELECT :id, gen_random_uuid(), :t - g * interval '1 second'"
            " FROM generate_series(1, 2000) g"
        ),
        {"id": row["id"], "t": T0 - timedelta(minutes=10)},
    )


def _recordings(conn: Connection, row: dict) -> None:
    for status in ("Pending", "Recording", "Uploading", "Available", "Failed"):
        f.recording(conn, row["id"], status=status)
    f.recording(conn, row["id"], status="Recording", created_at="infinity")


def _same_user_twice(conn: Connection, row: dict) -> None:
    user = f.new_id()
    f.participant(conn, row["id"], joined_at=T0 - timedelta(minutes=20), user_id=user)
    f.participant(conn, row["id"], joined_at=T0 - timedelta(minutes=15), user_id=user)


# name -> (kwargs, extra seeding): odd but valid, must be reaped normally
ODD: dict[str, tuple[dict[str, Any], Callable[[Connection, dict], None] | None]] = {
    "last_activity_at -infinity": ({"last_activity_at": "-infinity"}, None),
    "started_at == as_of (duration 0)": ({"started_at": T0}, None),
    "started_at 68 years ago (duration fits)": ({"started_at": T0 - timedelta(days=24800)}, None),
    "peak count at int max": ({"peak_participant_count": 2**31 - 1}, None),
    "Audio": ({"media_type": "Audio"}, None),
    "open roster row joined in the future": ({}, _roster_far_future),
    "2000 open roster rows": ({}, _roster_big),
    "six recordings, one created at +infinity": ({}, _recordings),
    "same user joined twice, never left": ({}, _same_user_twice),
    "updated_at far in the future": ({"updated_at": "infinity"}, None),
}


REFUSED = 3  # rows the database refuses, among the oldest of the batch order


def seed(
    conn: Connection, base: dict[str, Any]
) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    refused, anomalies, odd = {}, {}, {}
    for i in range(REFUSED):
        # first in the batch order (oldest activity): every batch meets them
        row = f.conference(conn, **{**base, "idle": base["idle"] + timedelta(seconds=90 - i)})
        f.refuse(conn, row["id"])
        refused[row["id"]] = "frozen"
    for i, (name, kwargs) in enumerate(ANOMALIES.items()):
        anomalies[
            f.conference(
                conn, **{**base, **kwargs, "idle": base["idle"] + timedelta(seconds=60 - i)}
            )["id"]
        ] = name
    for name, (kwargs, extra) in ODD.items():
        row = f.conference(conn, **{**base, **kwargs})
        if extra:
            extra(conn, row)
        odd[row["id"]] = name
    return refused, anomalies, odd


@pytest.mark.parametrize("phase", ["empty_room", "stale_live"])
@pytest.mark.parametrize("batch_size", [100, 2])
def test_anomalies_are_closed_and_only_refused_rows_are_poison(
    database_url, refusing_database, caplog, phase, batch_size
):
    engine = refusing_database
    caplog.set_level(logging.INFO, "reaper")
    settings = Settings(database_url=database_url, batch_size=batch_size, mass_closure_share=1)
    with engine.begin() as conn:
        refused, anomalies, odd = seed(conn, EMPTY if phase == "empty_room" else STALE)
        good = {
            f.conference(conn, **(EMPTY if phase == "empty_room" else STALE))["id"]
            for _ in range(5)
        }
    key: PhaseCountKey = "empty_timeout_count" if phase == "empty_room" else "stale_timeout_count"
    reason = "EmptyTimeout" if phase == "empty_room" else "Timeout"
    closing = {**anomalies, **odd, **dict.fromkeys(good, "good")}

    for cycle in range(2):  # a second cycle isolates them again, duplicates nothing
        caplog.clear()
        result = Reaper(settings, engine=engine).run_cycle(T0)
        assert result[key] == (len(closing) if cycle == 0 else 0), result
        assert result["failed_count"] == len(refused), result
        records = [r for r in caplog.records if getattr(r, "event", None)]
        assert not [r for r in records if r.event == "phase.failed"]
        failed = {
            r.fields["conference_id"]: r.fields["error"]
            for r in records
            if r.event == "item.failed"
        }
        assert set(failed) == set(refused)
        assert all("frozen by the legal hold" in error for error in failed.values())
        assert all(r.levelno == logging.ERROR for r in records if r.event == "item.failed")
        flagged = {
            r.fields["conference_id"]: r.fields["problem"]
            for r in records
            if r.event == "conference.anomaly"
        }
        if cycle == 0:
            assert set(flagged) == set(anomalies)
            assert all(
                r.levelno == logging.WARNING for r in records if r.event == "conference.anomaly"
            )
            reaped = {r.fields["conference_id"] for r in records if r.event == "conference.reaped"}
            assert reaped == set(closing)
        else:
            assert not flagged

    with engine.connect() as conn:
        states = f.statuses(conn)
        big = conn.execute(
            text("SELECT count(*) FROM messenger.conference_participants WHERE left_at IS NULL")
        ).scalar_one()
        durations = {i: f.session_row(conn, i)["duration_seconds"] for i in closing}
        payloads = {
            e["payload"]["payload"]["conferenceId"]: e["payload"]["payload"] for e in f.outbox(conn)
        }
    assert {states[i] for i in refused} == {("Active", None)}
    assert {states[i] for i in closing} == {("Ended", reason)}
    for conference_id in anomalies:
        assert durations[conference_id] is None
        assert payloads[conference_id]["durationSeconds"] is None
    assert all(durations[i] is not None for i in [*odd, *good])
    assert big == 0  # every roster row closed, the 2000-row one included
    assert_clean(engine)
    figure(
        f"{phase} batch={batch_size}: {len(anomalies)} anomaly kinds closed "
        f"with a null duration ({sorted(set(flagged.values()) or set(anomalies.values()))}); "
        f"{len(refused)} rows the database refuses isolated in both cycles; "
        f"{len(odd)} odd-but-valid kinds + {len(good)} plain rows reaped once"
    )


def test_provisioning_oddities_fail_cleanly(settings, engine, caplog):
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:
        rows = [
            f.conference(conn, status="Provisioning", created_at="-infinity"),
            f.conference(conn, status="Provisioning", age=timedelta(days=36525)),
            f.conference(conn, status="Provisioning", last_activity_at="-infinity"),
        ]
        f.participant(conn, rows[0]["id"], joined_at=T0 + timedelta(days=1))
        f.recording(conn, rows[1]["id"], status="Pending")
    result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["provision_failed_count"] == 3 and result["failed_count"] == 0
    assert not log_records(caplog, "phase.failed")
    assert_clean(engine)
