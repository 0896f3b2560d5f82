"""The Celery app: configured from ``celeryconfig``, its tasks in :mod:`reaper.tasks`.

Loading it sets up the process: Flower's checks (:mod:`reaper.flower`), the
subscribers of the engine's facts (:mod:`reaper.wiring`) and the worker's
signal handlers (:mod:`reaper.lifecycle`).
"""

from __future__ import annotations

import sys

from celery import Celery

import reaper.lifecycle  # noqa: F401  (its import connects the worker's signal handlers)
from reaper import broker, flower, wiring
from reaper.config import get_settings

flower.prepare()
# A refused broker certificate ends `celery call` (and the like) with its one
# log line, not a traceback (reaper/broker.py).
sys.excepthook = broker.quiet_tls_refusal
# The subscribers of the engine's facts, in every process that loads the app.
wiring.install(get_settings())

app = Celery("reaper", include=["reaper.tasks"])
app.config_from_object("celeryconfig")
