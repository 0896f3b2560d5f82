"""Facts for tests: a recorder subscribed to a bus, a bus wired like a process's,
a thread-safe stepping clock, and the log events of a captured run."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine

from reaper import events, wiring
from reaper.config import Settings

F = TypeVar("F")

ALL_FACTS = tuple(
    obj
    for obj in vars(events).values()
    if isinstance(obj, type)
    and obj.__module__ == events.__name__
    and obj not in (events.Bus, events.Logged)
)


class FactRecorder:
    """Keeps every fact of the given types that the bus delivers."""

    def __init__(self, bus: events.Bus, *fact_types: type) -> None:
        self.bus = bus
        self.fact_types = fact_types or ALL_FACTS
        self.facts: list[object] = []
        self._lock = threading.Lock()
        for fact_type in self.fact_types:
            bus.subscribe(fact_type, self._keep)

    def _keep(self, fact: object) -> None:
        with self._lock:
            self.facts.append(fact)

    def of(self, fact_type: type[F]) -> list[F]:
        with self._lock:
            return [f for f in self.facts if type(f) is fact_type]

    def clear(self) -> None:
        with self._lock:
            self.facts.clear()

    def close(self) -> None:
        for fact_type in self.fact_types:
            self.bus.unsubscribe(fact_type, self._keep)


def wired_bus(settings: Settings, engine: Engine | None = None) -> events.Bus:
    """A fresh bus with the subscribers a process with ``settings`` would have."""
    return wiring.install(settings, events.Bus(), engine=engine)


class SteppingClock:
    """A monotonic clock that advances ``step`` seconds at every reading; safe to
    read from several lanes at once."""

    def __init__(self, step: float) -> None:
        self.step = step
        self._now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self._now += self.step
            return self._now


def output_events(output: str, name: str | None = None) -> list[dict]:
    """The JSON log lines in a process's output (other lines skipped), parsed;
    only those with this ``event`` name when one is given."""
    found = []
    for line in output.splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and (name is None or entry.get("event") == name):
            found.append(entry)
    return found


def count_events(output: str, name: str) -> int:
    return len(output_events(output, name))


def log_records(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    """Every captured log record with this ``event`` name."""
    return [r for r in caplog.records if getattr(r, "event", None) == name]


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields ``reaper.logs.log`` put on a record (as ``extra``, so LogRecord
    does not declare them)."""
    on_record: dict[str, Any] = vars(record)["fields"]
    return on_record


def log_events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    """The fields of every captured log line with this ``event`` name."""
    return [fields(r) for r in log_records(caplog, name)]
