"""The three phases (docs/design.md#the-three-phases): what each selects, what it becomes.

One call to :func:`reap_batch` is one set-based statement inside the caller's
transaction; it returns what happened to each row it looked at, as the facts
the engine will emit once the transaction has committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from reaper.config import Settings
from reaper.events import ConferenceReaped, ConferenceRejected
from reaper.queries import Queries
from reaper.recorder import StopRequest


@dataclass(frozen=True)
class Phase:
    name: str
    outcome: str  # metrics label of items_total
    count_key: str  # key of the cycle result
    status: str
    end_reason: str
    # the mass-closure guard applies (cycle.Reaper): a presence outage looks like this
    guarded: bool = False

    def window(self, settings: Settings) -> timedelta:
        return {
            "empty_room": settings.empty_room_grace,
            "provision_timeout": settings.provision_timeout,
            "stale_live": settings.stale_live_timeout,
        }[self.name]

    def cutoff(self, settings: Settings, as_of: datetime) -> datetime:
        return as_of - self.window(settings)


EMPTY_ROOM = Phase("empty_room", "empty_timeout", "empty_timeout_count", "Ended", "EmptyTimeout")
PROVISION_TIMEOUT = Phase(
    "provision_timeout", "provision_failed", "provision_failed_count", "Failed", "Error"
)
STALE_LIVE = Phase(
    "stale_live", "stale_timeout", "stale_timeout_count", "Ended", "Timeout", guarded=True
)

# A transition is terminal, so a room closed by an earlier phase is invisible to
# the later ones; this order is the spec's.
PHASES: dict[str, Phase] = {p.name: p for p in (EMPTY_ROOM, PROVISION_TIMEOUT, STALE_LIVE)}
ORDER: tuple[str, ...] = tuple(PHASES)


@dataclass
class BatchOutcome:
    reaped: list[ConferenceReaped] = field(default_factory=list)
    rejected: list[ConferenceRejected] = field(default_factory=list)
    locked: list[str] = field(default_factory=list)
    stops: list[StopRequest] = field(default_factory=list)

    @property
    def claimed(self) -> int:
        return len(self.reaped) + len(self.rejected)


def reap_batch(
    queries: Queries,
    phase: Phase,
    settings: Settings,
    *,
    as_of: datetime,
    run_id: str,
    excluded: list[str],
) -> BatchOutcome:
    common = {
        "as_of": as_of,
        "cutoff": phase.cutoff(settings, as_of),
        "batch_size": settings.batch_size,
        "excluded": excluded,
    }
    if phase is PROVISION_TIMEOUT:
        rows = queries.fail_provisioning_batch(**common)
    else:
        rows = queries.end_active_batch(
            **common,
            require_empty=phase is EMPTY_ROOM,
            end_reason=phase.end_reason,
            run_id=run_id,
            topic=settings.conference_ended_topic,
        )
    outcome = BatchOutcome()
    for row in rows:
        conference_id = row.conference_id
        if row.kind == "reaped":
            outcome.reaped.append(
                ConferenceReaped(
                    run_id,
                    phase.name,
                    conference_id,
                    row.chat_id,
                    row.deal_id,
                    row.tenant_id,
                    phase.status,
                    phase.end_reason,
                    row.duration_seconds,
                    row.lateness_seconds,
                )
            )
        elif row.kind == "poison":
            outcome.rejected.append(
                ConferenceRejected(run_id, phase.name, conference_id, row.detail)
            )
        elif row.kind == "locked":
            outcome.locked.append(conference_id)
        else:
            outcome.stops.append(StopRequest(row.detail, conference_id, phase.end_reason))
    return outcome
