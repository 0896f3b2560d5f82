"""Prometheus metrics (CONTRACT §9), correct under Celery's prefork pool.

Every metric lives in a private registry, so no other process that happens to
load the app (``celery flower`` serves its own default registry) ever shows or
serves them. Callers use the small functions below, never the objects.

Prefork: the worker's children each count in their own memory-mapped file
under ``PROMETHEUS_MULTIPROC_DIR`` (one directory per worker, wiped when the
worker starts); the worker's parent process serves ``/metrics`` on
``REAPER_METRICS_PORT`` from a fresh registry with a ``MultiProcessCollector``,
which sums the files of every child, live or replaced, so a counter neither
resets nor double-counts when a child is recycled. Gauges are measured from the
database (the most recent measurement wins, whoever took it).

``celery`` imports prometheus_client before it loads the app (Flower registers
a ``celery`` sub-command), so the environment variable alone comes too late:
:func:`prepare_process` also switches prometheus_client's value class, which is
what the variable decides and is read only when a metric is created. It runs
when the app is loaded, before any metric exists in that process.
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    start_http_server,
    values,
)

from reaper.logs import get_logger, log

logger = get_logger("metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
RUN_RESULTS = ("completed", "skipped", "failed")
# CONTRACT §9: closed conferences only. A run the mass-closure guard stopped
# closed nothing: it has its own counter (mass_closure_blocked_total).
ITEM_OUTCOMES = ("empty_timeout", "provision_failed", "stale_timeout")
PHASE_NAMES = ("empty_room", "provision_timeout", "stale_live")

# The names a dashboard or alert may use (the test of ops/ checks against it).
EXPORTED = (
    "messenger_conf_reaper_run_total",
    "messenger_conf_reaper_cycle_duration_seconds",
    "messenger_conf_reaper_items_total",
    "messenger_conf_reaper_active_backlog",
    "messenger_conf_reaper_skip_locked_total",
    "messenger_conf_reaper_errors_total",
    "messenger_conf_reaper_closing_lateness_seconds",
    "messenger_conf_reaper_mass_closure_blocked_total",
    "messenger_conf_reaper_recorder_stop_failed_total",
    "messenger_outbox_relay_published_total",
    "messenger_outbox_pending",
    "messenger_outbox_oldest_pending_age_seconds",
)

# A cycle's target is < 5 s, its budget REAPER_MAX_RUN_DURATION (30 s).
CYCLE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
# The SLO: closed within one polling interval (30 s) of becoming eligible.
LATENESS_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600, 1800, 3600)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.run_total = Counter(
            "messenger_conf_reaper_run_total",
            "Reap cycles by result (completed, skipped: lock held elsewhere, failed).",
            ["result"],
            registry=r,
        )
        self.cycle_duration = Histogram(
            "messenger_conf_reaper_cycle_duration_seconds",
            "Wall time of a reap cycle that ran (skipped cycles are not observed).",
            buckets=CYCLE_BUCKETS,
            registry=r,
        )
        self.items = Counter(
            "messenger_conf_reaper_items_total",
            "Conferences closed, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.backlog = Gauge(
            "messenger_conf_reaper_active_backlog",
            "Active or Provisioning conferences already past their phase's window.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.skip_locked = Counter(
            "messenger_conf_reaper_skip_locked_total",
            "Eligible conferences left for the next cycle because a command held their row.",
            registry=r,
        )
        self.errors = Counter(
            "messenger_conf_reaper_errors_total",
            "Failed phases (database errors) and poison conferences the guard rejected.",
            registry=r,
        )
        self.lateness = Histogram(
            "messenger_conf_reaper_closing_lateness_seconds",
            "ended_at minus the moment the conference became eligible, per phase.",
            ["phase"],
            buckets=LATENESS_BUCKETS,
            registry=r,
        )
        self.mass_closure_blocked = Counter(
            "messenger_conf_reaper_mass_closure_blocked_total",
            "stale_live runs the mass-closure guard stopped (they closed nothing).",
            registry=r,
        )
        self.recorder_stop_failed = Counter(
            "messenger_conf_reaper_recorder_stop_failed_total",
            "Recording stop signals the recorder did not take (error, timeout, refused).",
            registry=r,
        )
        self.relay_published = Counter(
            "messenger_outbox_relay_published_total",
            "integration_outbox rows published to Kafka.",
            registry=r,
        )
        self.outbox_pending = Gauge(
            "messenger_outbox_pending",
            "integration_outbox rows not yet published.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.outbox_oldest = Gauge(
            "messenger_outbox_oldest_pending_age_seconds",
            "Age of the oldest unpublished integration_outbox row (0 when none).",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        # Series exist (at 0) from the start: an alert on increase() needs them.
        for result in RUN_RESULTS:
            self.run_total.labels(result=result)
        for outcome in ITEM_OUTCOMES:
            self.items.labels(outcome=outcome)
        for phase in PHASE_NAMES:
            self.lateness.labels(phase=phase)


_lock = threading.Lock()
_metrics: _Metrics | None = None
_multiproc_dir: str | None = None


def _m() -> _Metrics:
    global _metrics
    if _metrics is None:
        with _lock:
            if _metrics is None:
                _metrics = _Metrics()
    return _metrics


# -- process set-up ----------------------------------------------------------


def prepare_process(command: str | None, metrics_port: int) -> str | None:
    """Choose how this process counts; call before any metric is created.

    The worker (``celery worker``, metrics on): multiprocess mode in its own
    directory, wiped now. Any other process (Flower, ``celery call``, beat
    alone, the CLI): plain in-memory values, and an inherited
    ``PROMETHEUS_MULTIPROC_DIR`` is dropped, so it can neither write into a
    worker's directory nor serve what is there.
    """
    if command == "worker" and metrics_port:
        return enable_multiprocess(os.environ.get(MULTIPROC_ENV) or None)
    disable_multiprocess()
    return None


def enable_multiprocess(directory: str | None = None) -> str:
    global _multiproc_dir
    if _metrics is not None:
        raise RuntimeError("metrics already created in this process: multiprocess mode too late")
    if directory is None:
        directory = tempfile.mkdtemp(prefix="reaper-metrics-")
        atexit.register(_remove_private_dir, directory, os.getpid())
    os.makedirs(directory, exist_ok=True)
    for stale in glob.glob(os.path.join(directory, "*.db")):
        os.remove(stale)  # a previous worker's counts are not ours
    os.environ[MULTIPROC_ENV] = directory
    values.ValueClass = values.MultiProcessValue()
    _multiproc_dir = directory
    return directory


def disable_multiprocess() -> None:
    global _multiproc_dir
    os.environ.pop(MULTIPROC_ENV, None)
    os.environ.pop(MULTIPROC_ENV.lower(), None)
    if _metrics is None:
        values.ValueClass = values.MutexValue
    _multiproc_dir = None


def multiprocess_dir() -> str | None:
    return _multiproc_dir


def _remove_private_dir(directory: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that exits first
        shutil.rmtree(directory, ignore_errors=True)


def child_exited(pid: int) -> None:
    """A pool child is gone: drop its live gauges (its counters must stay)."""
    if _multiproc_dir:
        multiprocess.mark_process_dead(pid, _multiproc_dir)


_DB_FILE = re.compile(r"_(\d+)\.db$")


def _sweep_dead_children() -> None:
    """mark_process_dead for children that died without saying so (SIGKILL)."""
    if not _multiproc_dir:
        return
    for path in glob.glob(os.path.join(_multiproc_dir, "gauge_live*.db")):
        match = _DB_FILE.search(path)
        if match and not _alive(int(match[1])):
            child_exited(int(match[1]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- what the reaper calls ---------------------------------------------------


def cycle_finished(*, skipped: bool, failed: bool, duration_seconds: float) -> None:
    m = _m()
    result = "skipped" if skipped else "failed" if failed else "completed"
    m.run_total.labels(result=result).inc()
    if not skipped:
        m.cycle_duration.observe(duration_seconds)


def items_closed(phase: str, outcome: str, lateness_seconds: Iterable[float | None]) -> None:
    m = _m()
    count = 0
    histogram = m.lateness.labels(phase=phase)  # once per batch, not per room
    for lateness in lateness_seconds:
        count += 1
        if lateness is not None:
            histogram.observe(max(0.0, lateness))
    if count:
        m.items.labels(outcome=outcome).inc(count)


def mass_closure_blocked() -> None:
    _m().mass_closure_blocked.inc()


def recorder_stop_failed(count: int) -> None:
    if count > 0:
        _m().recorder_stop_failed.inc(count)


def errors(count: int = 1) -> None:
    if count > 0:
        _m().errors.inc(count)


def skipped_locked(count: int) -> None:
    if count > 0:
        _m().skip_locked.inc(count)


def set_backlog(count: int) -> None:
    _m().backlog.set(count)


# -- what the outbox relay calls ---------------------------------------------


def relay_published(count: int) -> None:
    if count > 0:
        _m().relay_published.inc(count)


def set_outbox(pending: int, oldest_age_seconds: float) -> None:
    m = _m()
    m.outbox_pending.set(pending)
    m.outbox_oldest.set(max(0.0, oldest_age_seconds))


# -- reading and serving -----------------------------------------------------


def registry() -> CollectorRegistry:
    """This process's own registry (in-process use and tests)."""
    return _m().registry


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of this process's registry (0 when absent)."""
    return _m().registry.get_sample_value(name, labels or {}) or 0.0


