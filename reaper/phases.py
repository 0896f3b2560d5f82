"""The phases (docs/design.md#the-three-phases), as data: what each selects, what it becomes.

A phase is a :class:`Phase`: its predicate (the fragment ``<name>_selects`` in
sql/queries.sql), the column its lateness counts from, its status and end
reason, its default window and whether the mass-closure guard applies. Every
statement about phases (the claims, the census, reaper plan, the recorder's
claim) is composed from these (reaper/queries.py Source), and precedence
between phases follows ``ORDER``.

One call to :func:`reap_batch` is one set-based statement inside the caller's
transaction; it returns what happened to each row it looked at, as the facts
the engine will emit once the transaction has committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from reaper.config import Settings
from reaper.events import (
    ConferenceAnomaly,
    ConferenceReaped,
    ItemFailed,
    PhaseCountKey,
    StopRequest,
)
from reaper.queries import PhaseSql, Queries, ResultRow

# Per phase, the shortest window any tenant policy sets (None: none does).
Shortest = dict[str, timedelta | None]


@dataclass(frozen=True, kw_only=True)
class Phase(PhaseSql):
    """One phase. Of :class:`PhaseSql`: ``name``, ``since`` (the column of
    conference_sessions its lateness and its window count from), ``status`` and
    ``end_reason`` (what its rooms become); its predicate is the fragment
    ``<name>_selects`` of sql/queries.sql."""

    label: str  # its value of the outcome label of items_total (docs/design.md#metrics)
    count_key: PhaseCountKey  # its count in the cycle's result (events.Counts)
    # the mass-closure guard applies (cycle.Reaper): a presence outage looks like this
    guarded: bool = False
    # the field of Settings that holds its default window; a tenant's own window
    # for it is a row of messenger.reaper_tenant_windows (docs/design.md#windows-per-tenant)
    setting: str = ""
    # why reaper plan lists a room: {age} since ``since``, {window}, {participants}
    reason: str = ""

    @property
    def ends_active(self) -> bool:
        """It ends Active rooms (the live ones the mass-closure guard counts), each
        with a conference-ended event in the outbox; provision_timeout fails
        Provisioning rooms, with a realtime signal only."""
        return self.status == "Ended"

    def window(self, settings: Settings) -> timedelta:
        """The default window; a tenant's policy replaces it for its conferences."""
        window: timedelta = getattr(settings, self.setting)
        return window

    def cutoff(self, settings: Settings, as_of: datetime) -> datetime:
        """The default cutoff: a conference of a tenant without a window of its own
        is eligible at or before it."""
        return as_of - self.window(settings)

    def range_cutoff(self, settings: Settings, as_of: datetime, shortest: Shortest) -> datetime:
        """The widest cutoff: the end of the range of the phase's partial index that
        holds every conference eligible under the default or any tenant's window
        (``shortest``: tenant_windows). Each row is then held to its own cutoff."""
        window = self.window(settings)
        tenant = shortest.get(self.name)
        return as_of - (min(window, tenant) if tenant is not None else window)


EMPTY_ROOM = Phase(
    name="empty_room",
    since="last_activity_at",
    status="Ended",
    end_reason="EmptyTimeout",
    label="empty_timeout",
    count_key="empty_timeout_count",
    setting="empty_room_grace",
    reason="empty, no activity for {age} (grace {window})",
)
PROVISION_TIMEOUT = Phase(
    name="provision_timeout",
    since="created_at",
    status="Failed",
    end_reason="Error",
    label="provision_failed",
    count_key="provision_failed_count",
    setting="provision_timeout",
    reason="Provisioning for {age} (timeout {window})",
)
STALE_LIVE = Phase(
    name="stale_live",
    since="last_activity_at",
    status="Ended",
    end_reason="Timeout",
    label="stale_timeout",
    count_key="stale_timeout_count",
    guarded=True,
    setting="stale_live_timeout",
    reason="no presence activity for {age} with {participants} participant(s) (timeout {window})",
)

# A transition is terminal, so a room closed by an earlier phase is invisible to
# the later ones; this order is the design's (docs/design.md#order-and-batches),
# and the census and reaper plan count a room in the first phase that selects it.
IN_ORDER: tuple[Phase, ...] = (EMPTY_ROOM, PROVISION_TIMEOUT, STALE_LIVE)
PHASES: dict[str, Phase] = {p.name: p for p in IN_ORDER}
ORDER: tuple[str, ...] = tuple(PHASES)


def mass_closure(eligible: int, active: int, settings: Settings) -> bool:
    """Ending ``eligible`` of ``active`` live rooms at once is a mass closure (the
    guard of a guarded phase, docs/reliability.md#the-mass-closure-guard): more
    than REAPER_MASS_CLOSURE_FLOOR rooms, and more than REAPER_MASS_CLOSURE_SHARE
    of the live ones."""
    return (
        eligible > settings.mass_closure_floor and eligible > settings.mass_closure_share * active
    )


def tenant_windows(queries: Queries) -> Shortest:
    """Per phase, the shortest window any tenant sets (None: none does): with
    the default, it bounds the phase's index range (Phase.range_cutoff)."""
    shortest = queries.tenant_window_bounds()
    return {name: shortest.get(name) for name in ORDER}


def cutoffs(settings: Settings, as_of: datetime) -> dict[str, datetime]:
    """Every phase's default cutoff, as the statements name it (:empty_room_cutoff, ...)."""
    return {f"{p.name}_cutoff": p.cutoff(settings, as_of) for p in IN_ORDER}


