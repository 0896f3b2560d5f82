"""The three phases (docs/design.md#the-three-phases): what each selects, what it becomes.

One call to :func:`reap_batch` is one set-based statement inside the caller's
transaction; it returns what happened to each row it looked at, as the facts
the engine will emit once the transaction has committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from reaper.config import Settings
from reaper.events import ConferenceAnomaly, ConferenceReaped, ConferenceRejected
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
    # reaped rooms whose duration could not be given (docs/design.md#anomalies)
    anomalies: list[ConferenceAnomaly] = field(default_factory=list)
    # a batch retried in parts (cycle.Reaper._isolate): the rows it was made of;
    # a sibling lane may have claimed some of them meanwhile
    candidates: int = 0

    @property
    def claimed(self) -> int:
        return len(self.reaped) + len(self.rejected)

    def full(self, batch_size: int) -> bool:
        """A whole batch: there may be more to do."""
        return max(self.claimed, self.candidates) >= batch_size

    def merge(self, other: BatchOutcome) -> BatchOutcome:
        return BatchOutcome(
            self.reaped + other.reaped,
            self.rejected + other.rejected,
            self.locked + other.locked,
            self.stops + other.stops,
            self.anomalies + other.anomalies,
            max(self.candidates, other.candidates),
        )


def candidates(
    queries: Queries, phase: Phase, settings: Settings, *, as_of: datetime, excluded: list[str]
) -> list[str]:
    """The ids the next batch of ``phase`` would claim (to isolate a refused row)."""
    return queries.batch_candidates(
        phase=phase.name,
        cutoff=phase.cutoff(settings, as_of),
        require_empty=phase is EMPTY_ROOM,
        batch_size=settings.batch_size,
        excluded=excluded,
    )


def reap_batch(
    queries: Queries,
    phase: Phase,
    settings: Settings,
    *,
    as_of: datetime,
    run_id: str,
    excluded: list[str],
    only: list[str] | None = None,
) -> BatchOutcome:
    """One batch of ``phase`` (``only``: of these rows alone)."""
    common = {
        "as_of": as_of,
        "cutoff": phase.cutoff(settings, as_of),
        "batch_size": settings.batch_size,
        "excluded": excluded,
        "only": only,
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
            if row.detail is not None:
                outcome.anomalies.append(
                    ConferenceAnomaly(run_id, phase.name, conference_id, row.detail)
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
