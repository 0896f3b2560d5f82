"""The one place where a process connects what happens after a commit.

The engine emits facts (:mod:`reaper.events`); here, once per process (the
worker's processes, ``reaper`` commands), the subscribers are attached: JSON
log lines, Prometheus, OpenTelemetry and the database gauges; in a worker,
also the request for a relay pass after a batch that wrote events
(:func:`request_relay_on_events`). Subscribers do no network I/O of their
own: the recorder stop signals are the ``reaper.stop_recordings`` task's
(reaper/recorder.py), never a subscriber's, so a slow recorder never holds
the thread that emits; the relay request is sent from a thread of its own
(reaper/nudge.py). Adding an effect after
the commit means adding a line here, not touching the engine.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from sqlalchemy import Engine

from reaper import census, eventlog, metrics, tracing
from reaper.config import Settings
from reaper.db import engine_of
from reaper.events import BatchSelected, Bus, CycleCompleted, process_bus
from reaper.nudge import Nudge, RelayOnEvents

_lock = threading.Lock()
# The buses already wired. Weak, not by id(): a collected bus's id can be reused
# by a new one, which would then count as wired and get no subscriber at all.
_installed: weakref.WeakSet[Bus] = weakref.WeakSet()


def install(settings: Settings, bus: Bus = process_bus, *, engine: Engine | None = None) -> Bus:
    """Attach every subscriber to ``bus`` (once: a second call changes nothing)."""
    with _lock:
        if bus in _installed:
            return bus
        _installed.add(bus)
    engine = engine or engine_of(settings)
    eventlog.subscribe(bus)
    metrics.subscribe(bus)
    tracing.subscribe(bus)
    bus.subscribe(CycleCompleted, Gauges(engine, settings, bus))
    return bus


def request_relay_on_events(send: Callable[[], object], bus: Bus = process_bus) -> None:
    """A worker's: after a batch that wrote conference-ended events, ``send`` a
    request for a relay pass (at most one a second, from a thread of its own),
    so an incident's events follow its closings instead of the next relay tick."""
    bus.subscribe(BatchSelected, RelayOnEvents(Nudge(send)))


def gauges(settings: Settings, bus: Bus = process_bus) -> Gauges:
    """The gauges of this process's bus (the worker refreshes them on a scrape too)."""
    return Gauges(engine_of(settings), settings, bus)


class Gauges:
    """After every cycle: the census behind active_backlog and the outbox gauges,
    measured from the database and told as a fact (metrics sets the gauges)."""

    def __init__(self, engine: Engine, settings: Settings, bus: Bus) -> None:
        self.engine = engine
        self.settings = settings
        self.bus = bus

    def __call__(self, _: CycleCompleted) -> None:
        self.refresh()

    def refresh(self) -> None:
        measured = census.measure(self.engine, self.settings)
        if measured is not None:
            self.bus.emit(measured)
