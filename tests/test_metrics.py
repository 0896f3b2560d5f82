"""Prometheus metrics (docs/design.md#metrics): in-process values, and the real
prefork worker's /metrics."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Connection, create_engine, text

from reaper import metrics
from reaper.cycle import Reaper
from reaper.events import PhaseCompleted, PhaseFailed, RelayBatchCommitted, process_bus
from reaper.wiring import Gauges
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.facts import wired_bus
from tests.support.ports import free_port
from tests.support.processes import ROOT, Worker

CELERY = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "celery")


def value(name: str, **labels: str) -> float:
    return metrics.sample(name, labels)


def snapshot() -> dict[str, float]:
    names = {
        "completed": ("messenger_conf_reaper_run_total", {"result": "completed"}),
        "skipped": ("messenger_conf_reaper_run_total", {"result": "skipped"}),
        "failed": ("messenger_conf_reaper_run_total", {"result": "failed"}),
        "empty": ("messenger_conf_reaper_items_total", {"outcome": "empty_timeout"}),
        "provision": ("messenger_conf_reaper_items_total", {"outcome": "provision_failed"}),
        "stale": ("messenger_conf_reaper_items_total", {"outcome": "stale_timeout"}),
        "errors": ("messenger_conf_reaper_errors_total", {}),
        "skip_locked": ("messenger_conf_reaper_skip_locked_total", {}),
        "cycles_timed": ("messenger_conf_reaper_cycle_duration_seconds_count", {}),
        "late_empty_n": (
            "messenger_conf_reaper_closing_lateness_seconds_count",
            {"phase": "empty_room"},
        ),
        "late_empty_sum": (
            "messenger_conf_reaper_closing_lateness_seconds_sum",
            {"phase": "empty_room"},
        ),
        "late_prov_sum": (
            "messenger_conf_reaper_closing_lateness_seconds_sum",
            {"phase": "provision_timeout"},
        ),
        "late_stale_sum": (
            "messenger_conf_reaper_closing_lateness_seconds_sum",
            {"phase": "stale_live"},
        ),
        "late_le_30": (
            "messenger_conf_reaper_closing_lateness_seconds_bucket",
            {"phase": "empty_room", "le": "30.0"},
        ),
    }
    return {key: value(name, **labels) for key, (name, labels) in names.items()}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def test_a_cycle_counts_items_lateness_errors_and_measures_the_backlog(settings, refusing_database):
    engine = refusing_database
    now = f.db_now(engine)
    with engine.begin() as conn:
        f.conference(conn, as_of=now, idle=timedelta(seconds=100))  # 10 s late
        f.conference(conn, as_of=now, idle=timedelta(seconds=130))  # 40 s late
        f.conference(conn, as_of=now, status="Provisioning", age=timedelta(minutes=3))  # 60 s
        f.conference(conn, as_of=now, idle=timedelta(hours=5), participants=2)  # 1 h late
        poison = f.conference(conn, as_of=now, idle=timedelta(seconds=100))
        f.refuse(conn, poison["id"])  # the database refuses it: poison
        f.conference(conn, as_of=now, idle=timedelta(seconds=30))  # within the grace
    before = snapshot()
    # as_of: the database's clock now; lateness runs on to each batch's commit
    result = Reaper(settings, engine=engine).run_cycle()
    assert result["failed_count"] == 1
    assert delta(before, snapshot()) == {
        "completed": 1,
        "empty": 2,
        "provision": 1,
        "stale": 1,
        "errors": 1,  # the poison row
        "cycles_timed": 1,
        "late_empty_n": 2,
        "late_empty_sum": pytest.approx(50.0, abs=2.0),
        "late_prov_sum": pytest.approx(60.0, abs=1.0),
        "late_stale_sum": pytest.approx(3600.0, abs=1.0),
        "late_le_30": 1,
    }
    # Refreshed at the end of the cycle: only the poison row is still past its window.
    assert value("messenger_conf_reaper_active_backlog") == 1
    assert value("messenger_outbox_pending") == 3  # two empty rooms + one stale
    assert value("messenger_outbox_oldest_pending_age_seconds") >= 0
    with engine.connect() as conn:
        assert f.session_row(conn, poison["id"])["status"] == "Active"


def test_a_skipped_cycle_is_counted_as_skipped_and_not_timed(settings, engine):
    before = snapshot()
    with engine.connect() as holder_conn, holder_conn.begin():
        holder_conn.execute(
            text(
                "SELECT pg_advisory_xact_lock("
                "hashtextextended('messenger.conference-room-reaper', 0))"
            )
        )
        result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["skipped"] is True
    assert delta(before, snapshot()) == {"skipped": 1}


def test_a_database_outage_counts_a_failed_run_and_its_errors(settings, caplog):
    caplog.set_level(logging.INFO, "reaper")
    dead = create_engine("postgresql+psycopg2://postgres@127.0.0.1:1/nowhere")
    before = snapshot()
    # a process whose database is down: the cycle's head and the gauges fail alike
    result = Reaper(settings, engine=dead, bus=wired_bus(settings, dead)).run_cycle(T0)
    assert result["skipped"] is False
    # the head cannot take the run: no phase runs, one failed cycle, one error
    assert delta(before, snapshot()) == {"failed": 1, "errors": 1, "cycles_timed": 1}
    assert "metrics.refresh_failed" in [getattr(r, "event", None) for r in caplog.records]


def test_rows_held_by_a_command_are_counted_as_skip_locked(settings, engine):
    with engine.begin() as conn:
        held = f.conference(conn, idle=timedelta(seconds=100))
        f.conference(conn, idle=timedelta(seconds=100))
    before = snapshot()
    with f.command_holding(engine, held["id"]):
        result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["skipped_locked_count"] == 1
    assert delta(before, snapshot())["skip_locked"] == 1


def test_relay_functions_and_gauges(settings, engine):
    before = value("messenger_outbox_relay_published_total")
    process_bus.emit(RelayBatchCommitted(claimed=4, published=3, failed=1, parked=0))
    process_bus.emit(RelayBatchCommitted(claimed=0, published=0, failed=0, parked=0))
    assert value("messenger_outbox_relay_published_total") == before + 3
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload,"
                " created_at) VALUES (gen_random_uuid(), 't', 'k', '{}', now() - interval '90 s')"
            )
        )
    Gauges(engine, settings, process_bus).refresh()
    assert value("messenger_conf_reaper_active_backlog") == 0
    assert value("messenger_outbox_pending") == 1
    assert 89 < value("messenger_outbox_oldest_pending_age_seconds") < 600


LAST_RUN = "messenger_conf_reaper_last_run_completed_timestamp_seconds"


def add_run(conn: Connection, run_id: str, finished_ago_s: float, outcome: str) -> None:
    conn.execute(
        text(
            "INSERT INTO messenger.reaper_runs (run_id, as_of, started_at, deadline,"
            " lease_expires_at, owner, finished_at, outcome)"
            " VALUES (:run_id, now(), now(), now(), now(), 'another-host:1',"
            " now() - make_interval(secs => :ago), :outcome)"
        ),
        {"run_id": run_id, "ago": finished_ago_s, "outcome": outcome},
    )


def test_the_last_completed_run_is_measured_whoever_ran_it(settings, engine):
    with engine.begin() as conn:
        add_run(conn, "done-by-a-replica", 100, "completed")
        add_run(conn, "failed-later", 10, "failed")
        add_run(conn, "taken-over-later", 5, "taken_over")
        completed_at = conn.execute(
            text("SELECT finished_at FROM messenger.reaper_runs WHERE run_id = 'done-by-a-replica'")
        ).scalar_one()
    Gauges(engine, settings, process_bus).refresh()
    # failed and taken-over runs closed nothing to the end: only completed ones count
    assert value(LAST_RUN) == completed_at.timestamp()

    # a cycle that is skipped (the lock held elsewhere) leaves it where it is
    with engine.connect() as holder_conn, holder_conn.begin():
        holder_conn.execute(
            text(
                "SELECT pg_advisory_xact_lock(hashtextextended("
                "'messenger.conference-room-reaper', 0))"
            )
        )
        assert Reaper(settings, engine=engine).run_cycle(T0)["skipped"] is True
    assert value(LAST_RUN) == completed_at.timestamp()

    # a cycle that completes moves it (measured after every cycle)
    Reaper(settings, engine=engine).run_cycle()
    assert 0 <= time.time() - value(LAST_RUN) < 5


# -- the real worker -----------------------------------------------------------


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        body = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            key = s.name + (
                "{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}"
                if s.labels
                else ""
            )
            samples[key] = s.value
    return samples


def succeeded(task_id: str, out: str) -> bool:
    """The worker's output says the task ``task_id`` succeeded."""
    return f"reaper.reap[{task_id}] succeeded" in out


