"""The operator's controls: pause and resume phases, requeue parked events.

Everything lives in PostgreSQL, so every replica sees a change at its next
phase (a phase reads its pause under the run's lock). Each change is told as a
fact (``control.paused``, ``control.resumed``, ``outbox.requeued`` in the log).
See docs/design.md#operator-controls.
"""

from __future__ import annotations

import getpass
from datetime import timedelta

from sqlalchemy import Engine

from reaper import budgets
from reaper.config import Settings
from reaper.db import transaction
from reaper.events import Bus, OutboxRequeued, Paused, Resumed, process_bus
from reaper.phases import ORDER


def operator(settings: Settings) -> str:
    """Who is acting: REAPER_OPERATOR, else the OS user."""
    if settings.operator:
        return settings.operator
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        return "unknown"


class Controls:
    def __init__(self, engine: Engine, settings: Settings, bus: Bus = process_bus) -> None:
        self.engine = engine
        self.settings = settings
        self.bus = bus

    def pause(
        self, phases: list[str] | None, reason: str, for_: timedelta | None = None
    ) -> list[Paused]:
        """Pause these phases (all without a list), until resumed or for ``for_``."""
        if not reason.strip():
            raise ValueError("a pause needs a reason (--reason)")
        by = operator(self.settings)
        with transaction(self.engine, budgets.quick()) as queries:
            rows = [
                queries.pause_phase(
                    phase, reason.strip(), for_.total_seconds() if for_ else None, by
                )
                for phase in _phases(phases)
            ]
        facts = [Paused(r.phase, r.reason, r.paused_at, r.paused_until, r.paused_by) for r in rows]
        for fact in facts:
            self.bus.emit(fact)
        return facts

    def resume(self, phases: list[str] | None) -> list[Resumed]:
        """End the pauses of these phases (all without a list); those in force."""
        by = operator(self.settings)
        with transaction(self.engine, budgets.quick()) as queries:
            rows = queries.resume_phases(_phases(phases))
        facts = [Resumed(r.phase, r.reason, by) for r in rows if r.in_force]
        for fact in facts:
            self.bus.emit(fact)
        return facts

    def requeue(self, event_id: str | None) -> int:
        """Parked outbox rows back to pending (one, or all with None); how many."""
        with transaction(self.engine, budgets.quick()) as queries:
            count = queries.requeue_outbox(event_id)
        self.bus.emit(OutboxRequeued(count, event_id, operator(self.settings)))
        return count


def _phases(phases: list[str] | None) -> list[str]:
    chosen = list(phases or ORDER)
    unknown = [p for p in chosen if p not in ORDER]
    if unknown:
        raise ValueError(f"unknown phase {unknown[0]!r}; one of {', '.join(ORDER)}")
    return chosen
