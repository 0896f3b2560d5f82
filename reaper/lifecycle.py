"""The worker's life, from start to exit: one handler per Celery signal.

Each handler calls its steps in the order written here; no other module of
the reaper connects to these signals, so no import order decides anything.

- ``worker_init`` (the main process, before the pool forks): JSON logs; the
  stop event, which the children share; Prometheus in multiprocess mode in a
  directory of its own (``PROMETHEUS_MULTIPROC_DIR`` from the worker's
  environment, else a private temporary one), wiped now; tracing here when the
  pool (solo, threads) runs tasks in this process; a warning when no recorder
  is configured.
- ``worker_ready``: the main process serves ``/metrics`` and ``/healthz``.
- ``worker_process_init`` (each pool child, after the fork): drop the
  connections inherited from the parent, then set up tracing.
- ``worker_shutting_down``: the stop event is set; phases and relay passes end
  after the batches in flight.
- ``worker_process_shutdown`` (each pool child): flush the Kafka producer,
  then the spans, then drop the child's live gauges.
- ``worker_shutdown`` (the main process): flush the Kafka producer and the
  spans of a solo or threads pool, then stop serving metrics.

Anything else that loads the app (``celery call``, ``inspect``, Flower) gets
none of these signals and never creates metrics.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import Any

from celery.signals import (
    after_setup_logger,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from reaper import db, health, kafka, logs, metrics, tracing, wiring
from reaper.config import get_settings

logger = logs.get_logger("worker")

# Set by the worker's main process when a warm shutdown begins; the pool
# children (forked after worker_init, so they share it) end their phase after
# the batch in flight, and a relay pass after its batches in flight.
_stopping: Any = None

# The main process's /metrics and /healthz server, from worker_ready on.
_server: metrics.Server | None = None


def stopping() -> Any:
    """An event (``is_set()``) that is set when this worker is shutting down."""
    global _stopping
    if _stopping is None:
        _stopping = multiprocessing.Event()
    return _stopping


@after_setup_logger.connect
def _on_setup_logger(**_: Any) -> None:
    logs.configure(logging.getLevelName(logging.getLogger().level) or "INFO")


@worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    logs.configure()
    stopping()  # created before the pool forks
    settings = get_settings()
    if settings.metrics_port:
        metrics.enable_multiprocess(os.environ.get(metrics.MULTIPROC_ENV) or None)
    # solo/threads pools run tasks in this process: no child will configure it
    pool = str(getattr(sender, "pool_cls", "")).lower()
    if "prefork" not in pool and not tracing.enabled():
        tracing.configure()
    if not settings.recorder_url:
        logs.log(
            logger,
            "recorder.disabled",
            level=logging.WARNING,
            reason="REAPER_RECORDER_URL is unset: no recording stop signals will be sent",
        )


@worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    global _server
    settings = get_settings()
    if not settings.metrics_port or metrics.multiprocess_dir() is None or _server is not None:
        return
    try:
        _server = metrics.serve(
            settings.metrics_port,
            settings.metrics_address,
            refresh=wiring.gauges(settings).refresh,
            health=health.Check(settings).answer,
        )
    except OSError as exc:
        logs.log(
            logger,
            "metrics.unavailable",
            level=logging.ERROR,
            port=settings.metrics_port,
            error=str(exc),
        )


@worker_process_init.connect
def _on_worker_process_init(**_: Any) -> None:
    # Connections inherited from the parent must not be used by the child.
    db.dispose_engines(close=False)
    tracing.configure()


@worker_shutting_down.connect
def _on_worker_shutting_down(sig: str = "", how: str = "", **_: Any) -> None:
    stopping().set()
    logs.log(logger, "worker.stopping", signal=sig, how=how)


@worker_process_shutdown.connect
def _on_worker_process_shutdown(**_: Any) -> None:
    # The producer is created lazily per process by the relay: flush what is in
    # flight first, while tracing and metrics still record what it does.
    kafka.close_producer()
    tracing.shutdown()
    metrics.child_exited(os.getpid())


@worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    global _server
    kafka.close_producer()
    tracing.shutdown()  # a solo or threads pool traced in this process
    if _server is not None:
        _server.close()
        _server = None
