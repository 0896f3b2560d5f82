"""The operator's controls: pause and resume phases, windows per tenant, requeue
parked events.

Everything lives in PostgreSQL, so every replica sees a change at once: a
phase reads its pause under the run's lock at its start, and every phase
statement reads the tenant policies itself. Each change is told as a fact
(``control.paused``, ``control.resumed``, ``control.policy_set``,
``control.policy_unset``, ``outbox.requeued``, ``outbox.discarded`` in the log).
See docs/design.md#operator-controls and docs/design.md#windows-per-tenant.
"""

from __future__ import annotations

import getpass
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from reaper import budgets
from reaper.clock import human
from reaper.config import Settings
from reaper.db import transaction
from reaper.errors import sqlstate
from reaper.events import (
    Bus,
    ControlPaused,
    ControlPolicySet,
    ControlPolicyUnset,
    ControlResumed,
    OutboxDiscarded,
    OutboxRequeued,
    process_bus,
)
from reaper.phases import EMPTY_ROOM, ORDER, PHASES, STALE_LIVE


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
    ) -> list[ControlPaused]:
        """Pause these phases (all without a list), until resumed or for ``for_``."""
        if not reason.strip():
            raise ValueError("a pause needs a reason (--reason)")
        by = operator(self.settings)
        with transaction(self.engine, budgets.quick(self.settings)) as queries:
            rows = [
                queries.pause_phase(
                    phase, reason.strip(), for_.total_seconds() if for_ else None, by
                )
                for phase in _phases(phases)
            ]
        facts = [
            ControlPaused(
                phase=r.phase,
                reason=r.reason,
                paused_at=r.paused_at,
                paused_until=r.paused_until,
                paused_by=r.paused_by,
            )
            for r in rows
        ]
        for fact in facts:
            self.bus.emit(fact)
        return facts

    def resume(self, phases: list[str] | None) -> list[ControlResumed]:
        """End the pauses of these phases (all without a list); those in force."""
        by = operator(self.settings)
        with transaction(self.engine, budgets.quick(self.settings)) as queries:
            rows = queries.resume_phases(_phases(phases))
        facts = [
            ControlResumed(phase=r.phase, reason=r.reason, resumed_by=by)
            for r in rows
            if r.in_force
        ]
        for fact in facts:
            self.bus.emit(fact)
        return facts

    # -- windows per tenant (docs/design.md#windows-per-tenant) ----------------

    def set_policy(self, tenant_id: str, **given: timedelta | None) -> ControlPolicySet:
        """Set the given windows (by Settings field: ``empty_room_grace=...``, one
        per phase, OPTIONS) of the tenant, each one row of
        messenger.reaper_tenant_windows; a window not given keeps its value.
        Refused (:class:`PolicyRefused`, nothing changed) unless each is positive
        and at most 7 days, and the tenant's effective empty-room grace stays
        below its effective stale-live timeout, as the environment's must."""
        tenant = tenant_uuid(tenant_id)
        unknown = sorted(set(given) - set(OPTIONS))
        if unknown:
            raise PolicyRefused("policy set", f"no window {unknown[0]!r}; one of {list(OPTIONS)}")
        windows = {name: value for name, value in given.items() if value is not None}
        if not windows:
            raise PolicyRefused("policy set", f"give at least one of {', '.join(OPTIONS.values())}")
        for name, value in windows.items():
            check_window(OPTIONS[name], value, floors(self.settings)[name])
        by = operator(self.settings)
        with transaction(self.engine, budgets.quick(self.settings)) as queries:
            for name, value in windows.items():
                queries.set_tenant_window(
                    tenant, phase=SETTING_PHASES[name], window_s=value.total_seconds(), by=by
                )
            # Checked on the tenant's windows as stored, locked until the commit:
            # two operators setting the two windows at once cannot make them
            # cross. Raising rolls the change back.
            policy = TenantPolicy.of(queries.tenant_windows(tenant))[0]
            self._coherent(policy, windows)
        # the fact is the policy as stored
        fact = ControlPolicySet(
            tenant_id=policy.tenant_id,
            windows=policy.all_windows(),
            updated_at=policy.updated_at,
            updated_by=policy.updated_by,
        )
        self.bus.emit(fact)
        return fact

    def _coherent(self, policy: TenantPolicy, given: Mapping[str, timedelta]) -> None:
        settings = self.settings
        own_grace = policy.window(EMPTY_ROOM.setting)
        own_stale = policy.window(STALE_LIVE.setting)
        grace = own_grace or EMPTY_ROOM.window(settings)
        stale = own_stale or STALE_LIVE.window(settings)
        if grace < stale:
            return
        # name what this command changed: the grace, else the stale-live timeout
        option = OPTIONS[EMPTY_ROOM.setting]
        if EMPTY_ROOM.setting not in given and STALE_LIVE.setting in given:
            option = OPTIONS[STALE_LIVE.setting]

        def which(own: timedelta | None, value: timedelta) -> str:
            return human(value.total_seconds()) + ("" if own else ", the default")

        raise PolicyRefused(
            option,
            f"the tenant's empty-room grace ({which(own_grace, grace)}) must be "
            f"below its stale-live timeout ({which(own_stale, stale)})",
        )

    def unset_policy(self, tenant_id: str) -> ControlPolicyUnset | None:
        """Remove the tenant's windows; None when it had none."""
        tenant = tenant_uuid(tenant_id)
        with transaction(self.engine, budgets.quick(self.settings)) as queries:
            rows = queries.unset_tenant_windows(tenant)
        if not rows:
            return None
        policy = TenantPolicy.of(rows)[0]
        fact = ControlPolicyUnset(
            tenant_id=policy.tenant_id,
            windows=policy.all_windows(),
            unset_by=operator(self.settings),
        )
        self.bus.emit(fact)
        return fact

    def policies(self) -> list[TenantPolicy]:
        with transaction(self.engine, budgets.read(self.settings)) as queries:
            return TenantPolicy.of(queries.tenant_windows())

    def requeue(self, event_id: str | None) -> int:
        """Parked outbox rows back to pending (one, or all with None); how many."""
        with transaction(self.engine, budgets.quick(self.settings)) as queries:
            count = queries.requeue_outbox(event_id)
        self.bus.emit(
            OutboxRequeued(count=count, event_id=event_id, requeued_by=operator(self.settings))
        )
        return count

    def discard(self, event_id: str, reason: str) -> OutboxDiscarded:
        """A parked outbox row out of delivery for good, kept in
        messenger.outbox_discards (docs/design.md#parked-events). Refused
        (:class:`DiscardRefused`, nothing changed) unless the row is parked."""
        event = str(uuid.UUID(event_id))
        if not reason.strip():
            raise DiscardRefused("a discard needs a reason (--reason)")
        try:
            with transaction(self.engine, budgets.quick(self.settings)) as queries:
                row = queries.discard_outbox(event, reason.strip(), operator(self.settings))
        except DBAPIError as exc:
            # the function's own refusals: a pending, published or unknown row
            if sqlstate(exc) in REFUSALS:
                raise DiscardRefused(str(exc.orig).strip().splitlines()[0]) from None
            raise
        fact = OutboxDiscarded(
            event_id=row.event_id,
            message_key=row.message_key,
            topic=row.topic,
            reason=row.reason,
            discarded_by=row.discarded_by,
            discarded_login=row.discarded_login,
        )
        self.bus.emit(fact)
        return fact