def exposition() -> bytes:
    """What ``/metrics`` serves: every process's files in multiprocess mode."""
    return generate_latest(_serving_registry())


class _Refresh:
    """Collected first: brings the database gauges up to date before a scrape."""

    def __init__(self, refresh: Callable[[], None], min_interval: float) -> None:
        self.refresh = refresh
        self.min_interval = min_interval
        self.last = 0.0
        self.lock = threading.Lock()

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        with self.lock:
            now = time.monotonic()
            if now - self.last >= self.min_interval:
                self.last = now
                self.refresh()
        _sweep_dead_children()
        return []


def _serving_registry(refresh: Callable[[], None] | None = None) -> CollectorRegistry:
    if not _multiproc_dir:
        if refresh is not None:
            refresh()
        return _m().registry
    served = CollectorRegistry()
    if refresh is not None:
        served.register(_Refresh(refresh, min_interval=5.0))
    multiprocess.MultiProcessCollector(served, path=_multiproc_dir)
    return served


@dataclass
class Server:
    port: int
    close: Callable[[], None]


def serve(port: int, address: str, refresh: Callable[[], None] | None = None) -> Server:
    """Serve ``/metrics`` from this process (the worker's parent)."""
    _m()  # the parent's own series (zeros) exist before the first scrape
    httpd, thread = start_http_server(port, address, registry=_serving_registry(refresh))
    bound = httpd.server_address[1]

    def close() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    log(logger, "metrics.serving", port=bound, address=address, multiprocess=bool(_multiproc_dir))
    return Server(bound, close)
