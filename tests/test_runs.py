"""The single-runner lock: exclusive, never pooled; a dead or frozen holder loses
it within REAPER_RUN_LEASE, a hung one (alive, never ending) one lease after
REAPER_LOCK_TTL, a live one keeps it as long as its phase runs."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import Engine, text

from reaper.config import Settings
from reaper.phases import EMPTY_ROOM, ORDER
from reaper.runs import LOCK_SESSION_ENDED, Runs, holder
from tests.support.figures import figure

KEY = "hashtextextended('messenger.conference-room-reaper', 0)"


def _holder_script(database_url: str, ttl_s: float, lease_s: float, then: str) -> str:
    """A runner that takes the run and holds the lock in its first phase, then ``then``."""
    return textwrap.dedent(
        f"""
        import os, signal, sys, time, uuid
        from datetime import timedelta
        from reaper.config import Settings
        from reaper.db import engine_for
        from reaper.runs import Runs
        settings = Settings(database_url={database_url!r},
                            lock_ttl=timedelta(seconds={ttl_s}),
                            run_lease=timedelta(seconds={lease_s}),
                            max_run_duration=timedelta(seconds={ttl_s} / 2))
        runs = Runs(engine_for(settings.database_url), settings)
        run_id = str(uuid.uuid4())
        assert runs.take(run_id, None).skipped is None
        claim = runs.claim(run_id, "empty_room")
        assert claim is not None
        print("locked", flush=True)
        {then}
        """
    )


# The server ends a silent lock session one lease after its last word; past that,
# its timer's own lateness and this test's poll (every 50 ms) on a CPU shared with
# the test beside it. A lock left to its lease would take a whole lease more.
SERVER_MARGIN_S = 1.5
DEFAULT_LEASE_S = 10.0


def _start_holder(
    database_url: str, then: str, *, ttl_s: float = 60, lease_s: float = DEFAULT_LEASE_S
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _holder_script(database_url, ttl_s, lease_s, then)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _wait_free(engine: Engine, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if holder(engine) is None:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"lock still held after {timeout}s")


def runs(settings: Settings, engine: Engine) -> Runs:
    return Runs(engine, settings)


def test_lock_is_exclusive_and_names_its_holder(settings, engine):
    first = runs(settings, engine)
    run_id = str(uuid.uuid4())
    assert first.take(run_id, None).skipped is None
    claim = first.claim(run_id, "empty_room")
    assert claim is not None
    try:
        pid = holder(engine)
        assert isinstance(pid, int) and pid > 0
        other = runs(settings, engine).take(str(uuid.uuid4()), None)
        assert other.skipped and other.holder_pid == pid
    finally:
        assert claim.release() is None
    assert holder(engine) is None


def test_lock_is_released_when_the_phase_ends_either_way(settings, engine):
    run_id = str(uuid.uuid4())
    assert runs(settings, engine).take(run_id, None).skipped is None
    claim = runs(settings, engine).claim(run_id, "empty_room")
    assert claim is not None
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("boom")
        finally:
            claim.release()
    assert holder(engine) is None


def test_a_phase_whose_heartbeat_found_its_session_ended_tells_the_lost_lock(settings, engine):
    """A frozen phase woken after its lease: its heartbeat's next beat fails on the
    ended session first. The release tells the lost lock (the phase then logs
    lock.lost), it does not raise on the connection that failed beat left unusable
    (seen: PendingRollbackError, no lock.lost, in test_takeover's woken owner)."""
    settings = settings.model_copy(update={"run_lease": timedelta(seconds=2)})
    run_id = str(uuid.uuid4())
    assert runs(settings, engine).take(run_id, None).skipped is None
    claim = runs(settings, engine).claim(run_id, "empty_room")
    assert claim is not None
    claim.run.counts[EMPTY_ROOM.count_key] = 7  # what its batches committed
    session = holder(engine)
    with engine.begin() as admin:
        assert admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": session}).scalar()
    # one beat period (a quarter of the lease) and a few more for a shared CPU
    assert claim.heartbeat.lost.wait(timeout=5), "the heartbeat never beat on the ended session"
    assert claim.release() == LOCK_SESSION_ENDED
    assert holder(engine) is None
    with engine.connect() as conn:  # the run still says what the phase committed
        saved = conn.execute(
            text("SELECT counts FROM messenger.reaper_runs WHERE run_id = :r"), {"r": run_id}
        ).scalar_one()
    assert saved[EMPTY_ROOM.count_key] == 7


def test_lock_never_returns_to_the_pool(settings, engine):
    run_id = str(uuid.uuid4())
    assert runs(settings, engine).take(run_id, None).skipped is None
    for phase in ORDER:
        claim = runs(settings, engine).claim(run_id, phase)
        assert claim is not None and claim.release() is None
    # every pooled connection is checked for a stranded advisory lock
    conns = [engine.connect() for _ in range(engine.pool.size())]
    try:
        for conn in conns:
            stranded = conn.execute(
                text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND pid = pg_backend_pid()"
                )
            ).scalar()
            assert stranded == 0
    finally:
        for conn in conns:
            conn.close()


