"""How the worker's processes count together (docs/design.md#metrics): Prometheus
in multiprocess mode under Celery's prefork pool.

Prefork: the worker's children each count in their own memory-mapped file
under ``PROMETHEUS_MULTIPROC_DIR`` (one directory per worker, wiped when the
worker starts); the worker's main process serves ``/metrics`` on
``REAPER_METRICS_PORT`` from a fresh registry with a ``MultiProcessCollector``,
which sums the files of every child, live or replaced, so a counter neither
resets nor double-counts when a child is recycled. Gauges are measured from the
database (the most recent measurement wins, whoever took it).

The documented way: ``PROMETHEUS_MULTIPROC_DIR`` in the worker's environment
when it starts (the Procfile, the compose file and the Dockerfile set it), so
prometheus_client picks its multiprocess values when it is imported. Without
it, ``celery`` has imported prometheus_client before the app could set the
variable (Flower registers a ``celery`` sub-command), and the value class
prometheus_client chose at import is switched (see :func:`_use_values`).
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
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, multiprocess, values

from reaper import metrics

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_multiproc_dir: str | None = None


# -- process set-up ----------------------------------------------------------

# What prometheus_client saw when it was imported (imported above, so now).
_ENV_AT_IMPORT = os.environ.get(MULTIPROC_ENV)


def enable_multiprocess(directory: str | None = None) -> str:
    """The worker's main process, before its pool forks and before any metric exists."""
    global _multiproc_dir
    if metrics.created():
        raise RuntimeError("metrics already created in this process: multiprocess mode too late")
    if directory is None:
        directory = tempfile.mkdtemp(prefix="reaper-metrics-")
        atexit.register(_remove_private_dir, directory, os.getpid())
    os.makedirs(directory, exist_ok=True)
    for stale in glob.glob(os.path.join(directory, "*.db")):
        os.remove(stale)  # a previous worker's counts are not ours
    os.environ[MULTIPROC_ENV] = directory
    if directory != _ENV_AT_IMPORT:
        _use_values(values.MultiProcessValue())
    _multiproc_dir = directory
    return directory


def keep_out_of_multiprocess() -> None:
    """A process that is not the worker (Flower) and inherited the worker's
    directory: its metrics stay in its own memory, never in that directory."""
    global _multiproc_dir
    os.environ.pop(MULTIPROC_ENV, None)
    os.environ.pop(MULTIPROC_ENV.lower(), None)
    if _ENV_AT_IMPORT:
        _use_values(values.MutexValue)
    _multiproc_dir = None


def _use_values(value_class: Any) -> None:
    """Switch the value class prometheus_client chose from the environment at import.

    prometheus_client (0.20 to 0.26, tested in tests/test_metrics.py) reads
    ``values.ValueClass`` each time a metric is created; the variable is only
    read at import. A release without that attribute fails here, loudly,
    rather than counting into the wrong place.
    """
    if not hasattr(values, "ValueClass"):
        raise RuntimeError("prometheus_client has no values.ValueClass: check reaper/multiproc.py")
    values.ValueClass = value_class


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


# -- what every process counted ------------------------------------------------


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


def serving_registry(refresh: Callable[[], None] | None = None) -> CollectorRegistry:
    """What ``/metrics`` serves: in multiprocess mode the files of every process
    (``refresh`` first, at most every 5 s), else this process's own registry."""
    if not _multiproc_dir:
        if refresh is not None:
            refresh()
        return metrics.registry()
    served = CollectorRegistry()
    if refresh is not None:
        served.register(_Refresh(refresh, min_interval=5.0))
    multiprocess.MultiProcessCollector(served, path=_multiproc_dir)
    return served


def read(name: str) -> float | None:
    """The value ``/metrics`` would serve for an unlabelled series (all processes)."""
    for family in serving_registry().collect():
        for sample_ in family.samples:
            if sample_.name == name and not sample_.labels:
                return sample_.value
    return None
