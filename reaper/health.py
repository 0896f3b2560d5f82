"""``GET /healthz`` on the worker's metrics port: is this worker doing its job?

Healthy (200) when a reap cycle of this worker completed, or was skipped
because another runner owned the run, within three polling intervals (a
worker that just started has that long for its first). Otherwise 503: the
embedded beat died while the worker lives on, the database has been failing
every cycle, or the worker is wedged. The answer is JSON either way:
``status``, ``last_cycle_age_seconds``, ``last_relay_age_seconds``,
``database``. The ages come from the gauges every process of the worker writes
(``messenger_conf_reaper_last_cycle_timestamp_seconds``,
``messenger_outbox_last_relay_timestamp_seconds``), so the main process that
answers sees what its pool children did.
"""

from __future__ import annotations

import json
import time

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from reaper import budgets, metrics
from reaper.config import Settings
from reaper.db import engine_of, transaction

# How many polling intervals without a cycle a worker is still healthy.
INTERVALS = 3


class Check:
    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        self.settings = settings
        self.engine = engine or engine_of(settings)
        self.started = time.time()

    def answer(self) -> tuple[int, bytes]:
        now = time.time()
        last_cycle = metrics.read("messenger_conf_reaper_last_cycle_timestamp_seconds") or None
        last_relay = metrics.read("messenger_outbox_last_relay_timestamp_seconds") or None
        limit = INTERVALS * self.settings.polling_interval.total_seconds()
        healthy = now - (last_cycle or self.started) <= limit
        body = {
            "status": "ok" if healthy else "unhealthy",
            "last_cycle_age_seconds": _age(now, last_cycle),
            "last_relay_age_seconds": _age(now, last_relay),
            "database": "reachable" if self._database_reachable() else "unreachable",
            "limit_seconds": limit,
        }
        return (200 if healthy else 503), json.dumps(body).encode()

    def _database_reachable(self) -> bool:
        try:
            with transaction(self.engine, budgets.quick(self.settings)) as queries:
                queries.database_clock()
        except SQLAlchemyError:
            return False
        return True


def _age(now: float, moment: float | None) -> float | None:
    return None if moment is None else round(max(0.0, now - moment), 3)
