"""``GET /healthz`` on the worker's metrics port (docs/design.md#operator-controls):
200 while cycles complete, 503 once none has for three polling intervals (the
embedded beat dies and the worker lives on, quietly scheduling nothing), or
once no run has completed, by any replica, for four (a session that is not the
reaper holds the run lock: every tick is skipped)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

from reaper.budgets import HEALTH
from reaper.health import CLOSING_INTERVALS
from reaper.queries import Queries
from reaper.release import SCHEMA_KNOWN, SCHEMA_NEEDED, version
from tests.support import factory as f
from tests.support.facts import output_events
from tests.support.figures import figure
from tests.support.ports import free_port
from tests.support.processes import CELERY, ROOT, Worker, children, wait_until

pytestmark = [pytest.mark.process, pytest.mark.long]

KEYS = {"status", "last_cycle_age_seconds", "last_relay_age_seconds", "database", "schema"}
# the schema as /healthz shows it: the database's revision and the release's range
SCHEMA = {
    "revision": SCHEMA_KNOWN,
    "state": "supported",
    "release": version(),
    "needs": SCHEMA_NEEDED,
    "knows": SCHEMA_KNOWN,
}
CLOSING_KEYS = {"last_run_completed_age_seconds", "closing_limit_seconds", "lock_holder"}
LOCK_KEY = "hashtextextended('messenger.conference-room-reaper', 0)"
GAUGE = "messenger_conf_reaper_last_run_completed_timestamp_seconds"


def healthz(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503 still carries the JSON
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


def run_completed(port: int) -> bool:
    """The replica on ``port`` has completed a run."""
    return healthz(port)[1].get("last_run_completed_age_seconds") is not None


def no_live_run(engine: Engine) -> bool:
    """No open run whose lease still runs, as a cycle's head reads it (open_run)."""
    with engine.begin() as conn:
        run = Queries(conn).open_run()
    return run is None or not run.live


