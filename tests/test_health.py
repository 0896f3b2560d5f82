"""``GET /healthz`` on the worker's metrics port (docs/design.md#operator-controls):
200 while cycles complete, 503 once none has for three polling intervals. The
case it exists for: the embedded beat dies and the worker lives on, quietly
scheduling nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.support.ports import free_port
from tests.support.processes import CELERY, ROOT, Worker, children, wait_until

pytestmark = pytest.mark.process

KEYS = {"status", "last_cycle_age_seconds", "last_relay_age_seconds", "database"}


def healthz(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503 still carries the JSON
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


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
        wait_until(lambda: healthz(port)[1].get("last_cycle_age_seconds") is not None, 30,
                   "a cycle completed")  # fmt: skip
        code, body = healthz(port)
        assert code == 200 and set(body) >= KEYS
        assert body["status"] == "ok" and body["database"] == "reachable"
        assert body["last_cycle_age_seconds"] is not None and body["last_cycle_age_seconds"] < 3

        # Every child of the worker dies once: the pool replaces its own, the
        # embedded beat is not restarted, and no tick is sent any more.
        assert worker.proc is not None
        for child in children(worker.proc.pid):
            os.kill(child, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: healthz(port)[0] == 503, 30, "unhealthy after three intervals")
        took = time.monotonic() - killed_at
        code, body = healthz(port)
        assert worker.proc.poll() is None  # the worker itself lives on
        assert body["status"] == "unhealthy" and body["database"] == "reachable"
        assert body["last_cycle_age_seconds"] > 3  # three polling intervals of 1 s

        # The pool still works: a cycle called by hand makes it healthy again.
        subprocess.run(
            [CELERY, "-A", "reaper", "call", "reaper.reap", "--expires", "60"],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        wait_until(lambda: healthz(port)[0] == 200, 30, "healthy after a cycle by hand")
    finally:
        worker.stop()
    print(f"\n[figures] /healthz 503 {took:.1f}s after the embedded beat died (interval 1 s)")
