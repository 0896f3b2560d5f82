"""Active rooms whose last_activity_at is ahead of the database's clock
(docs/design.md#anomalies).

No cut-off reaches them, so no phase selects them. They are held: never
closed by the reaper, but reported by ``reaper plan`` and ``reaper status``,
counted in ``messenger_conf_reaper_activity_ahead`` and alerted. A room a few
seconds ahead (a writer's clock jitter) is not reported; ``-infinity`` is
earlier than every cut-off, so such a room is closed like any other.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine

from reaper import metrics
from reaper.census import measure
from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.events import Bus
from reaper.wiring import Gauges
from tests.support import factory as f
from tests.support.processes import run_cli

GAUGE = "messenger_conf_reaper_activity_ahead"


def seed(engine: Engine) -> dict[str, str]:
    """what -> conference id; the times relative to the database's clock now."""
    now = f.db_now(engine)
    with engine.begin() as conn:
        rows = {
            "an hour ahead": f.conference(
                conn, as_of=now, idle=-timedelta(hours=1), participants=2
            ),
            "infinity": f.conference(conn, as_of=now, last_activity_at="infinity"),
            "a day ahead, stale otherwise": f.conference(
                conn, as_of=now, idle=-timedelta(days=1), age=timedelta(days=3), participants=1
            ),
            "2 s ahead (jitter)": f.conference(conn, as_of=now, idle=-timedelta(seconds=2)),
            "-infinity": f.conference(conn, as_of=now, last_activity_at="-infinity"),
            "overdue": f.conference(conn, as_of=now, idle=timedelta(hours=5), participants=1),
        }
    return {what: row["id"] for what, row in rows.items()}


HELD = ("infinity", "a day ahead, stale otherwise", "an hour ahead")  # furthest ahead first


def test_rooms_ahead_of_the_clock_are_held_and_counted_in_the_gauge(
    settings: Settings, engine: Engine
) -> None:
    ids = seed(engine)
    bus = Bus()
    metrics.subscribe(bus)
    gauges = Gauges(engine, settings, bus)
    reaper = Reaper(settings, engine=engine, bus=bus)
    result = reaper.run_cycle()
    gauges.refresh()
    assert result["empty_timeout_count"] == 1 and result["stale_timeout_count"] == 1
    with engine.connect() as conn:
        status = {what: f.session_row(conn, cid)["status"] for what, cid in ids.items()}
    assert status == {
        "an hour ahead": "Active",
        "infinity": "Active",
        "a day ahead, stale otherwise": "Active",
        "2 s ahead (jitter)": "Active",  # within its grace: not yet eligible
        "-infinity": "Ended",
        "overdue": "Ended",
    }
    measured = measure(engine, settings)
    assert measured is not None and measured.activity_ahead == 3
    assert metrics.sample(GAUGE) == 3
    # a room brought back to the present is no longer one
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE messenger.conference_sessions SET last_activity_at = clock_timestamp()"
            " WHERE id = %s",
            (ids["infinity"],),
        )
    gauges.refresh()
    assert metrics.sample(GAUGE) == 2


def held(conferences: list[dict[str, Any]], ids: dict[str, str]) -> list[str]:
    names = {cid: what for what, cid in ids.items()}
    return [names[c["conference_id"]] for c in conferences]


@pytest.mark.process
def test_plan_and_status_report_the_rooms_ahead_of_the_clock(engine: Engine) -> None:
    ids = seed(engine)
    done = run_cli("plan", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    ahead = plan["activity_ahead"]
    assert ahead["count"] == 3 and ahead["truncated"] is False
    assert held(ahead["conferences"], ids) == list(HELD)
    by_name = dict(zip(held(ahead["conferences"], ids), ahead["conferences"], strict=True))
    assert by_name["infinity"]["last_activity_at"] == "infinity"
    assert by_name["infinity"]["ahead_seconds"] is None
    assert 3500 < by_name["an hour ahead"]["ahead_seconds"] <= 3600
    assert by_name["an hour ahead"]["active_participant_count"] == 2
    # none of them is among the rooms the cycle would close
    would = {c["conference_id"] for p in plan["phases"].values() for c in p["conferences"]}
    assert would == {ids["-infinity"], ids["overdue"]}

    limited = json.loads(run_cli("plan", "--json", "--limit", "1").stdout)["activity_ahead"]
    assert limited["count"] == 3 and limited["truncated"] is True
    assert held(limited["conferences"], ids) == ["infinity"]

    text = run_cli("plan")
    assert text.returncode == 0, text.stderr
    assert "held, never closed: 3 Active with last_activity_at later than" in text.stdout
    assert f"{ids['infinity']}  deal " in text.stdout and "last activity infinity" in text.stdout
    assert f"{ids['an hour ahead']}  deal " in text.stdout

    status = run_cli("status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["activity_ahead"] == 3
    status_text = run_cli("status").stdout
    [line] = [x for x in status_text.splitlines() if x.startswith("activity ahead")]
    assert line.split()[2] == "3" and "never closed" in line


@pytest.mark.process
def test_plan_and_status_say_nothing_when_no_room_is_ahead(engine: Engine) -> None:
    with engine.begin() as conn:
        f.conference(conn, as_of=f.db_now(engine), idle=timedelta(hours=5), participants=1)
    plan = json.loads(run_cli("plan", "--json").stdout)
    assert plan["activity_ahead"]["count"] == 0 and plan["activity_ahead"]["conferences"] == []
    assert "held, never closed" not in run_cli("plan").stdout
    assert json.loads(run_cli("status", "--json").stdout)["activity_ahead"] == 0
    assert "activity ahead" not in run_cli("status").stdout