def bounds(settings: Settings, as_of: datetime, shortest: Shortest) -> dict[str, datetime]:
    """Every phase's default cutoff and the end of its index range (its widest
    cutoff), as the statements name them (:empty_room_cutoff, :empty_room_range,
    ...): a statement selects any phase's rooms by these (the fragment phase_rooms)."""
    return cutoffs(settings, as_of) | {
        f"{p.name}_range": p.range_cutoff(settings, as_of, shortest) for p in IN_ORDER
    }


@dataclass
class BatchEffect:
    reaped: list[ConferenceReaped] = field(default_factory=list)
    # rows the database refuses (docs/design.md#names): left out for the cycle
    poison: list[ItemFailed] = field(default_factory=list)
    locked: list[str] = field(default_factory=list)
    # claimed, but a command holds one of their open roster rows: left alone
    held: list[str] = field(default_factory=list)
    stops: list[StopRequest] = field(default_factory=list)
    # reaped rooms whose duration could not be given (docs/design.md#anomalies)
    anomalies: list[ConferenceAnomaly] = field(default_factory=list)
    # a batch retried in parts (cycle.PhaseBatches._isolate): the rows it was made of;
    # a sibling lane may have claimed some of them meanwhile
    candidates: int = 0
    # the run was no longer the batch's to change (its fence): nothing changed
    fenced: bool = False

    @property
    def claimed(self) -> int:
        return len(self.reaped) + len(self.poison) + len(self.held)

    def full(self, batch_size: int) -> bool:
        """A whole batch: there may be more to do."""
        return max(self.claimed, self.candidates) >= batch_size

    def merge(self, other: BatchEffect) -> BatchEffect:
        return BatchEffect(
            reaped=self.reaped + other.reaped,
            poison=self.poison + other.poison,
            locked=self.locked + other.locked,
            held=self.held + other.held,
            stops=self.stops + other.stops,
            anomalies=self.anomalies + other.anomalies,
            candidates=max(self.candidates, other.candidates),
            fenced=self.fenced or other.fenced,
        )


def candidates(
    queries: Queries,
    phase: Phase,
    settings: Settings,
    *,
    as_of: datetime,
    excluded: list[str],
    shortest: Shortest | None = None,
) -> list[str]:
    """The ids the next batch of ``phase`` would claim (to isolate a refused row)."""
    shortest = tenant_windows(queries) if shortest is None else shortest
    return queries.batch_candidates(
        phase=phase,
        as_of=as_of,
        bounds=bounds(settings, as_of, shortest),
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
    holder_pid: int,
    excluded: list[str],
    only: list[str] | None = None,
    shortest: Shortest | None = None,
) -> BatchEffect:
    """One batch of ``phase`` (``only``: of these rows alone), fenced by the run:
    it changes nothing unless ``run_id`` is open and the backend ``holder_pid``
    holds the run lock (``effect.fenced`` then). ``shortest``: the shortest
    tenant windows (tenant_windows), read by the caller once per phase; read
    here, in the batch's transaction, when not given."""
    shortest = tenant_windows(queries) if shortest is None else shortest
    cutoffs = bounds(settings, as_of, shortest)
    if not phase.ends_active:
        rows = queries.fail_provisioning_batch(
            phase=phase,
            as_of=as_of,
            bounds=cutoffs,
            batch_size=settings.batch_size,
            excluded=excluded,
            only=only,
            run_id=run_id,
            holder_pid=holder_pid,
        )
    else:
        rows = queries.end_active_batch(
            phase=phase,
            as_of=as_of,
            bounds=cutoffs,
            batch_size=settings.batch_size,
            excluded=excluded,
            only=only,
            run_id=run_id,
            holder_pid=holder_pid,
            topic=settings.conference_ended_topic,
        )
    return effect_of(rows, phase, run_id)


def effect_of(rows: list[ResultRow], phase: Phase, run_id: str) -> BatchEffect:
    """What a phase statement's result rows say became of its batch."""
    effect = BatchEffect()
    # Unpacked in the statements' column order ("Result rows of a phase statement"
    # in sql/queries.sql): one step per row instead of a lookup per column.
    for kind, conference_id, chat_id, deal_id, duration, detail, tenant_id, lateness in rows:
        if kind == "reaped":
            effect.reaped.append(
                ConferenceReaped(
                    run_id=run_id,
                    phase=phase.name,
                    conference_id=conference_id,
                    chat_id=chat_id,
                    deal_id=deal_id,
                    tenant_id=tenant_id,
                    status=phase.status,
                    end_reason=phase.end_reason,
                    duration_seconds=duration,
                    lateness_seconds=lateness,
                )
            )
            if detail is not None:
                effect.anomalies.append(
                    ConferenceAnomaly(
                        run_id=run_id, phase=phase.name, conference_id=conference_id, problem=detail
                    )
                )
        elif kind == "poison":
            poison = ItemFailed(
                run_id=run_id, phase=phase.name, conference_id=conference_id, error=detail
            )
            effect.poison.append(poison)
        elif kind == "locked":
            effect.locked.append(conference_id)
        elif kind == "held":
            effect.held.append(conference_id)
        elif kind == "fenced":
            effect.fenced = True
        else:
            effect.stops.append(StopRequest(detail, conference_id, phase.end_reason))
    return effect
