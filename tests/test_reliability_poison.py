"""Poison rows: every odd row the schema's constraints allow, mixed into batches
of good ones. A row the transition cannot take is isolated (left live, logged
``item.failed``, counted once per cycle); the rest of the batch commits; no
phase fails; odd but valid rows are reaped normally."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, text

from reaper.config import Settings
from reaper.cycle import Reaper
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.invariants import audit_engine

STALE = {"idle": timedelta(hours=5), "age": timedelta(hours=6), "participants": 2}
EMPTY = {"idle": timedelta(minutes=5)}

# name -> (kwargs of factory.conference), for both Active phases
POISON: dict[str, dict[str, Any]] = {
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


def seed(conn: Connection, base: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    poison, odd = {}, {}
    for i, (name, kwargs) in enumerate(POISON.items()):
        # poison first in the batch order (oldest activity)
        poison[
            f.conference(
                conn, **{**base, **kwargs, "idle": base["idle"] + timedelta(seconds=60 - i)}
            )["id"]
        ] = name
    for name, (kwargs, extra) in ODD.items():
        row = f.conference(conn, **{**base, **kwargs})
        if extra:
            extra(conn, row)
        odd[row["id"]] = name
    return poison, odd


@pytest.mark.parametrize("phase", ["empty_room", "stale_live"])
@pytest.mark.parametrize("batch_size", [100, 2])
def test_poison_is_isolated_and_the_rest_commits(
    database_url, engine, caplog, capsys, phase, batch_size
):
    caplog.set_level(logging.INFO, "reaper")
    settings = Settings(database_url=database_url, batch_size=batch_size, mass_closure_share=1)
    with engine.begin() as conn:
        poison, odd = seed(conn, EMPTY if phase == "empty_room" else STALE)
        good = {
            f.conference(conn, **(EMPTY if phase == "empty_room" else STALE))["id"]
            for _ in range(5)
        }
    key = "empty_timeout_count" if phase == "empty_room" else "stale_timeout_count"
    reason = "EmptyTimeout" if phase == "empty_room" else "Timeout"

    for cycle in range(2):  # a second cycle isolates them again, duplicates nothing
        caplog.clear()
        result = Reaper(settings, engine=engine).run_cycle(T0)
        assert result[key] == (len(odd) + len(good) if cycle == 0 else 0), result
        assert result["failed_count"] == len(poison), result
        records = [r for r in caplog.records if getattr(r, "event", None)]
        assert not [r for r in records if r.event == "phase.failed"]
        failed = {
            r.fields["conference_id"]: r.fields["error"]
            for r in records
            if r.event == "item.failed"
        }
        assert set(failed) == set(poison)
        assert all(r.levelno == logging.ERROR for r in records if r.event == "item.failed")

    with engine.connect() as conn:
        states = f.statuses(conn)
        big = conn.execute(
            text("SELECT count(*) FROM messenger.conference_participants WHERE left_at IS NULL")
        ).scalar_one()
    assert {states[i] for i in poison} == {("Active", None)}
    assert {states[i] for i in [*odd, *good]} == {("Ended", reason)}
    assert big == 0  # every roster row closed, the 2000-row one included
    audit_engine(engine).assert_clean()
    with capsys.disabled():
        print(
            f"\n[figures] poison {phase} batch={batch_size}: {len(poison)} poison kinds isolated "
            f"twice, {len(odd)} odd-but-valid kinds + {len(good)} plain rows reaped once; "
            f"reasons: {sorted(set(failed.values()))}"
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
    assert not [r for r in caplog.records if getattr(r, "event", None) == "phase.failed"]
    audit_engine(engine).assert_clean()
