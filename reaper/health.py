"""``GET /healthz`` on the worker's metrics port: is this worker doing its job,
and are rooms being closed at all?

Healthy (200) when both hold:

- this worker finished a piece of a reap cycle (a phase, a cycle's end, or a
  tick skipped because another runner owned the run) within ``INTERVALS``
  polling intervals (a worker that just started has that long for its
  first). Otherwise the embedded beat died while the worker lives on, the
  database has been failing every cycle, or the worker is wedged. Pieces, not
  whole cycles: replicas share one queue, and a cycle's five tasks land on
  whichever replica takes them, so one replica can go several intervals
  without a cycle's end although its pool does its share.
- a run completed, by any replica, within ``CLOSING_INTERVALS`` polling
  intervals (counted from this worker's start when that is later), read from
  ``messenger.reaper_runs``. Otherwise closings have stopped although ticks
  go on: every tick is skipped because a session that is not a reaper run
  holds the run lock, or a run's owner hung. Skipped ticks of a replica while
  another one completes the runs do not count against it.

Otherwise 503. The answer is JSON either way: ``status``,
``last_cycle_age_seconds``, ``last_relay_age_seconds``, ``database``,
``limit_seconds``, ``last_run_completed_age_seconds``,
``closing_limit_seconds``, ``lock_holder`` (who holds the run lock, read
only once closings have stopped) and ``schema`` (the database's revision, its
state and the release's range, reaper/release.py: shown, never a cause of
503; a worker checks it at start). The cycle and relay ages come from the
gauges every process of the worker writes, so the main process that answers
sees what its pool children did. The database part is read on a thread of its
own and waited for at most ``budgets.HEALTH``: the answer never hangs on the
database.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from reaper import budgets, multiproc, release, schema
from reaper.config import Settings
from reaper.db import engine_of, transaction
from reaper.release import Verdict

# How many polling intervals without a cycle of this worker it is still healthy.
INTERVALS = 3
# How many polling intervals without a completed run (any replica) before the
# closings count as stopped (docs/design.md#operator-controls): a healthy run
# ends within one interval of its tick (REAPER_MAX_RUN_DURATION, 30 s, is one
# interval by default), the tick that falls inside it is skipped, and a dead
# owner is taken over at the next tick after its lease; four intervals leave
# room for all of that. ops/prometheus/alerts.yml (ConferenceReaperNotClosing)
# uses the same number.
CLOSING_INTERVALS = 4


@dataclass(frozen=True)
class Closing:
    """What the database says about closings."""

    last_run_completed_age_seconds: float | None  # None: no completed run kept
    lock_holder: dict[str, Any] | None  # read only once closings have stopped
    schema: Verdict


class Check:
    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        self.settings = settings
        self.engine = engine or engine_of(settings)
        self.started = time.time()
        interval = settings.polling_interval.total_seconds()
        self.limit = INTERVALS * interval
        self.closing_limit = CLOSING_INTERVALS * interval
        self.reads = _OneAtATime(self._read_closing, budgets.HEALTH.total_seconds())

    def answer(self) -> tuple[int, bytes]:
        now = time.time()
        last_cycle = multiproc.read("messenger_conf_reaper_last_cycle_timestamp_seconds") or None
        last_relay = multiproc.read("messenger_outbox_last_relay_timestamp_seconds") or None
        closing = self.reads()  # None: the database did not answer within its budget
        cycling = now - (last_cycle or self.started) <= self.limit
        run_age = closing.last_run_completed_age_seconds if closing is not None else None
        # No completed run (a new database), or one older than this worker: the
        # worker's start is the reference, as for its first cycle.
        closing_age = min(run_age if run_age is not None else float("inf"), now - self.started)
        # Unknown when the database does not answer: then cycles fail too and
        # the cycle age decides.
        closed = closing is None or closing_age <= self.closing_limit
        healthy = cycling and closed
        body = {
            "status": "ok" if healthy else "unhealthy",
            "last_cycle_age_seconds": _age(now, last_cycle),
            "last_relay_age_seconds": _age(now, last_relay),
            "database": "reachable" if closing is not None else "unreachable",
            "limit_seconds": self.limit,
            "last_run_completed_age_seconds": None if run_age is None else round(run_age, 3),
            "closing_limit_seconds": self.closing_limit,
            "lock_holder": closing.lock_holder if closing is not None else None,
            "schema": (
                closing.schema.to_json()
                if closing is not None
                else {  # the database did not answer: the release's range alone
                    "revision": None,
                    "state": None,
                    "release": release.version(),
                    "needs": release.SCHEMA_NEEDED,
                    "knows": release.SCHEMA_KNOWN,
                }
            ),
        }
        return (200 if healthy else 503), json.dumps(body).encode()

    def _read_closing(self) -> Closing | None:
        """The last completed run's age and, once closings have stopped, who holds
        the run lock (whoever it is: a stray session, or a reaper phase that hung)."""
        try:
            with transaction(self.engine, budgets.health(self.settings)) as queries:
                last = queries.last_run_completed()
                age = float(last.age_seconds) if last is not None else None
                stopped = age is None or age > self.closing_limit
                pid = queries.run_lock_holder() if stopped else None
                activity = queries.backend_activity(pid) if pid is not None else None
                verdict = schema.read(queries)
        except SQLAlchemyError:
            return None
        holder: dict[str, Any] | None = None
        if pid is not None:
            holder = {"pid": pid}
            if activity is not None:
                xact_age = activity.xact_age_seconds  # null outside a transaction
                holder |= {
                    "application_name": activity.application_name,
                    "client_addr": activity.client_addr,
                    "state": activity.state,
                    "transaction_age_seconds": _round(xact_age),
                }
        return Closing(age, holder, verdict)


Read = Callable[[], Closing | None]


class _OneAtATime:
    """Runs ``read`` on a daemon thread, one call at a time; a caller waits for it
    at most ``wait`` seconds and gets None when it is not done by then.

    A read that hangs (a database that accepts and never answers) keeps one
    thread, never more: the next callers wait on the same read. A daemon
    thread never holds up the worker's exit.
    """

    def __init__(self, read: Read, wait: float) -> None:
        self.read = read
        self.wait = wait
        self.lock = threading.Lock()
        self.current: _Call | None = None

    def __call__(self) -> Closing | None:
        with self.lock:
            if self.current is None or self.current.done.is_set():
                self.current = _Call(self.read)
            call = self.current
        if not call.done.wait(self.wait):
            return None
        return call.result


class _Call:
    def __init__(self, read: Read) -> None:
        self.read = read
        self.result: Closing | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, name="reaper-healthz-read", daemon=True).start()

    def _run(self) -> None:
        try:
            self.result = self.read()
        finally:
            self.done.set()


def _round(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)


def _age(now: float, moment: float | None) -> float | None:
    return None if moment is None else round(max(0.0, now - moment), 3)
