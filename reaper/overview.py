"""What the operator sees: ``reaper status``, ``reaper plan``, ``reaper policy list``,
``reaper outbox parked``.

Read-only. The plan uses the phases' own predicates and phase order
(``plan_candidates`` in ``sql/queries.sql``) and the census
(:mod:`reaper.census`), and applies the mass-closure guard's rule, so
``reaper plan`` lists what the next cycle at the same moment would close.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, make_url

from reaper import budgets, schema
from reaper.census import ACTIVITY_AHEAD_TOLERANCE, activity_ahead_count, census
from reaper.clock import human
from reaper.clock import rfc3339_or_none as rfc3339
from reaper.config import Settings
from reaper.control import TenantPolicy
from reaper.db import transaction
from reaper.phases import (
    IN_ORDER,
    ORDER,
    PHASES,
    Phase,
    bounds,
    mass_closure,
    tenant_windows,
)


def safe_url(url: str) -> str:
    """The database URL without its password."""
    return make_url(url).render_as_string(hide_password=True)


# -- reaper status -----------------------------------------------------------


def status(engine: Engine, settings: Settings) -> dict[str, Any]:
    with transaction(engine, budgets.read(settings)) as queries:
        now = queries.database_clock()
        result = census(queries, settings, now)
        ahead = activity_ahead_count(queries, now)
        pending, oldest, parked = queries.outbox_pending_stats()
        discarded = queries.outbox_discarded_count()
        pid = queries.run_lock_holder()
        activity = queries.backend_activity(pid) if pid is not None else None
        runs = queries.last_runs()
        pauses = queries.active_pauses(ORDER)
        tenant_policies = queries.tenant_policy_count()
        verdict = schema.read(queries)
    lock: dict[str, Any] = {"held": pid is not None, "holder_pid": pid}
    if activity is not None:
        lock["holder"] = {
            "application_name": activity.application_name,
            "client_addr": activity.client_addr,
            "state": activity.state,
            "transaction_age_seconds": _round(activity.xact_age_seconds),
        }
    return {
        "as_of": rfc3339(now),
        "database": safe_url(settings.database_url),
        "schema": verdict.to_json(),
        "phases": {
            name: {
                "eligible": p.eligible,
                "window_seconds": p.window.total_seconds(),
                "oldest_eligible_since": rfc3339(p.oldest_eligible_since),
                "oldest_overdue_seconds": _round(p.overdue(now)),
            }
            for name, p in result.phases.items()
        },
        "active_backlog": result.backlog,
        "activity_ahead": ahead,
        "outbox": {
            "pending": pending,
            "oldest_pending_age_seconds": _round(oldest),
            "parked": parked,
            "discarded": discarded,
        },
        "lock": lock,
        "tenant_policies": tenant_policies,
        "run": _runs(runs),
        "paused": [
            {
                "phase": p.phase,
                "reason": p.reason,
                "since": rfc3339(p.paused_at),
                "until": rfc3339(p.paused_until),
                "by": p.paused_by,
            }
            for p in pauses
        ],
    }


def _runs(rows: list[Any]) -> dict[str, Any]:
    """The open run (a cycle in progress) and the last finished one."""
    out: dict[str, Any] = {"current": None, "last": None}
    for row in rows:
        entry = {
            "run_id": row.run_id,
            "as_of": rfc3339(row.as_of),
            "started_at": rfc3339(row.started_at),
            "owner": row.owner,
        }
        if row.finished_at is None:
            entry.update(phase=row.phase, lease_expires_at=rfc3339(row.lease_expires_at))
            out["current"] = entry
        else:
            entry.update(
                finished_at=rfc3339(row.finished_at), outcome=row.outcome, errors=row.errors
            )
            out["last"] = entry
    return out


def _round(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)


def format_status(data: dict[str, Any]) -> str:
    lines = [f"as of {data['as_of']}  database {data['database']}"]
    schema_ = data["schema"]
    lines += [
        f"schema {schema_['revision']} ({schema_['state']}): release {schema_['release']}"
        f" runs on {schema_['needs']} to {schema_['knows']}",
        "",
    ]
    lines.append(f"{'phase':<18} {'eligible':>8}  oldest overdue")
    for name, p in data["phases"].items():
        overdue = p["oldest_overdue_seconds"]
        since = p["oldest_eligible_since"]
        oldest = "-" if overdue is None else f"{human(overdue)} (eligible since {since})"
        lines.append(f"{name:<18} {p['eligible']:>8}  {oldest}")
    lines.append(f"{'active backlog':<18} {data['active_backlog']:>8}")
    if data["activity_ahead"]:
        lines.append(
            f"{'activity ahead':<18} {data['activity_ahead']:>8}  Active with last_activity_at"
            " later than the database's clock: never closed (reaper plan lists them; runbook)"
        )
    lines.append("")
    outbox = data["outbox"]
    age = human(outbox["oldest_pending_age_seconds"] or 0) if outbox["pending"] else "-"
    lines.append(f"{'outbox pending':<18} {outbox['pending']:>8}  oldest {age}")
    if outbox["parked"]:
        lines.append(
            f"{'outbox parked':<18} {outbox['parked']:>8}  (reaper outbox parked; runbook)"
        )
    if outbox["discarded"]:
        lines.append(
            f"{'outbox discarded':<18} {outbox['discarded']:>8}"
            "  (kept in messenger.outbox_discards; runbook)"
        )
    lock = data["lock"]
    if lock["held"]:
        who = lock.get("holder") or {}
        detail = ", ".join(
            f"{k} {v}" for k, v in who.items() if v is not None and k != "transaction_age_seconds"
        )
        held_for = who.get("transaction_age_seconds")
        since = f", for {human(held_for)}" if held_for is not None else ""
        pid = lock["holder_pid"]
        lines.append(f"{'run lock':<18} held by backend pid {pid} ({detail}{since})")
    else:
        lines.append(f"{'run lock':<18} free")
    if data["tenant_policies"]:
        lines.append(
            f"{'tenant policies':<18} {data['tenant_policies']:>8}  own windows replace the"
            " defaults for those tenants (reaper policy list)"
        )
    for pause in data["paused"]:
        until = f"until {pause['until']}" if pause["until"] else "until resumed"
        lines.append(
            f"{'PAUSED':<18} {pause['phase']} since {pause['since']} {until}, by {pause['by']}:"
            f" {pause['reason']}"
        )
    run = data["run"]
    if run["current"]:
        current = run["current"]
        lines.append(
            f"{'cycle running':<18} {current['run_id']} in {current['phase'] or 'its head'}"
            f" since {current['started_at']}, lease until {current['lease_expires_at']}"
        )
    if run["last"]:
        last = run["last"]
        lines.append(
            f"{'last cycle':<18} {last['run_id']} {last['outcome']} at {last['finished_at']}"
        )
    return "\n".join(lines)


# -- reaper plan -------------------------------------------------------------


def _reason(phase: Phase, row: Any, window: timedelta, as_of: datetime) -> str:
    """Why the room is eligible (its phase's ``reason``); its window is its
    tenant's when a policy sets one."""
    window_text = human(window.total_seconds())
    if row.tenant_window is not None:
        window_text += ", tenant policy"
    age = human((as_of - getattr(row, phase.since)).total_seconds())
    return phase.reason.format(
        age=age, window=window_text, participants=row.active_participant_count
    )


def plan(
    engine: Engine, settings: Settings, as_of: datetime | None, per_phase: int
) -> dict[str, Any]:
    """What a cycle at ``as_of`` (default: the database's clock now) would close."""
    with transaction(engine, budgets.read(settings)) as queries:
        now = queries.database_clock()
        as_of = as_of or now
        counted = census(queries, settings, as_of)
        rows = queries.plan_candidates(
            phases=IN_ORDER,
            as_of=as_of,
            bounds=bounds(settings, as_of, tenant_windows(queries)),
            per_phase=per_phase,
        )
        active = queries.active_count()
        paused = {row.phase: row.reason for row in queries.active_pauses(ORDER)}
        ahead_count = activity_ahead_count(queries, now)
        ahead = queries.activity_ahead(now, now + ACTIVITY_AHEAD_TOLERANCE, per_phase)
    phases: dict[str, dict[str, Any]] = {}
    for name in ORDER:
        p = counted.phases[name]
        phases[name] = {
            "becomes": f"{PHASES[name].status}/{PHASES[name].end_reason}",
            "eligible": p.eligible,
            "would_close": 0 if name in paused else p.eligible,
            "paused": paused.get(name),
            "blocked": None,
            "truncated": p.eligible > per_phase,
            "conferences": [],
        }
    # A guarded phase's mass-closure guard runs after the phases before it have
    # committed (cycle.py): it counts the Active rooms they leave.
    share, floor = settings.mass_closure_share, settings.mass_closure_floor
    active_left = active
    for name in ORDER:
        phase, entry = PHASES[name], phases[name]
        if phase.guarded and mass_closure(entry["would_close"], active_left, settings):
            entry["blocked"] = (
                f"mass-closure guard: {entry['would_close']} of {active_left} active "
                f"(share {share}, floor {floor}); `reaper reap --once --allow-mass-closure` "
                "ends them"
            )
            entry["would_close"] = 0
        if phase.ends_active:
            active_left -= entry["would_close"]
    for row in rows:
        phase = PHASES[row.phase]
        window = row.tenant_window or phase.window(settings)
        phases[row.phase]["conferences"].append(
            {
                "conference_id": str(row.conference_id),
                "chat_id": str(row.chat_id),
                "deal_id": str(row.deal_id),
                "tenant_id": str(row.tenant_id),
                "status": row.status,
                "reason": _reason(phase, row, window, as_of),
                "window_seconds": window.total_seconds(),
                "tenant_policy": row.tenant_window is not None,
                "last_activity_at": rfc3339(row.last_activity_at),
                "created_at": rfc3339(row.created_at),
                "active_participant_count": row.active_participant_count,
                # a phase that fails its rooms gives them no duration anyway
                "anomaly": row.anomaly if phase.ends_active else None,
            }
        )
    return {
        "as_of": rfc3339(as_of),
        "phases": phases,
        "would_close": sum(p["would_close"] for p in phases.values()),
        "activity_ahead": {
            "database_clock": rfc3339(now),
            "count": ahead_count,
            "truncated": ahead_count > len(ahead),
            "conferences": [_ahead(row) for row in ahead],
        },
    }


def _ahead(row: Any) -> dict[str, Any]:
    """A room held for its activity ahead of the clock (activity_ahead)."""
    return {
        "conference_id": str(row.conference_id),
        "chat_id": str(row.chat_id),
        "deal_id": str(row.deal_id),
        "tenant_id": str(row.tenant_id),
        "last_activity_at": "infinity" if row.infinite else rfc3339(row.last_activity_at),
        "ahead_seconds": _round(row.ahead_seconds),
        "active_participant_count": row.active_participant_count,
    }


def format_plan(data: dict[str, Any]) -> str:
    lines = [f"plan for a cycle at {data['as_of']} (nothing is changed)"]
    for name, p in data["phases"].items():
        lines.append(f"\n{name} -> {p['becomes']}: {p['would_close']} would close")
        if p["paused"]:
            lines.append(f"  PAUSED (reaper resume): {p['paused']}")
        if p["blocked"]:
            lines.append(f"  BLOCKED by the {p['blocked']}")
        for c in p["conferences"]:
            note = f"  [no duration: {c['anomaly']}]" if c["anomaly"] else ""
            lines.append(f"  {c['conference_id']}  deal {c['deal_id']}  {c['reason']}{note}")
        if p["truncated"]:
            lines.append(f"  ... {p['eligible'] - len(p['conferences'])} more (--limit)")
    lines.append(f"\ntotal: {data['would_close']} would close")
    ahead = data["activity_ahead"]
    if ahead["count"]:
        lines.append(
            f"\nheld, never closed: {ahead['count']} Active with last_activity_at later than"
            f" the database's clock ({ahead['database_clock']}); an operator decides (runbook)"
        )
        for c in ahead["conferences"]:
            when = c["last_activity_at"]
            by = "" if c["ahead_seconds"] is None else f", {human(c['ahead_seconds'])} ahead"
            lines.append(f"  {c['conference_id']}  deal {c['deal_id']}  last activity {when}{by}")
        if ahead["truncated"]:
            lines.append(f"  ... {ahead['count'] - len(ahead['conferences'])} more (--limit)")
    return "\n".join(lines)


# -- reaper policy -----------------------------------------------------------


WINDOWS = tuple(phase.setting for phase in PHASES.values())


def _window_text(policy: Any, name: str, settings: Settings) -> str:
    own = policy.windows.get(name)
    if own is not None:
        return human(own.total_seconds())
    return f"default ({human(getattr(settings, name).total_seconds())})"


def format_policy(policy: Any, settings: Settings) -> str:
    """``TENANT: empty_room_grace 10m, provision_timeout default (2m), ...`` of a
    TenantPolicy, a ControlPolicySet or a ControlPolicyUnset (their ``windows``)."""
    windows = ", ".join(f"{name} {_window_text(policy, name, settings)}" for name in WINDOWS)
    return f"{policy.tenant_id}: {windows}"


def policies_json(policies: list[TenantPolicy]) -> list[dict[str, Any]]:
    """Each window in seconds, null where the tenant gets the default."""
    return [
        {
            "tenant_id": p.tenant_id,
            **{f"{name}_seconds": p.seconds(name) for name in WINDOWS},
            "updated_at": rfc3339(p.updated_at),
            "updated_by": p.updated_by,
        }
        for p in policies
    ]


def format_policies(policies: list[TenantPolicy], settings: Settings) -> str:
    defaults = ", ".join(
        f"{name} {human(getattr(settings, name).total_seconds())}" for name in WINDOWS
    )
    if not policies:
        return f"no tenant policies: every tenant gets the defaults ({defaults})"
    header = ("tenant", *WINDOWS, "updated", "by")
    body = [
        (
            p.tenant_id,
            *(_window_text(p, name, settings) for name in WINDOWS),
            rfc3339(p.updated_at) or "",
            p.updated_by,
        )
        for p in policies
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [
        f"{len(policies)} tenant polic{'y' if len(policies) == 1 else 'ies'} (defaults: {defaults})"
    ]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in [header, *body]
    ]
    return "\n".join(lines)


# -- reaper outbox parked ----------------------------------------------------


def parked(engine: Engine, settings: Settings, limit: int) -> list[dict[str, Any]]:
    with transaction(engine, budgets.read(settings)) as queries:
        rows = queries.parked_outbox(limit)
    return [
        {
            "event_id": r.event_id,
            "message_key": r.message_key,
            "topic": r.topic,
            "attempts": r.attempts,
            "error": r.last_error,
            "parked_at": rfc3339(r.parked_at),
            "created_at": rfc3339(r.created_at),
        }
        for r in rows
    ]


def format_parked(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no parked rows"
    lines = [f"{len(rows)} parked row(s): requeue with `reaper outbox requeue --event-id ID`"]
    for r in rows:
        lines.append(
            f"  {r['event_id']}  key {r['message_key']}  attempts {r['attempts']}"
            f"  parked {r['parked_at']}: {r['error']}"
        )
    return "\n".join(lines)
