"""The operator's controls (docs/design.md#operator-controls): pause and resume,
stored in PostgreSQL, seen by every replica; parked events listed and requeued."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from sqlalchemy import text

from reaper import metrics
from reaper.cycle import Reaper
from reaper.events import PhaseCompleted, process_bus
from reaper.overview import plan
from reaper.phases import ORDER
from reaper.wiring import Gauges
from tests.support import factory as f
from tests.support.facts import count_events
from tests.support.figures import figure
from tests.support.processes import Worker, run_cli, wait_until


@pytest.mark.process
def test_a_paused_phase_changes_nothing_and_the_result_says_so(settings, engine, facts):
    now = f.db_now(engine)
    with engine.begin() as conn:
        empty = f.conference(conn, as_of=now, idle=timedelta(minutes=5))
        stuck = f.conference(conn, as_of=now, status="Provisioning", age=timedelta(minutes=5))
    paused = run_cli(
        "pause",
        "--phase",
        "empty_room",
        "--reason",
        "media incident INC-7",
        env={"REAPER_OPERATOR": "alice"},
    )
    assert paused.returncode == 0, paused.stderr
    assert "paused empty_room until resumed (by alice): media incident INC-7" in paused.stdout
    assert count_events(paused.stderr, "control.paused") == 1
    planned = plan(engine, settings, None, per_phase=10)["phases"]  # the dry run agrees
    assert (planned["empty_room"]["would_close"], planned["empty_room"]["paused"]) == (
        0,
        "media incident INC-7",
    )
    assert planned["provision_timeout"]["would_close"] == 1
    result = Reaper(settings, engine=engine).run_cycle()
    assert result["paused"] == ["empty_room"]
    assert (result["empty_timeout_count"], result["provision_failed_count"]) == (0, 1)
    [left_alone] = [p for p in facts.of(PhaseCompleted) if p.paused]
    assert left_alone.phase == "empty_room" and left_alone.paused == "media incident INC-7"
    with engine.connect() as conn:
        assert f.statuses(conn)[empty["id"]] == ("Active", None)
        assert f.statuses(conn)[stuck["id"]] == ("Failed", "Error")

    status = json.loads(run_cli("status", "--json").stdout)
    [pause] = status["paused"]
    assert (pause["phase"], pause["reason"], pause["by"], pause["until"]) == (
        "empty_room",
        "media incident INC-7",
        "alice",
        None,
    )
    assert pause["since"].endswith("Z")
    Gauges(engine, settings, process_bus).refresh()
    assert metrics.sample("messenger_conf_reaper_paused", {"phase": "empty_room"}) == 1
    assert metrics.sample("messenger_conf_reaper_paused", {"phase": "stale_live"}) == 0

    resumed = run_cli("resume", "--phase", "empty_room")
    assert resumed.returncode == 0 and "resumed empty_room" in resumed.stdout
    assert count_events(resumed.stderr, "control.resumed") == 1
    again = Reaper(settings, engine=engine).run_cycle()
    assert again["paused"] == [] and again["empty_timeout_count"] == 1
    Gauges(engine, settings, process_bus).refresh()
    assert metrics.sample("messenger_conf_reaper_paused", {"phase": "empty_room"}) == 0


@pytest.mark.process
def test_a_pause_for_a_while_ends_by_itself_and_covers_all_phases(settings, engine):
    now = f.db_now(engine)
    with engine.begin() as conn:
        f.conference(conn, as_of=now, idle=timedelta(minutes=5))
        f.conference(conn, as_of=now, status="Provisioning", age=timedelta(minutes=5))
        f.conference(conn, as_of=now, idle=timedelta(hours=5), participants=1)
    done = run_cli("pause", "--for", "2", "--reason", "maintenance window")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("paused ") == 3
    first = Reaper(settings, engine=engine).run_cycle()
    assert first["paused"] == list(ORDER)
    assert (
        sum(
            first[k]
            for k in ("empty_timeout_count", "provision_failed_count", "stale_timeout_count")
        )
        == 0
    )
    time.sleep(2.2)
    assert json.loads(run_cli("status", "--json").stdout)["paused"] == []
    later = Reaper(settings, engine=engine).run_cycle()
    assert later["paused"] == []
    assert (
        later["empty_timeout_count"],
        later["provision_failed_count"],
        later["stale_timeout_count"],
    ) == (1, 1, 1)


@pytest.mark.process
def test_pause_needs_a_reason_and_a_valid_duration():
    assert run_cli("pause").returncode == 2  # --reason is required
    blank = run_cli("pause", "--reason", "  ")
    assert blank.returncode == 2
    assert blank.stderr.strip() == "reaper: --reason: a pause needs a reason"
    bad = run_cli("pause", "--for", "1h", "--reason", "x")
    assert bad.returncode == 2 and bad.stderr.startswith("reaper: --for:")
    assert len(bad.stderr.strip().splitlines()) == 1
    wrong = run_cli("pause", "--phase", "everything", "--reason", "x")
    assert wrong.returncode == 2


@pytest.mark.process
def test_a_pause_is_seen_by_a_second_replica_within_one_cycle(engine, tmp_path):
    env = {"REAPER_EMPTY_ROOM_GRACE": "2"}
    # Ticks that drift apart, so neither replica's cycles are always the skipped ones.
    replicas = [
        Worker(tmp_path, {**env, "REAPER_POLLING_INTERVAL": interval}, name=name).start()
        for name, interval in (("a", "1"), ("b", "1.3"))
    ]
    try:
        assert run_cli("pause", "--phase", "empty_room", "--reason", "INC-9").returncode == 0
        now = f.db_now(engine)
        with engine.begin() as conn:
            room = f.conference(conn, as_of=now, idle=timedelta(seconds=10))
            stuck = f.conference(conn, as_of=now, status="Provisioning", age=timedelta(minutes=5))

        def paused_in(worker: Worker) -> int:
            return count_events(worker.output(), "phase.paused")

        wait_until(
            lambda: f.session_row_status(engine, stuck["id"]) == "Failed", 30, "other phases run"
        )
        # several cycles later, on both replicas, the room is still left alone
        seen = [paused_in(w) for w in replicas]
        wait_until(
            lambda: all(paused_in(w) > n for w, n in zip(replicas, seen, strict=True)),
            60,
            "a paused empty_room on each replica",
        )
        assert f.session_row_status(engine, room["id"]) == "Active"
        resumed_at = time.monotonic()
        assert run_cli("resume").returncode == 0
        wait_until(
            lambda: f.session_row_status(engine, room["id"]) == "Ended",
            30,
            "closed after the resume",
        )
        took = time.monotonic() - resumed_at
    finally:
        for worker in replicas:
            worker.stop()
    assert took < 10, took
    figure(f"pause seen by both replicas; the room closed {took:.1f}s after resume (interval 1 s)")


@pytest.mark.process
def test_parked_rows_are_listed_and_requeued(engine):
    with engine.begin() as conn:
        for key in ("deal-a", "deal-b"):
            conn.execute(
                text(
                    "INSERT INTO messenger.integration_outbox"
                    " (event_id, topic, message_key, payload, attempts, last_error, parked_at)"
                    " VALUES (gen_random_uuid(), 't', :k, '{}', 3, 'MessageSizeTooLargeError: x',"
                    " clock_timestamp())"
                ),
                {"k": key},
            )
    listed = run_cli("outbox", "parked", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert {r["message_key"] for r in rows} == {"deal-a", "deal-b"}
    assert all(
        set(r) >= {"event_id", "message_key", "attempts", "error", "parked_at"} for r in rows
    )
    assert "parked row(s)" in run_cli("outbox", "parked").stdout
    one = run_cli("outbox", "requeue", "--event-id", rows[0]["event_id"])
    assert one.returncode == 0 and one.stdout.strip() == "requeued 1 parked row"
    with engine.connect() as conn:
        back = {str(r["event_id"]): r for r in f.outbox(conn)}[rows[0]["event_id"]]
    assert back["parked_at"] is None and back["attempts"] == 0
    assert run_cli("outbox", "requeue", "--event-id", "not-a-uuid").returncode == 2
    rest = run_cli("outbox", "requeue", "--all")
    assert rest.stdout.strip() == "requeued 1 parked row"
    assert count_events(rest.stderr, "outbox.requeued") == 1
    assert json.loads(run_cli("outbox", "parked", "--json").stdout) == []
