"""The reaper's side of the drain and quiet-cycle figures, in this process.

A cycle runs exactly as ``reaper reap --once`` and the worker's phase tasks run
it (:class:`reaper.cycle.Reaper`: the run, the lock, bounded batch transactions,
and every subscriber a process connects: one log line per reaped room through
the JSON formatter, metrics, the gauges after each cycle), so the whole cost of
a cycle is counted; only process start is not.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.seed import one
from reaper import logs, wiring
from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.db import engine_for
from reaper.events import Bus
from reaper.phases import PHASES

PHASE_KEYS = {name: phase.count_key for name, phase in PHASES.items()}

# What both sides must have left behind, whatever the order they did it in.
# Payloads are compared without the fields that are new per event or per run.
OUTCOME = """
SELECT
  (SELECT count(*) FROM messenger.conference_sessions s JOIN bench.sessions b USING (id)
     WHERE s.status IN ('Provisioning', 'Active')),
  (SELECT count(*) FROM messenger.conference_participants p JOIN bench.sessions b
     ON b.id = p.conference_id WHERE p.left_at IS NULL),
  (SELECT count(*) FROM messenger.integration_outbox),
  (SELECT count(*) FROM messenger.realtime_outbox),
  (SELECT md5(string_agg((payload - 'eventId' - 'correlationId')::text, ','
                         ORDER BY payload -> 'payload' ->> 'conferenceId'))
     FROM messenger.integration_outbox),
  (SELECT md5(string_agg(kind || payload::text, ',' ORDER BY conference_id))
     FROM messenger.realtime_outbox),
  (SELECT md5(string_agg(s.status || s.end_reason || s.ended_at || coalesce(s.duration_seconds, -1),
                         ',' ORDER BY s.id))
     FROM messenger.conference_sessions s JOIN bench.sessions b USING (id))
"""


def outcome(url: str) -> tuple[Any, ...]:
    return one(url, OUTCOME)


def log_to(path: Path) -> None:
    """The worker's logging (JSON lines, INFO), into a file instead of stderr."""
    logger = logging.getLogger(logs.LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    handler = logging.FileHandler(path)
    handler.setFormatter(logs.JsonFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def settings_for(url: str, batch_size: int) -> Settings:
    return Settings(database_url=url, batch_size=batch_size)


_buses: dict[str, Bus] = {}


def reaper_for(url: str, batch_size: int) -> Reaper:
    """A Reaper with the subscribers a process on this database would have."""
    settings = settings_for(url, batch_size)
    engine = engine_for(url)
    if url not in _buses:
        _buses[url] = wiring.install(settings, Bus(), engine=engine)
    return Reaper(settings, engine=engine, bus=_buses[url])


def reaper_drain(
    url: str, as_of: datetime, batch_size: int, expected: int
) -> tuple[dict[str, int], float]:
    """Whole cycles back to back until ``expected`` rooms are closed."""
    reaper = reaper_for(url, batch_size)
    counts = dict.fromkeys(PHASE_KEYS, 0)
    started = time.perf_counter()
    for _ in range(1000):
        result = reaper.run_cycle(as_of)
        for phase, key in PHASE_KEYS.items():
            counts[phase] += result[key]
        if sum(counts.values()) >= expected or not any(result[k] for k in PHASE_KEYS.values()):
            break
    return counts, time.perf_counter() - started


def quiet_cycle(url: str, as_of: datetime) -> float:
    """Seconds of one whole cycle with nothing eligible."""
    reaper = reaper_for(url, 100)
    started = time.perf_counter()
    result = reaper.run_cycle(as_of)
    elapsed = time.perf_counter() - started
    if any(result[k] for k in PHASE_KEYS.values()) or result["skipped"]:
        raise RuntimeError(f"the quiet cycle was not quiet: {result}")
    return elapsed