def gauge(port: int) -> float:
    """The last-run-completed gauge as ``/metrics`` serves it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        exposition = resp.read().decode()
    match = re.search(rf"^{GAUGE} (\S+)$", exposition, re.MULTILINE)
    assert match, f"{GAUGE} not served"
    return float(match[1])


def worker_env(port: int, interval: float) -> dict[str, str]:
    return {
        "REAPER_POLLING_INTERVAL": str(interval),
        "REAPER_METRICS_PORT": str(port),
        "REAPER_METRICS_ADDRESS": "127.0.0.1",
    }


def test_healthz_turns_503_when_the_embedded_beat_dies(engine, tmp_path):
    port = free_port()
    worker = Worker(
        tmp_path,
        {
            "REAPER_POLLING_INTERVAL": "1",
            "REAPER_METRICS_PORT": str(port),
            "REAPER_METRICS_ADDRESS": "127.0.0.1",
        },
        name="health",
    ).start()
    try:
        # healthy at start (a new worker has three intervals for its first cycle),
        # then because cycles complete
        wait_until(
            lambda: healthz(port)[1].get("last_cycle_age_seconds") is not None,
            30,
            "a cycle completed",
        )
        code, body = healthz(port)
        assert code == 200 and set(body) >= KEYS
        assert body["status"] == "ok" and body["database"] == "reachable"
        assert body["schema"] == SCHEMA
        assert body["last_cycle_age_seconds"] is not None and body["last_cycle_age_seconds"] < 3

        # Every child of the worker dies once: the pool replaces its own, the
        # embedded beat is not restarted, and no tick is sent any more.
        assert worker.proc is not None
        pids = children(worker.proc.pid)
        assert len(pids) >= 3, f"the pool's two children and the beat, found {pids}"
        for child in pids:
            os.kill(child, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: healthz(port)[0] == 503, 30, "unhealthy after three intervals")
        took = time.monotonic() - killed_at
        code, body = healthz(port)
        assert worker.proc.poll() is None  # the worker itself lives on
        assert body["status"] == "unhealthy" and body["database"] == "reachable"
        # Either limit may be the first one passed: a child killed inside a run
        # may have completed a phase (the cycle age) after the last completed
        # run (the closing age), so the closing limit of four intervals can come
        # first. With no tick sent, the cycle age passes its limit too.
        # (No completed run yet: the worker's start is the closing reference.)
        run_age = body["last_run_completed_age_seconds"]
        assert (
            body["last_cycle_age_seconds"] > body["limit_seconds"]
            or run_age is None
            or run_age > body["closing_limit_seconds"]
        ), body
        wait_until(
            lambda: healthz(port)[1]["last_cycle_age_seconds"] > 3,  # three intervals of 1 s
            30,
            "the cycle age past three intervals",
        )
        assert healthz(port)[0] == 503

        # The pool still works: a cycle called by hand makes it healthy again.
        # Once no killed child's run is leased: a child killed inside a run
        # leaves it owned for one REAPER_RUN_LEASE, and a cycle inside that is
        # skipped (correctly) with no tick left to take the run over after it.
        wait_until(partial(no_live_run, engine), 30, "the killed run's lease over")
        subprocess.run(
            [CELERY, "-A", "reaper", "call", "reaper.reap", "--expires", "60"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        wait_until(lambda: healthz(port)[0] == 200, 30, "healthy after a cycle by hand")
    finally:
        worker.stop()
    figure(f"/healthz 503 {took:.1f}s after the embedded beat died (interval 1 s)")


def test_a_foreign_session_on_the_run_lock_turns_healthz_503_and_back(
    engine, database_url, tmp_path
):
    interval = 2.0
    limit = CLOSING_INTERVALS * interval
    port = free_port()
    worker = Worker(tmp_path, worker_env(port, interval), name="health-lock").start()
    # Not the reaper: its own engine and application_name, as psql or a
    # migration tool would be.
    foreign = create_engine(
        database_url,
        isolation_level="AUTOCOMMIT",
        connect_args={"application_name": "someone-else"},
    )
    conn = None
    try:
        wait_until(
            lambda: healthz(port)[1].get("last_run_completed_age_seconds") is not None,
            30,
            "a run completed",
        )
        code, body = healthz(port)
        assert code == 200 and set(body) >= KEYS | CLOSING_KEYS
        assert body["closing_limit_seconds"] == limit
        assert body["last_run_completed_age_seconds"] < limit
        assert body["lock_holder"] is None
        wait_until(lambda: gauge(port) > 0, 15, "the gauge shows a completed run")

        conn = foreign.connect()
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        conn.execute(text(f"SELECT pg_advisory_lock({LOCK_KEY})"))  # a session lock, idle
        locked_at = time.monotonic()
        wait_until(lambda: healthz(port)[0] == 503, limit + 20, "503 with the lock held")
        to_503 = time.monotonic() - locked_at
        code, body = healthz(port)
        assert code == 503 and body["status"] == "unhealthy"
        assert body["database"] == "reachable"
        # ticks go on (skipped), so the worker itself is alive: only closings stopped
        assert body["last_cycle_age_seconds"] is not None
        assert body["last_cycle_age_seconds"] <= body["limit_seconds"]
        assert body["last_run_completed_age_seconds"] > limit
        assert body["lock_holder"]["pid"] == pid
        assert body["lock_holder"]["application_name"] == "someone-else"
        assert to_503 <= limit + 10, to_503

        # The gauge stays at the last completion while the ticks are skipped:
        # its age (what ConferenceReaperNotClosing computes) keeps growing.
        first, first_at = gauge(port), time.time()
        time.sleep(interval * 3)  # past the scrape refresh's 5 s, ticks skipped meanwhile
        second, second_at = gauge(port), time.time()
        assert second == first > 0
        assert second_at - second > first_at - first > limit

        conn.execute(text(f"SELECT pg_advisory_unlock({LOCK_KEY})"))
        released_at = time.monotonic()
        wait_until(lambda: healthz(port)[0] == 200, 2 * interval + 20, "200 once released")
        to_200 = time.monotonic() - released_at
        code, body = healthz(port)
        assert body["last_run_completed_age_seconds"] < limit and body["lock_holder"] is None
        wait_until(lambda: gauge(port) > second, 15, "the gauge moves on")
        assert to_200 <= 2 * interval + 10, to_200
    finally:
        if conn is not None:
            conn.close()
        foreign.dispose()
        worker.stop()
    skipped = output_events(worker.output(), "cycle.skipped")
    assert any(e.get("holder_pid") == pid for e in skipped)
    figure(
        f"foreign session on the run lock (interval {interval:g} s, limit"
        f" {CLOSING_INTERVALS} intervals): /healthz 503 {to_503:.1f}s after the lock was"
        f" taken, 200 {to_200:.1f}s after it was released"
    )


def test_skipped_ticks_of_a_replica_keep_healthz_200(engine, tmp_path):
    """Two workers on one database and broker: one runs a cycle while the
    other's ticks find the run taken and are skipped. Neither is unhealthy."""
    interval = 2.0
    # A backlog drained one room per batch makes every run last its whole
    # budget (2 s): most ticks of both workers land inside a run and are skipped.
    with engine.begin() as conn:
        f.bulk_conferences(conn, 10_000, as_of=f.db_now(engine))
    slow_runs = {
        "REAPER_BATCH_SIZE": "1",
        "REAPER_DRAIN_LANES": "1",
        "REAPER_MAX_RUN_DURATION": "2",
    }
    ports = [free_port(), free_port()]
    workers = [
        Worker(tmp_path, worker_env(port, interval) | slow_runs, name=f"health-replica-{x}")
        for port, x in zip(ports, "ab", strict=True)
    ]
    answers: list[tuple[int, dict[str, Any]]] = []
    try:
        for worker in workers:
            worker.start()
        for port in ports:
            wait_until(partial(run_completed, port), 30, "a run completed")
        # three times the closing limit: long enough for it to trip if skipped
        # ticks counted against a replica
        end = time.monotonic() + 3 * CLOSING_INTERVALS * interval
        while time.monotonic() < end:
            answers += [healthz(port) for port in ports]
            time.sleep(0.2)
    finally:
        logs = [w.output() for w in workers]
        for worker in workers:
            worker.stop()
    unhealthy = [answer for answer in answers if answer[0] != 200]
    assert answers and not unhealthy, unhealthy[:3]
    assert all(b["last_run_completed_age_seconds"] < b["closing_limit_seconds"] for _, b in answers)
    skipped = [len(output_events(log, "cycle.skipped")) for log in logs]
    completed = [len(output_events(log, "cycle.completed")) for log in logs]
    # both replicas were the skipping one at times, or the test proves nothing
    assert all(skipped) and sum(completed) > 0, (skipped, completed)
    figure(
        f"two replicas, interval {interval:g} s: {len(answers)} /healthz"
        f" answers, all 200; cycles completed a/b {completed[0]}/{completed[1]},"
        f" skipped a/b {skipped[0]}/{skipped[1]}"
    )