def call_reap() -> str:
    return subprocess.run(
        [CELERY, "-A", "reaper", "call", "reaper.reap", "--expires", "60"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()


def test_prefork_worker_serves_whole_counts_across_replaced_children(
    engine, tmp_path, kafka_broker
):
    """Children recycled after every task: the counts of dead children must stay, once."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_999999.db").write_bytes(b"left over by an earlier worker")
    port = free_port()
    now = datetime.now(UTC)
    with engine.begin() as conn:
        for _ in range(3):
            f.conference(conn, as_of=now, idle=timedelta(minutes=5))
        f.conference(conn, as_of=now, status="Provisioning", age=timedelta(minutes=5))
    worker = Worker(
        tmp_path,
        {
            "REAPER_METRICS_PORT": str(port),
            "REAPER_METRICS_ADDRESS": "127.0.0.1",
            "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
            "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker,
            "REAPER_POLLING_INTERVAL": "3600",
        },
        beat=False,
        extra_args=("--max-tasks-per-child", "1"),
    ).start()
    try:
        assert not (metrics_dir / "counter_999999.db").exists()  # wiped at start
        first = scrape(port)
        assert first['messenger_conf_reaper_run_total{result="completed"}'] == 0
        cycles = 3
        for n in range(1, cycles + 1):
            task_id = call_reap()
            worker.wait_for(partial(succeeded, task_id), 60, f"cycle {n}")
        # the last child may still be ending: poll rather than sleep a guess
        deadline = time.monotonic() + 15
        samples = scrape(port)
        while (
            samples['messenger_conf_reaper_run_total{result="completed"}'] < cycles
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
            samples = scrape(port)
    finally:
        assert worker.stop() == 0
    assert samples['messenger_conf_reaper_run_total{result="completed"}'] == cycles
    assert samples['messenger_conf_reaper_run_total{result="skipped"}'] == 0
    assert samples['messenger_conf_reaper_items_total{outcome="empty_timeout"}'] == 3
    assert samples['messenger_conf_reaper_items_total{outcome="provision_failed"}'] == 1
    assert samples['messenger_conf_reaper_items_total{outcome="stale_timeout"}'] == 0
    assert samples["messenger_conf_reaper_cycle_duration_seconds_count"] == cycles
    assert samples['messenger_conf_reaper_closing_lateness_seconds_count{phase="empty_room"}'] == 3
    assert samples["messenger_conf_reaper_active_backlog"] == 0
    assert samples["messenger_conf_reaper_errors_total"] == 0
    assert "messenger_outbox_pending" in samples
    # served once, by the parent; several short-lived children counted
    assert worker.output().count("metrics.serving") == 1
    assert len(list(metrics_dir.glob("counter_*.db"))) >= 3
    assert not any(k.startswith("flower_") for k in samples)


def run_script(script: str, multiproc_dir: Path, *, env_dir: bool = True) -> None:
    """Run ``script`` in a fresh interpreter (the metrics mode is per process); it prints ok.
    ``env_dir``: PROMETHEUS_MULTIPROC_DIR is in its environment from the start."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if env_dir:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc_dir)
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


PUBLISH = """
from reaper.events import Bus, RelayBatchCommitted
bus = Bus()
metrics.subscribe(bus)
def published(n):
    bus.emit(RelayBatchCommitted(claimed=n, published=n, failed=0, parked=0))
"""


@pytest.mark.process
@pytest.mark.parametrize("documented", [True, False], ids=["env-at-start", "env-unset"])
def test_multiprocess_mode_files_wipe_and_dead_children(tmp_path, documented):
    """In a fresh process (the mode is per process): wipe at start, mark_process_dead.
    With PROMETHEUS_MULTIPROC_DIR set when the process starts (the documented way)
    nothing is switched; without it, the value class is."""
    script = f"""
import os, subprocess, sys
from pathlib import Path
directory = Path({str(tmp_path)!r})
(directory / "counter_424242.db").write_bytes(b"stale")
from prometheus_client import values
chosen_at_import = values.ValueClass
from reaper import metrics, multiproc
from tests.support.metrics import exposition
assert multiproc.enable_multiprocess(str(directory)) == str(directory)
assert not (directory / "counter_424242.db").exists()
assert values.ValueClass is not values.MutexValue
assert (values.ValueClass is chosen_at_import) == {documented}
{PUBLISH}
published(2)
child = os.fork()
if child == 0:
    published(5)
    from prometheus_client import Gauge
    live = Gauge("reaper_test_live", "t", multiprocess_mode="livesum", registry=None)
    live.set(1)
    os._exit(0)
os.waitpid(child, 0)
assert (directory / f"gauge_livesum_{{child}}.db").exists()
body = exposition().decode()
assert "messenger_outbox_relay_published_total 7.0" in body, body
multiproc._sweep_dead_children()  # the child died without saying so
assert not (directory / f"gauge_livesum_{{child}}.db").exists()
assert (directory / f"counter_{{child}}.db").exists()  # its counts stay
assert "messenger_outbox_relay_published_total 7.0" in exposition().decode()
print("ok")
"""
    run_script(script, tmp_path, env_dir=documented)


@pytest.mark.process
def test_other_processes_never_use_the_workers_directory(tmp_path):
    """Flower (or anything not the worker) that inherited the directory keeps out of it."""
    script = f"""
import os
from reaper import metrics, multiproc
multiproc.keep_out_of_multiprocess()
assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
{PUBLISH}
published(1)
from prometheus_client import values
assert values.ValueClass is values.MutexValue
print("ok")
"""
    run_script(script, tmp_path)
    assert list(tmp_path.iterdir()) == []


LAST_CYCLE = "messenger_conf_reaper_last_cycle_timestamp_seconds"


def test_a_phase_finished_on_this_worker_moves_its_last_cycle_gauge(settings):
    """Replicas share the queue, so a phase is as much this worker's share of a
    cycle as the cycle's end; a failed phase is not."""
    bus = wired_bus(settings)
    failed = PhaseFailed(run_id="r", phase="empty_room", error="e", started_ns=0, ended_ns=0)
    before = value(LAST_CYCLE)
    time.sleep(0.01)
    bus.emit(failed)
    assert value(LAST_CYCLE) == before
    emitted_at = time.time()
    bus.emit(PhaseCompleted(run_id="r", phase="empty_room", started_ns=0, ended_ns=0))
    assert before < emitted_at <= value(LAST_CYCLE) <= time.time()
