"""Operator CLI: ``reaper plan`` (dry run) and ``reaper status``, against real PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, make_url, text

from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.overview import plan
from reaper.phases import IN_ORDER, ORDER, STALE_LIVE, cutoffs
from reaper.queries import Queries
from reaper.release import SCHEMA_KNOWN, SCHEMA_NEEDED, version
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.processes import ROOT

REAPER = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "reaper")
# what a room became says which phase closed it
PHASE_OF_REASON = {(p.status, p.end_reason): p.name for p in IN_ORDER}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [REAPER, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def seed_mixed(engine: Engine) -> dict[str, str]:
    """One of every case the phases tell apart; returns id -> what it is."""
    seeded: dict[str, str] = {}
    cases: dict[str, dict[str, Any]] = {
        "empty": {"idle": timedelta(seconds=91)},
        "empty_at_cutoff": {"idle": timedelta(seconds=90)},
        "empty_in_grace": {"idle": timedelta(seconds=89)},
        "occupied_recent": {"idle": timedelta(minutes=10), "participants": 2},
        "empty_and_stale": {"idle": timedelta(hours=5)},
        "stale_occupied": {"idle": timedelta(hours=4, seconds=1), "participants": 3},
        "stale_at_cutoff": {"idle": timedelta(hours=4), "participants": 1},
        "provision_old": {"status": "Provisioning", "age": timedelta(minutes=3)},
        "provision_at_cutoff": {"status": "Provisioning", "age": timedelta(minutes=2)},
        "provision_young": {"status": "Provisioning", "age": timedelta(seconds=119)},
        "anomaly_empty": {"idle": timedelta(minutes=5), "started_at": None},
        "anomaly_stale": {
            "idle": timedelta(hours=6),
            "participants": 1,
            "started_at": T0 + timedelta(minutes=1),
        },
        "ended": {
            "status": "Ended",
            "end_reason": "Normal",
            "idle": timedelta(hours=9),
            "ended_at": T0 - timedelta(hours=9),
        },
        "failed": {
            "status": "Failed",
            "end_reason": "Error",
            "age": timedelta(hours=1),
            "started_at": None,
            "ended_at": T0 - timedelta(minutes=50),
        },
    }
    with engine.begin() as conn:
        for what, kwargs in cases.items():
            seeded[f.conference(conn, **kwargs)["id"]] = what
    return seeded


def snapshot(engine: Engine) -> list[tuple]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                text(
                    "SELECT id, status, end_reason, updated_at, ended_at, "
                    "(SELECT count(*) FROM messenger.integration_outbox), "
                    "(SELECT count(*) FROM messenger.realtime_outbox) "
                    "FROM messenger.conference_sessions ORDER BY id"
                )
            )
        ]


def test_plan_lists_exactly_what_the_next_cycle_closes(settings, engine):
    seeded = seed_mixed(engine)
    before = snapshot(engine)
    planned = plan(engine, settings, T0, per_phase=100)
    assert snapshot(engine) == before  # a dry run changes nothing

    would_close = {
        c["conference_id"]: name for name, p in planned["phases"].items() for c in p["conferences"]
    }
    assert {seeded[i] for i in would_close} == {
        "empty",
        "empty_at_cutoff",
        "empty_and_stale",
        "stale_occupied",
        "stale_at_cutoff",
        "provision_old",
        "provision_at_cutoff",
        "anomaly_empty",
        "anomaly_stale",
    }
    # closed like any other, without a duration, and the plan says why
    anomalies = {
        seeded[c["conference_id"]]: c["anomaly"]
        for p in planned["phases"].values()
        for c in p["conferences"]
        if c["anomaly"]
    }
    assert anomalies == {
        "anomaly_empty": "started_at is missing",
        "anomaly_stale": "started_at is later than as_of",
    }
    ids = {what: cid for cid, what in seeded.items()}
    assert would_close[ids["empty_and_stale"]] == "empty_room"  # first phase wins
    assert would_close[ids["stale_occupied"]] == "stale_live"

    result = Reaper(settings, engine=engine).run_cycle(T0)
    with engine.connect() as conn:
        closed = {
            cid: PHASE_OF_REASON[state]
            for cid, state in f.statuses(conn).items()
            if cid in seeded and state in PHASE_OF_REASON and seeded[cid] not in ("failed",)
        }
    assert closed == would_close
    assert result["failed_count"] == 0
    assert planned["would_close"] == len(would_close)
    counts = {name: p["would_close"] for name, p in planned["phases"].items()}
    assert counts == {p.name: result[p.count_key] for p in IN_ORDER}
    # and the cycle left nothing the plan would still list
    assert plan(engine, settings, T0, per_phase=100)["would_close"] == 0


def test_plan_shows_when_the_mass_closure_guard_would_stop_stale_live(settings, engine):
    with engine.begin() as conn:
        for _ in range(settings.mass_closure_floor + 5):
            f.conference(conn, idle=timedelta(hours=5), participants=1)
        f.conference(conn, idle=timedelta(seconds=120))  # empty_room still closes
    planned = plan(engine, settings, T0, per_phase=5)
    stale = planned["phases"]["stale_live"]
    assert stale["blocked"] and "mass-closure" in stale["blocked"]
    assert stale["would_close"] == 0 and stale["eligible"] == settings.mass_closure_floor + 5
    assert stale["truncated"] and len(stale["conferences"]) == 5
    result = Reaper(settings, engine=engine).run_cycle(T0)
    assert (result["stale_timeout_count"], result["empty_timeout_count"]) == (0, 1)


@pytest.mark.process
def test_plan_and_status_commands_print_text_and_json(engine):
    seeded = seed_mixed(engine)
    text_plan = cli("plan", "--as-of", T0.isoformat())
    assert text_plan.returncode == 0, text_plan.stderr
    assert "changes nothing" in text_plan.stdout or "nothing is changed" in text_plan.stdout
    for cid, what in seeded.items():
        assert (cid in text_plan.stdout) == (
            what.startswith(("empty", "stale", "provision_old", "provision_at", "anomaly"))
            and what != "empty_in_grace"
        ), what
    assert "[no duration: started_at is missing]" in text_plan.stdout
    as_json = json.loads(cli("plan", "--json", "--as-of", T0.isoformat()).stdout)
    assert as_json["would_close"] == 9

    status = json.loads(cli("status", "--json").stdout)
    # the schema's revision and this release's range, in both forms
    assert status["schema"] == {
        "revision": SCHEMA_KNOWN,
        "state": "supported",
        "release": version(),
        "needs": SCHEMA_NEEDED,
        "knows": SCHEMA_KNOWN,
    }
    assert (
        f"schema {SCHEMA_KNOWN} (supported): release {version()} runs on {SCHEMA_NEEDED} to"
        f" {SCHEMA_KNOWN}"
    ) in cli("status").stdout.splitlines()
    assert cli("--version").stdout == f"reaper {version()}\n"
    assert set(status["phases"]) == set(ORDER)
    # status is "now": every seeded window is long past
    assert status["active_backlog"] == sum(p["eligible"] for p in status["phases"].values())
    assert status["phases"]["provision_timeout"]["eligible"] == 3
    assert status["phases"]["provision_timeout"]["oldest_overdue_seconds"] > 0
    assert status["outbox"] == {
        "pending": 0,
        "oldest_pending_age_seconds": 0.0,
        "parked": 0,
        "discarded": 0,
    }
    assert status["lock"] == {"held": False, "holder_pid": None}


@pytest.mark.process
def test_status_shows_pending_outbox_and_the_lock_holder(settings, engine):
    with engine.begin() as conn:
        f.conference(conn, idle=timedelta(minutes=5))
    Reaper(settings, engine=engine).run_cycle(T0)  # one outbox row
    holder = create_engine(
        make_url(settings.database_url).update_query_dict({"application_name": "held-by-test"})
    )
    with holder.connect() as conn, conn.begin():
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        conn.execute(
            text(
                "SELECT pg_advisory_xact_lock("
                "hashtextextended('messenger.conference-room-reaper', 0))"
            )
        )
        as_json = json.loads(cli("status", "--json").stdout)
        as_text = cli("status").stdout
    holder.dispose()
    assert as_json["lock"]["held"] is True
    assert as_json["lock"]["holder_pid"] == pid
    assert as_json["lock"]["holder"]["application_name"] == "held-by-test"
    assert f"held by backend pid {pid}" in as_text and "held-by-test" in as_text
    assert as_json["outbox"]["pending"] == 1
    assert as_json["outbox"]["oldest_pending_age_seconds"] >= 0
    assert "outbox pending" in as_text


@pytest.mark.process
def test_the_database_password_is_never_printed(settings, engine):
    url = make_url(settings.database_url).set(password="s3cr3t-Pa55")
    secret = "s3cr3t-Pa55"
    with_password = url.render_as_string(hide_password=False)
    # PostgreSQL here trusts local connections: the password is accepted and unused
    for args in (("status",), ("status", "--json"), ("plan",), ("plan", "--json")):
        done = cli(*args, env={"REAPER_DATABASE_URL": with_password})
        assert done.returncode == 0, done.stderr
        assert secret not in done.stdout + done.stderr
    assert "***" in cli("status", env={"REAPER_DATABASE_URL": with_password}).stdout
    unreachable = url.set(port=1).render_as_string(hide_password=False)
    for args in (("status",), ("plan", "--json")):
        done = cli(*args, env={"REAPER_DATABASE_URL": unreachable})
        assert done.returncode == 1
        assert secret not in done.stdout + done.stderr
        assert done.stderr.startswith("reaper: database postgresql+psycopg2://postgres:***@")
        assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.process
def test_status_reads_with_the_configured_settings(engine):
    """The windows come from the environment, as for the worker."""
    with engine.begin() as conn:
        # past a 10 s grace only
        f.conference(conn, as_of=datetime.now(UTC), idle=timedelta(seconds=20))
    default = json.loads(cli("status", "--json").stdout)
    short = json.loads(cli("status", "--json", env={"REAPER_EMPTY_ROOM_GRACE": "10"}).stdout)
    assert default["phases"]["empty_room"]["eligible"] == 0
    assert short["phases"]["empty_room"]["eligible"] == 1
    assert short["phases"]["empty_room"]["window_seconds"] == 10


@pytest.mark.process
def test_sql_prints_what_the_query_class_sends(engine):
    """``reaper sql NAME``: the statement as it reaches the driver's cursor on a real
    connection (includes expanded, parameters in the driver's style), and its
    parameters' names."""
    sent: list[str] = []

    def capture(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        sent.append(statement)

    at = datetime.now(UTC)
    event.listen(engine, "before_cursor_execute", capture)
    try:
        with engine.begin() as conn:
            queries = Queries(conn)
            sent.clear()
            queries.eligible_census(phases=IN_ORDER, as_of=at, bounds=cutoffs(Settings(), at))
            queries.guard_eligible(
                phase=STALE_LIVE, as_of=at, bounds=cutoffs(Settings(), at), excluded=[]
            )
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    census, guard = sent
    expected = {
        "eligible_census": (census, ", ".join(["as_of", *(f"{p}_cutoff" for p in ORDER)])),
        "guard_eligible[stale_live]": (guard, "stale_live_cutoff, as_of, excluded"),
    }
    for name, (statement, parameters) in expected.items():
        done = cli("sql", name)
        assert done.returncode == 0, done.stderr
        header, _, printed = done.stdout.partition("\n")
        assert header == f"-- {name}: parameters {parameters}"
        assert printed == statement + "\n"  # print()'s newline
        assert "-- include:" not in printed and "%(as_of)s" in printed


@pytest.mark.process
def test_sql_of_an_unknown_name_lists_the_names():
    done = cli("sql", "no_such_statement")
    assert done.returncode == 2 and done.stdout == ""
    first, *names = done.stderr.splitlines()
    assert first == "reaper sql: no statement 'no_such_statement'; the names:"
    assert "  eligible_census" in names and "  end_active_batch[empty_room]" in names