class Blackhole:
    """A TCP server that accepts connections and never answers (a database
    whose host is gone behind a proxy that still accepts)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        try:
            while True:
                self.accepted.append(self.listener.accept()[0])
        except OSError:  # closed
            return

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept() up
        self.listener.close()
        self.thread.join(timeout=5)
        for sock in self.accepted:
            sock.close()


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:")).split()[1])


def test_healthz_answers_within_its_budget_when_the_database_never_answers(tmp_path):
    budget = HEALTH.total_seconds()
    hole = Blackhole()
    port = free_port()
    env = worker_env(port, 1) | {
        "REAPER_DATABASE_URL": f"postgresql+psycopg2://reaper@127.0.0.1:{hole.port}/reaper"
    }
    worker = Worker(tmp_path, env, name="health-blackhole").start()
    assert worker.proc is not None
    took: list[float] = []
    answers: list[tuple[int, dict[str, Any]]] = []
    threads: list[int] = []
    try:
        for _ in range(6):
            started = time.monotonic()
            answers.append(healthz(port))
            took.append(time.monotonic() - started)
            threads.append(threads_of(worker.proc.pid))
    finally:
        hole.close()  # the hung connections fail now, and the worker can stop
        worker.stop()
    assert all(code in (200, 503) for code, _ in answers), answers
    assert all(body["database"] == "unreachable" for _, body in answers)
    # the release's range alone: the database did not say its revision
    unread = SCHEMA | {"revision": None, "state": None}
    assert all(body["schema"] == unread for _, body in answers)
    assert all(body["last_run_completed_age_seconds"] is None for _, body in answers)
    assert max(took) < budget + 1, took
    # one read of the database in flight at a time, however many answers waited for it
    assert max(threads) - min(threads) <= 1, threads
    figure(
        f"database accepting and never answering: /healthz answered in"
        f" {min(took):.2f}-{max(took):.2f}s (budget {budget:g}s), worker threads"
        f" {min(threads)}-{max(threads)}"
    )
