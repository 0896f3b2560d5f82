"""Time comes from the database (docs/design.md#time).

A cycle's ``as_of`` is the database's clock at its start, whatever the worker's
clock says; a hand-given ``as_of`` later than the database's clock plus 5 s is
refused; the skew is exported and logged. The worker's clock is made wrong
with libfaketime (``faketime``), which the database does not follow.
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import timedelta

import pytest

from reaper.clock import parse_time, rfc3339
from tests.support import factory as f
from tests.support.figures import figure
from tests.support.ports import free_port
from tests.support.processes import CELERY, ROOT, Worker, run_cli, wait_until
from tests.support.services import scrape

FAST = ("faketime", "-f", "+120s")  # the worker's clock two minutes ahead


def json_lines(text: str) -> list[dict]:
    """The JSON log lines of a process's stderr."""
    return [json.loads(line) for line in text.splitlines() if line.startswith('{"ts"')]


@pytest.mark.process
def test_a_fast_worker_clock_closes_no_room_in_use(engine):
    """Measured before: 120 s ahead, `reaper reap --once` ended an empty room whose
    last activity was 30 s earlier (grace 90 s)."""
    now = f.db_now(engine)
    with engine.begin() as conn:
        room = f.conference(conn, as_of=now, idle=timedelta(seconds=30))
        overdue = f.conference(conn, as_of=now, idle=timedelta(seconds=200))
    done = subprocess.run(
        [*FAST, str(ROOT / ".venv/bin/reaper"), "reap", "--once", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    with engine.connect() as conn:
        assert f.session_row(conn, room["id"])["status"] == "Active"  # in use: left alone
        assert f.session_row(conn, overdue["id"])["status"] == "Ended"
    assert result["empty_timeout_count"] == 1
    # as_of is the database's clock, not the worker's
    assert abs((parse_time(result["as_of"]) - f.db_now(engine)).total_seconds()) < 10
    [skew] = [e for e in json_lines(done.stderr) if e["event"] == "clock.skew"]
    assert skew["level"] == "WARNING" and 115 < skew["skew_seconds"] < 125
    figure(
        f"worker clock +120 s: skew measured {skew['skew_seconds']} s; as_of kept "
        "to the database's clock; a room idle 30 s left alone"
    )


@pytest.mark.process
def test_a_hand_given_as_of_in_the_databases_future_is_refused(engine):
    now = f.db_now(engine)
    with engine.begin() as conn:
        # eligible only for a cycle at least 60 s in the database's future
        room = f.conference(conn, as_of=now, idle=timedelta(seconds=30))
    ahead = rfc3339(now + timedelta(seconds=60))
    done = run_cli("reap", "--once", "--as-of", ahead)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "as_of" in lines[0] and "database" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    with engine.connect() as conn:
        assert f.session_row(conn, room["id"])["status"] == "Active"
        assert f.outbox(conn) == []
    # within the tolerance (5 s) it is a cycle like any other
    within = run_cli("reap", "--once", "--json", "--as-of", rfc3339(f.db_now(engine)))
    assert within.returncode == 0, within.stderr
    assert json.loads(within.stdout)["skipped"] is False


@pytest.mark.process
def test_the_task_refuses_a_future_as_of_and_the_worker_exports_its_skew(engine, tmp_path):
    """A worker whose clock is 120 s fast: ``reaper.reap`` with an ``as_of`` 60 s in
    the database's future fails with the reason; its cycles export the skew."""
    now = f.db_now(engine)
    with engine.begin() as conn:
        room = f.conference(conn, as_of=now, idle=timedelta(seconds=30))
    port = free_port()
    worker = Worker(
        tmp_path,
        {
            "REAPER_POLLING_INTERVAL": "3600",
            "REAPER_METRICS_PORT": str(port),
            "REAPER_METRICS_ADDRESS": "127.0.0.1",
        },
        beat=False,
        prefix=FAST,
    ).start()
    try:
        ahead = rfc3339(now + timedelta(seconds=60))
        called = subprocess.run(
            # no --expires: the caller's clock and the worker's disagree by 120 s
            [
                CELERY,
                "-A",
                "reaper",
                "call",
                "reaper.reap",
                "--kwargs",
                json.dumps({"as_of": ahead}),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        task_id = called.stdout.strip()
        worker.wait_for(
            lambda out: f"reaper.reap[{task_id}] raised unexpected: AsOfRefused" in out,
            30,
            "the task failed with the reason",
        )
        assert f"as_of {ahead} is later than the database's clock" in worker.output()
        with engine.connect() as conn:
            assert f.session_row(conn, room["id"])["status"] == "Active"
        subprocess.run(
            [CELERY, "-A", "reaper", "call", "reaper.reap"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        skew = wait_until(
            lambda: scrape(port).get("messenger_conf_reaper_clock_skew_seconds"),
            30,
            "the skew exported",
        )
        time.sleep(0.5)
    finally:
        worker.stop()
    # Measured before: faketime forked the worker and kept SIGTERM to itself; the
    # worker lived on and took later tests' phase tasks.
    assert not worker.alive()
    assert 115 < skew < 125, skew
    with engine.connect() as conn:
        assert f.session_row(conn, room["id"])["status"] == "Active"
