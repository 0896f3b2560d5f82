"""Flower: never without basic auth; shows a cycle (reaper.reap + its three phases)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from reaper.phases import ORDER
from tests.support import factory as f
from tests.support.ports import free_port, wait_for_port
from tests.support.processes import ROOT, Worker, wait_until

CELERY = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "celery")
AUTH = "ops:flower-Secret-1"


def flower_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
    env.update(extra)
    return env


def flower_args(port: int) -> list[str]:
    return [CELERY, "-A", "reaper", "flower", "--address=127.0.0.1", f"--port={port}"]


@pytest.mark.parametrize(
    ("auth", "extra", "why"),
    [
        (None, [], "is not set"),
        ("", [], "is not set"),
        ("ops:", [], "non-empty password"),
        ("ops", [], "non-empty password"),
        (AUTH, ["--basic-auth="], "emptied by an option"),
    ],
)
@pytest.mark.process
def test_flower_refuses_to_start_without_basic_auth(auth, extra, why):
    port = free_port()
    env = flower_env(**({"FLOWER_BASIC_AUTH": auth} if auth is not None else {}))
    done = subprocess.run(
        flower_args(port) + extra, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "refusing to start Flower: FLOWER_BASIC_AUTH" in done.stderr
    assert why in done.stderr


def get(url: str, auth: str | None = AUTH) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_flower_shows_a_cycle_and_its_three_phases(engine, tmp_path, kafka_broker):
    metrics_dir = tmp_path / "metrics"  # shared by both, as a Procfile's environment is
    metrics_port, flower_port = free_port(), free_port()
    shared = {
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker,
        "REAPER_POLLING_INTERVAL": "3600",
    }
    now = datetime.now(UTC)
    with engine.begin() as conn:
        empty = f.conference(conn, as_of=now, idle=timedelta(minutes=5))
        provisioning = f.conference(conn, as_of=now, status="Provisioning", age=timedelta(hours=1))
    worker = Worker(
        tmp_path,
        {**shared, "REAPER_METRICS_PORT": str(metrics_port), "REAPER_METRICS_ADDRESS": "127.0.0.1"},
        beat=False,
    ).start()
    flower_log = open(tmp_path / "flower.log", "wb")  # noqa: SIM115 - closed below
    flower = subprocess.Popen(
        flower_args(flower_port),
        cwd=ROOT,
        env=flower_env(**shared, FLOWER_BASIC_AUTH=AUTH),
        stdout=flower_log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{flower_port}"
    try:
        wait_for_port(flower_port, timeout=30)
        assert get(f"{base}/api/tasks", auth=None)[0] == 401
        assert get(f"{base}/api/tasks", auth="ops:wrong")[0] == 401
        assert get(f"{base}/", auth=None)[0] == 401
        wait_until(
            lambda: any(
                "reaper@" in name for name in json.loads(get(f"{base}/api/workers")[1] or b"{}")
            ),
            30,
            "Flower sees the worker",
        )
        task_id = subprocess.run(
            [CELERY, "-A", "reaper", "call", "reaper.reap", "--expires", "60"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()

        def cycle_in_flower():
            status, body = get(f"{base}/api/tasks?limit=100")
            assert status == 200
            tasks = json.loads(body)
            reap = tasks.get(task_id)
            phases = [
                t
                for t in tasks.values()
                if t.get("name") == "reaper.reap_phase" and t.get("root_id") == task_id
            ]
            done = [t for t in phases if t.get("state") == "SUCCESS"]
            if reap and reap.get("state") == "SUCCESS" and len(done) == 3:
                return reap, phases
            return None

        reap, phases = wait_until(cycle_in_flower, 60, "reaper.reap and three phases SUCCESS")
        assert reap["name"] == "reaper.reap"
        assert len(phases) == 3
        assert "'empty_timeout_count': 1" in reap["result"]
        assert "'provision_failed_count': 1" in reap["result"]
        # one task per phase, each named in its arguments as Flower shows them
        shown = [{n for n in ORDER if n in p["args"]} for p in phases]
        assert sorted(n for names in shown for n in names) == [
            "empty_room",
            "provision_timeout",
            "stale_live",
        ]
        with engine.connect() as conn:
            assert f.session_row(conn, empty["id"])["status"] == "Ended"
            assert f.session_row(conn, provisioning["id"])["status"] == "Failed"

        # Flower's own /metrics (unauthenticated by design) never shows the reaper's,
        # and the worker's never shows Flower's, though both share one directory.
        status, flower_metrics = get(f"{base}/metrics", auth=None)
        assert status == 200 and b"flower_events_total" in flower_metrics
        assert b"messenger_conf_reaper" not in flower_metrics
        status, worker_metrics = get(f"http://127.0.0.1:{metrics_port}/metrics", auth=None)
        assert status == 200
        assert b'messenger_conf_reaper_run_total{result="completed"} 1.0' in worker_metrics
        assert b"flower_" not in worker_metrics
    finally:
        flower.terminate()
        flower.wait(timeout=20)
        flower_log.close()
        worker.stop()