class DiscardRefused(ValueError):
    """``reaper outbox discard`` refused: the row is not parked, or not there."""


# messenger.discard_outbox's refusals (migration 0013): a row not parked
# (object_not_in_prerequisite_state), none with that id (no_data_found), no
# reason (invalid_parameter_value).
REFUSALS = frozenset({"55000", "P0002", "22023"})

# The windows a tenant policy may set, by the Settings field of their default,
# and the option that sets each; the phase each is a window of.
OPTIONS = {phase.setting: "--" + phase.setting.replace("_", "-") for phase in PHASES.values()}
SETTING_PHASES = {phase.setting: phase.name for phase in PHASES.values()}
# The table's own check (migration 0015) holds the same bound.
MAX_WINDOW = timedelta(days=7)
# An occupied room is ended this long after its last heartbeat at the earliest:
# a presence hiccup or a redeploy of the presence service must not close rooms
# in use, and a typo (--stale-live-timeout 1) must not either.
STALE_LIVE_FLOOR = timedelta(minutes=15)


def floors(settings: Settings) -> dict[str, timedelta]:
    """The shortest window a tenant may have, by Settings field
    (docs/design.md#windows-per-tenant).

    One polling interval, since a cycle only comes that often, so a shorter
    window closes nothing sooner and is a typo. A guarded phase's (the
    stale-live timeout, which ends occupied rooms): STALE_LIVE_FLOOR."""
    return {
        phase.setting: STALE_LIVE_FLOOR if phase.guarded else settings.polling_interval
        for phase in PHASES.values()
    }


