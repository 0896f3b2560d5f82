"""The Celery app and the worker's process hooks."""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

from celery import Celery
from celery.signals import (
    after_setup_logger,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
    worker_shutting_down,
)

from reaper import logs, observability, wiring
from reaper.config import get_settings
from reaper.db import dispose_engines

observability.prepare()
# The subscribers of the engine's facts, in every process that loads the app.
wiring.install(get_settings())

app = Celery("reaper", include=["reaper.tasks"])
app.config_from_object("celeryconfig")

logger = logs.get_logger("worker")

# Set by the worker's main process when a warm shutdown begins; the pool
# children (forked after worker_init, so they share it) end their phase after
# the batch in flight, and a relay pass after its batches in flight.
_stopping: Any = None


def stopping() -> Any:
    """An event (``is_set()``) that is set when this worker is shutting down."""
    global _stopping
    if _stopping is None:
        _stopping = multiprocessing.Event()
    return _stopping


@after_setup_logger.connect
def _configure_logging(**_: Any) -> None:
    logs.configure(logging.getLevelName(logging.getLogger().level) or "INFO")


@worker_init.connect
def _on_worker_start(**_: Any) -> None:
    logs.configure()
    stopping()  # created before the pool forks
    settings = get_settings()
    if not settings.recorder_url:
        logs.log(
            logger,
            "recorder.disabled",
            level=logging.WARNING,
            reason="REAPER_RECORDER_URL is unset: no recording stop signals will be sent",
        )


@worker_shutting_down.connect
def _on_shutting_down(sig: str = "", how: str = "", **_: Any) -> None:
    stopping().set()
    logs.log(logger, "worker.stopping", signal=sig, how=how)


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    # Connections inherited from the parent must not be used by the child.
    dispose_engines(close=False)


@worker_process_shutdown.connect
@worker_shutdown.connect
def _close_kafka_producer(**_: Any) -> None:
    # Created lazily per process by the relay; flush what is in flight.
    from reaper.kafka import close_producer

    close_producer()
