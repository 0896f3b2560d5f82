"""The Celery app and its process hooks."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.signals import (
    after_setup_logger,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
)

from reaper import logs
from reaper.config import get_settings
from reaper.db import dispose_engines
from reaper.observability import prepare

# Before the tasks (and so any metric) are imported: metrics mode, Flower auth.
prepare()

app = Celery("reaper", include=["reaper.tasks"])
app.config_from_object("celeryconfig")

logger = logs.get_logger("worker")


@after_setup_logger.connect
def _configure_logging(**_: Any) -> None:
    logs.configure(logging.getLevelName(logging.getLogger().level) or "INFO")


@worker_init.connect
def _on_worker_start(**_: Any) -> None:
    logs.configure()
    settings = get_settings()
    if not settings.recorder_url:
        logs.log(
            logger,
            "recorder.disabled",
            level=logging.WARNING,
            reason="REAPER_RECORDER_URL is unset: no recording stop signals will be sent",
        )


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