class PolicyRefused(ValueError):
    """A tenant policy that cannot be stored; one line naming the option."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


def check_window(option: str, value: timedelta, floor: timedelta) -> None:
    if value <= timedelta(0):
        raise PolicyRefused(
            option, f"must be a positive duration (got {value.total_seconds():g} s)"
        )
    if value < floor:
        raise PolicyRefused(
            option,
            f"must be at least {human(floor.total_seconds())} (got {value.total_seconds():g} s)",
        )
    if value > MAX_WINDOW:
        raise PolicyRefused(option, f"must be at most 7 days (got {human(value.total_seconds())})")


def tenant_uuid(value: str) -> str:
    """The tenant id in canonical form; refused unless a UUID."""
    try:
        return str(uuid.UUID(value))
    except (ValueError, AttributeError, TypeError):
        raise PolicyRefused("--tenant", f"{value!r} is not a UUID") from None


@dataclass(frozen=True)
class TenantPolicy:
    """A tenant's windows (rows of messenger.reaper_tenant_windows), by the
    Settings field of their phase's default; a phase without one gets the default.
    ``updated_at``, ``updated_by``: of its latest change."""

    tenant_id: str
    updated_at: datetime
    updated_by: str
    windows: Mapping[str, timedelta] = field(default_factory=dict)

    @classmethod
    def of(cls, rows: list[Any]) -> list[TenantPolicy]:
        """The policies of rows (tenant_id, phase, window_length, updated_at,
        updated_by), one per tenant, in the rows' order. A phase this release
        does not know (a newer release's) is left out."""
        grouped: dict[str, list[Any]] = {}
        for row in rows:
            grouped.setdefault(str(row.tenant_id), []).append(row)
        policies = []
        for tenant, own in grouped.items():
            latest = max(own, key=lambda row: row.updated_at)
            windows = {
                PHASES[row.phase].setting: row.window_length for row in own if row.phase in PHASES
            }
            policies.append(cls(tenant, latest.updated_at, latest.updated_by, windows))
        return policies

    def window(self, name: str) -> timedelta | None:
        return self.windows.get(name)

    def seconds(self, name: str) -> float | None:
        window = self.window(name)
        return None if window is None else window.total_seconds()

    def all_windows(self) -> dict[str, timedelta | None]:
        """Every phase's window by Settings field, None where it gets the default."""
        return {name: self.window(name) for name in OPTIONS}


def _phases(phases: list[str] | None) -> list[str]:
    chosen = list(phases or ORDER)
    unknown = [p for p in chosen if p not in ORDER]
    if unknown:
        raise ValueError(f"unknown phase {unknown[0]!r}; one of {', '.join(ORDER)}")
    return chosen
