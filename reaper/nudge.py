"""Asking for a relay pass as soon as a batch wrote conference-ended events.

Without it the relay starts at its beat tick (``REAPER_RELAY_INTERVAL``) or at
the end of the cycle that wrote the events; a drain of an incident is one long
cycle, so its first events waited up to a whole relay interval behind its
first closings. Each pool child of a worker subscribes :class:`RelayOnEvents`
at its start (reaper/wiring.py, set up in reaper/lifecycle.py): a batch of a
phase that ends Active rooms, with rooms reaped, pokes a :class:`Nudge`,
which sends one ``reaper.relay_outbox`` message from a thread of its own, at
most once every ``NUDGE_EVERY``. A pass that is already running holds the
relay lock: the requested one is then skipped at once, and the running pass
follows the drain a batch behind.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from reaper import logs
from reaper.errors import describe
from reaper.events import BatchSelected
from reaper.phases import PHASES

logger = logs.get_logger("relay")

# A relay request nobody picked up within this is dropped: the beat tick and
# the next request follow anyway (reaper.tasks asks with it after a cycle).
RELAY_EXPIRES = 30.0
# At most one request a second while a drain writes events: the drain's
# events reach Kafka about a second behind its closings, and a skipped pass
# (another holds the relay lock) costs the worker a second's worth of nothing.
NUDGE_EVERY = 1.0
# A request made while a drain runs is only worth its next second or two:
# after that the next one is on its way, so they never pile up in the queue.
NUDGE_EXPIRES = 2 * NUDGE_EVERY


class Nudge:
    """``send()`` on a daemon thread of its own, at most once every ``every``
    seconds, when :meth:`poke` was called since the last one.

    ``poke`` never blocks and does no I/O: the caller is a drain's thread just
    after its commit, which must not wait on the broker. The thread is the
    calling process's own: a process forked after a poke (the prefork pool's
    children) starts one of its own at its first poke.
    """

    def __init__(self, send: Callable[[], object], every: float = NUDGE_EVERY) -> None:
        self.send = send
        self.every = every
        self._guard = threading.Lock()
        self._pid: int | None = None
        self._wanted = threading.Event()

    def poke(self) -> None:
        if self._pid != os.getpid():
            self._start()
        self._wanted.set()

    def _start(self) -> None:
        with self._guard:
            if self._pid == os.getpid():
                return
            # Fresh ones: what a fork copied may be in any state.
            self._wanted = threading.Event()
            threading.Thread(
                target=self._run, args=(self._wanted,), name="reaper-nudge", daemon=True
            ).start()
            self._pid = os.getpid()

    def _run(self, wanted: threading.Event) -> None:
        while True:
            wanted.wait()
            wanted.clear()
            try:
                self.send()
            except Exception as exc:  # the beat tick asks again: say it and go on
                logs.log(logger, "relay.request_failed", level=logging.WARNING, error=describe(exc))
            # Pokes meanwhile set the event again: one request for all of them.
            time.sleep(self.every)


class RelayOnEvents:
    """The subscriber: a batch that reaped rooms of a phase writing
    conference-ended events asks for a relay pass."""

    def __init__(self, nudge: Nudge) -> None:
        self.nudge = nudge

    def __call__(self, fact: BatchSelected) -> None:
        phase = PHASES.get(fact.phase)
        if fact.reaped and phase is not None and phase.ends_active:
            self.nudge.poke()
