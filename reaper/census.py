"""The census: how many rooms each phase would close now, and the database gauges.

Read-only. It counts with the phases' own predicates and phase order
(``eligible_census`` in ``sql/queries.sql``). ``measure`` is what the gauges
show (active_backlog, activity_ahead, the outbox, the last completed run):
wiring measures after every cycle and on a scrape; ``reaper status`` and
``reaper plan`` count with the same functions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from reaper import budgets
from reaper.config import Settings
from reaper.db import transaction
from reaper.errors import describe
from reaper.events import GaugesMeasured
from reaper.logs import get_logger, log
from reaper.phases import IN_ORDER, ORDER, PHASES, cutoffs
from reaper.queries import Queries

logger = get_logger("census")


@dataclass(frozen=True)
class PhaseCensus:
    phase: str
    eligible: int
    oldest_eligible_since: datetime | None
    window: timedelta

    def overdue(self, as_of: datetime) -> float | None:
        if self.oldest_eligible_since is None:
            return None
        return max(0.0, (as_of - self.oldest_eligible_since).total_seconds())


@dataclass(frozen=True)
class Census:
    as_of: datetime
    phases: dict[str, PhaseCensus]

    @property
    def backlog(self) -> int:
        return sum(p.eligible for p in self.phases.values())


def census(queries: Queries, settings: Settings, as_of: datetime) -> Census:
    queries.census_planner()  # for the rest of the caller's (read-only) transaction
    rows = queries.eligible_census(phases=IN_ORDER, as_of=as_of, bounds=cutoffs(settings, as_of))
    phases = {
        row.phase: PhaseCensus(
            phase=row.phase,
            eligible=int(row.n),
            oldest_eligible_since=row.since,
            window=PHASES[row.phase].window(settings),
        )
        for row in rows
    }
    return Census(as_of, phases)


# A room whose last_activity_at is later than the database's clock by more than
# this is an anomaly (docs/design.md#anomalies): held, reported and alerted. A
# writer whose clock is a little ahead stamps busy rooms just ahead all the
# time, which only delays their closing by as much; the tolerance is the one a
# hand-given as_of has (runs.AS_OF_TOLERANCE), so such jitter is not reported.
ACTIVITY_AHEAD_TOLERANCE = timedelta(seconds=5)


def activity_ahead_count(queries: Queries, now: datetime) -> int:
    """Active rooms whose last_activity_at is ahead of the database's clock ``now``
    (+infinity included): no phase ever selects them."""
    return queries.activity_ahead_count(now + ACTIVITY_AHEAD_TOLERANCE)


def measure(engine: Engine, settings: Settings) -> GaugesMeasured | None:
    """active_backlog, activity_ahead, the outbox gauges and the last completed run,
    as the database says now; None if it failed."""
    try:
        with transaction(engine, budgets.read(settings)) as queries:
            now = queries.database_clock()
            result = census(queries, settings, now)
            ahead = activity_ahead_count(queries, now)
            pending, oldest, parked = queries.outbox_pending_stats()
            discarded = queries.outbox_discarded_count()
            paused = tuple(row.phase for row in queries.active_pauses(ORDER))
            last_run = queries.last_run_completed()
    except SQLAlchemyError as exc:
        log(logger, "metrics.refresh_failed", level=logging.WARNING, error=describe(exc))
        return None
    completed_at = last_run.finished_at if last_run is not None else None
    return GaugesMeasured(
        active_backlog=result.backlog,
        outbox_pending=pending,
        outbox_oldest_pending_age_seconds=oldest,
        outbox_parked=parked,
        outbox_discarded=discarded,
        paused=paused,
        last_run_completed_at=completed_at,
        activity_ahead=ahead,
    )