@pytest.mark.process
def test_killed_runner_loses_the_lock_at_once(database_url, engine):
    proc = _start_holder(database_url, "time.sleep(60)")
    assert holder(engine) is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    waited = _wait_free(engine, timeout=10)
    figure(f"lock free {waited:.2f}s after kill -9 (lease 10s)")
    # "at once": the server sees the connection close; nothing waits for a lease
    assert waited <= DEFAULT_LEASE_S / 5, waited


@pytest.mark.process
def test_frozen_runner_loses_the_lock_within_its_lease(database_url, engine):
    """SIGSTOP: the heartbeat stops with the process, the server ends the silent
    lock session after one lease."""
    lease = 2.0
    proc = _start_holder(database_url, "os.kill(os.getpid(), signal.SIGSTOP)", lease_s=lease)
    try:
        time.sleep(0.5)
        assert holder(engine) is not None, "released before the lease"
        waited = _wait_free(engine, timeout=lease + 5)
        assert waited <= lease + SERVER_MARGIN_S, waited
        figure(
            f"frozen runner's lock freed by PostgreSQL after {waited + 0.5:.2f}s (lease {lease}s)"
        )
        with engine.connect() as conn:
            assert conn.execute(text(f"SELECT pg_try_advisory_xact_lock({KEY})")).scalar()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.process
def test_a_live_phase_keeps_the_lock_past_its_lease(database_url, engine):
    """The heartbeat proves the phase alive: three leases later it still holds the lock."""
    lease = 2.0
    proc = _start_holder(database_url, "time.sleep(60)", lease_s=lease)
    try:
        pid = holder(engine)
        assert pid is not None
        time.sleep(3 * lease)
        assert holder(engine) == pid
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.process
def test_hung_runner_loses_the_lock_one_lease_after_the_lock_ttl(database_url, engine):
    """Alive but never ending: the heartbeat gives up at REAPER_LOCK_TTL, the
    server ends the session one lease later."""
    ttl, lease = 4.0, 2.0
    proc = _start_holder(database_url, "time.sleep(60)", ttl_s=ttl, lease_s=lease)
    started = time.monotonic()  # it holds the lock: not its process's start (imports)
    try:
        time.sleep(ttl - 1)
        assert holder(engine) is not None, "released before the lock TTL"
        _wait_free(engine, timeout=lease + 5)
        freed = time.monotonic() - started
        # the heartbeat gives up at the TTL; the server ends the session a lease later
        assert ttl <= freed <= ttl + lease + SERVER_MARGIN_S, freed
        figure(f"hung runner's lock freed after {freed:.2f}s (TTL {ttl}s, lease {lease}s)")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
