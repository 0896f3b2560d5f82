"""The worker's life, from start to exit: one handler per Celery signal.

Each handler calls its steps in the order written here; no other module of
the reaper connects to these signals, so no import order decides anything.

- ``worker_init`` (the main process, before the pool forks): JSON logs; the
  schema check (reaper/schema.py: a schema this release does not run on ends
  the worker here, one line and exit 3, before it consumes anything); the
  stop event, which the children share; Prometheus in multiprocess mode in a
  directory of its own (``PROMETHEUS_MULTIPROC_DIR`` from the worker's
  environment, else a private temporary one), wiped now; tracing here when the
  pool (solo, threads) runs tasks in this process; a warning when no recorder
  is configured; then, for a prefork pool, what start-up built is frozen out
  of the garbage collector's sight (``gc.freeze``), before the pool forks.
- ``beat_init`` (``celery beat`` on its own): the schema check, as the
  worker's; an embedded beat (``-B``) was checked with its worker.
- ``worker_ready``: the main process serves ``/metrics`` and ``/healthz``.
- ``worker_process_init`` (each pool child, after the fork): drop the
  connections inherited from the parent, set up tracing, then freeze what the
  child built so far.
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

import gc
import logging
import multiprocessing
import os
import sys
from functools import partial
from typing import Any

from celery.signals import (
    after_setup_logger,
    beat_init,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from sqlalchemy import make_url
from sqlalchemy.exc import SQLAlchemyError

from reaper import (
    db,
    endpoint,
    health,
    kafka,
    logs,
    multiproc,
    nudge,
    release,
    schema,
    tracing,
    wiring,
)
from reaper.config import Settings, get_settings
from reaper.errors import describe

logger = logs.get_logger("worker")

# Set by the worker's main process when a warm shutdown begins; the pool
# children (forked after worker_init, so they share it) end their phase after
# the batch in flight, and a relay pass after its batches in flight.
_stopping: Any = None

# The main process's /metrics and /healthz server, from worker_ready on.
_server: endpoint.Server | None = None

# Whether this process (or the worker it was forked from) checked the schema:
# an embedded beat is not checked twice.
_schema_checked = False


def stopping() -> Any:
    """An event (``is_set()``) that is set when this worker is shutting down."""
    global _stopping
    if _stopping is None:
        _stopping = multiprocessing.Event()
    return _stopping


@after_setup_logger.connect
def _on_setup_logger(**_: Any) -> None:
    logs.configure(logging.getLevelName(logging.getLogger().level) or "INFO")


def check_schema(settings: Settings, process: str) -> None:
    """Refuse a schema this release does not run on: one log line
    (``schema.refused``, which says what to do) and exit EXIT_SCHEMA, before the
    process consumes or schedules anything. A database that cannot be reached
    is not a refusal: the process starts as it always did (its cycles fail and
    are retried), saying the schema went unchecked."""
    global _schema_checked
    _schema_checked = True
    try:
        verdict = schema.check(db.engine_of(settings), settings)
    except SQLAlchemyError as exc:
        logs.log(
            logger,
            "schema.unchecked",
            level=logging.WARNING,
            process=process,
            release=release.version(),
            # the driver does not echo the password; make sure
            error=describe(exc, secrets=[make_url(settings.database_url).password]),
        )
        return
    finally:
        # Nothing of this connection is handed to the pool's children.
        db.dispose_engines()
    schema.log_verdict(verdict, process=process)
    if not verdict.runs:
        sys.stdout.flush()
        sys.stderr.flush()
        # SystemExit passes Celery's signal dispatch (it catches Exception only)
        # and leaves the process without a traceback.
        raise SystemExit(release.EXIT_SCHEMA)


@worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    logs.configure()
    settings = get_settings()
    check_schema(settings, "worker")
    stopping()  # created before the pool forks
    if settings.metrics_port:
        multiproc.enable_multiprocess(os.environ.get(multiproc.MULTIPROC_ENV) or None)
    # solo/threads pools run tasks in this process: no child will configure it
    pool = str(getattr(sender, "pool_cls", "")).lower()
    if "prefork" not in pool and not tracing.enabled():
        tracing.configure()
    if "prefork" in pool:
        # Before the pool forks, so every child has it: a child's drains ask for
        # relay passes, each child from a thread of its own (reaper/nudge.py).
        # Not for a solo or threads pool (a test's in-process worker), nor in
        # `reaper reap --once` or `celery call`, which run no worker.
        wiring.request_relay_on_events(
            partial(sender.app.send_task, "reaper.relay_outbox", expires=nudge.NUDGE_EXPIRES)
        )
    if not settings.recorder_url:
        logs.log(
            logger,
            "recorder.disabled",
            level=logging.WARNING,
            reason="REAPER_RECORDER_URL is unset: no recording stop signals will be sent",
        )
    if "prefork" in pool:
        # What start-up built (modules, the app, settings) lives as long as the
        # process: out of the garbage collector's sight, so a full collection in
        # the middle of a pass does not walk all of it (80 ms in a relay pass of
        # 5,000 events:
        # docs/history/performance-notes.md#the-relays-own-python-per-event-6-december-night).
        # Before the fork: the children's collections skip these pages too. Not
        # for a solo or threads pool (a test's in-process worker: the process
        # and its objects are the test's).
        gc.freeze()


@beat_init.connect
def _on_beat_init(**_: Any) -> None:
    if not _schema_checked:  # `celery beat` on its own; -B was checked with its worker
        logs.configure()
        check_schema(get_settings(), "beat")


@worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    global _server
    settings = get_settings()
    if not settings.metrics_port or multiproc.multiprocess_dir() is None or _server is not None:
        return
    try:
        _server = endpoint.serve(
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
    gc.freeze()  # what the child built so far, as the parent did before the fork


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
    multiproc.child_exited(os.getpid())


@worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    global _server
    kafka.close_producer()
    tracing.shutdown()  # a solo or threads pool traced in this process
    if _server is not None:
        _server.close()
        _server = None
