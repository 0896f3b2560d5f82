"""The single-runner lock: exclusive, bounded by LOCK_TTL, never pooled."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
from sqlalchemy import Engine, text

from reaper.lock import holder, run_lock

KEY = "hashtextextended('messenger.conference-room-reaper', 0)"


def _holder_script(database_url: str, ttl_s: float, then: str) -> str:
    return textwrap.dedent(
        f"""
        import os, signal, sys, time
        from datetime import timedelta
        from reaper.db import engine_for
        from reaper.lock import run_lock
        engine = engine_for({database_url!r})
        with run_lock(engine, timedelta(seconds={ttl_s})) as taken_by:
            assert taken_by is None, taken_by
            print("locked", flush=True)
            {then}
        """
    )


def _start_holder(database_url: str, ttl_s: float, then: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _holder_script(database_url, ttl_s, then)],
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


def test_lock_is_exclusive_and_names_its_holder(engine):
    with run_lock(engine, timedelta(seconds=10)) as first:
        assert first is None
        pid = holder(engine)
        assert isinstance(pid, int) and pid > 0
        with run_lock(engine, timedelta(seconds=10)) as second:
            assert second == pid
    assert holder(engine) is None


def test_lock_is_released_when_the_body_raises(engine):
    with pytest.raises(RuntimeError), run_lock(engine, timedelta(seconds=10)):
        raise RuntimeError("boom")
    assert holder(engine) is None


def test_lock_never_returns_to_the_pool(engine):
    for _ in range(3):
        with run_lock(engine, timedelta(seconds=10)) as taken_by:
            assert taken_by is None
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


def test_killed_runner_loses_the_lock_at_once(database_url, engine):
    proc = _start_holder(database_url, 60, "time.sleep(60)")
    assert holder(engine) is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    waited = _wait_free(engine, timeout=10)
    print(f"\n[figures] lock free {waited:.2f}s after kill -9 (TTL 60s)")


def test_hung_runner_loses_the_lock_within_ttl(database_url, engine):
    ttl = 2.0
    proc = _start_holder(database_url, ttl, "os.kill(os.getpid(), signal.SIGSTOP)")
    try:
        time.sleep(0.5)
        assert holder(engine) is not None, "released before the TTL"
        waited = _wait_free(engine, timeout=ttl + 5)
        assert waited <= ttl + 1.5
        print(
            f"\n[figures] hung runner's lock freed by PostgreSQL after {waited + 0.5:.2f}s "
            f"(TTL {ttl}s)"
        )
        with engine.connect() as conn:
            assert conn.execute(text(f"SELECT pg_try_advisory_xact_lock({KEY})")).scalar()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
