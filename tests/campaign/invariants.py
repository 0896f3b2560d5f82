"""The campaign's invariants, checked at the end of a run from what the
services wrote (docs/campaign.md#invariants). Each returns a :class:`Check`:
``pass``, ``fail`` (with the first examples) or ``unknown`` (it could not be
decided: then the campaign does not pass either).
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, text

from reaper.config import Settings
from reaper.ledger import Ledger, Verdict
from tests.campaign.bounds import RECOVERY_BOUNDS, RECOVERY_PATHS
from tests.campaign.environment import POLLING_INTERVAL_S, RUN_LEASE_S
from tests.campaign.workload import Rooms

EXAMPLES = 5
# The ledger's categories that fail a campaign (redelivered is only counted).
FAILING = ("lost", "unexpected", "duplicated", "out_of_order", "realtime")


@dataclass
class Check:
    name: str
    verdict: str  # pass | fail | unknown
    detail: str = ""
    examples: list[Any] = field(default_factory=list)
    counts: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "detail": self.detail,
            "examples": self.examples[:EXAMPLES],
            "counts": self.counts,
        }


def _rows(engine: Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text(sql), params).all())


# -- the ledger ------------------------------------------------------------------------


def ledger(
    engine: Engine, settings: Settings, since: datetime, until: datetime
) -> tuple[Check, Verdict]:
    """Delivery, as the one ledger of the suite reads it (reaper/ledger.py): lost
    0, unexpected 0, no closing with two event ids, each deal's events in order;
    events seen twice on Kafka (at-least-once) are counted, not failed."""
    verdict = Ledger(settings, engine).check(since, until)
    counts = verdict.counts()
    # once every fault has healed and the cool-down has passed, no event may
    # still wait in the outbox either: the relay must have caught up
    failed = [k for k in (*FAILING, "pending") if counts.get(k, 0)]
    examples: list[Any] = []
    for category in failed:
        if category != "pending":
            examples += [{category: f.to_json()} for f in verdict.examples(category)]
    summary = verdict.summary()
    return (
        Check(
            "ledger",
            "pass" if verdict.ok and not failed else "fail",
            next((line for line in summary if line.startswith("lost ")), "; ".join(summary)),
            examples,
            dict(counts),
        ),
        verdict,
    )


# -- rooms that must never close as empty ----------------------------------------------


def no_close_after_join(engine: Engine, rooms: Rooms) -> Check:
    """A room a participant joined (the join committed while it was active), or
    a live room kept active, was never closed by the reaper afterwards."""
    kept = sorted(rooms.joined | set(rooms.of("live")))
    closed = _rows(
        engine,
        "SELECT id::text, status, end_reason FROM messenger.conference_sessions"
        " WHERE id = ANY(CAST(:ids AS uuid[])) AND status <> 'Active'",
        ids=kept,
    )
    return Check(
        "no_close_after_join",
        "fail" if closed else "pass",
        f"{len(kept)} rooms joined or kept live ({len(rooms.joined)} joins racing the grace "
        f"committed, {len(rooms.join_refused)} came after the close), {len(closed)} closed",
        [{"room": r.id, "status": r.status, "end_reason": r.end_reason} for r in closed],
        {"kept": len(kept), "joined": len(rooms.joined), "closed": len(closed)},
    )


def command_ended_left_alone(engine: Engine, rooms: Rooms) -> Check:
    """A room the messenger's command ended stays as the command left it."""
    changed = _rows(
        engine,
        "SELECT id::text, status, end_reason FROM messenger.conference_sessions"
        " WHERE id = ANY(CAST(:ids AS uuid[])) AND end_reason IS DISTINCT FROM 'Normal'",
        ids=sorted(rooms.ended_by_command),
    )
    return Check(
        "command_ended_left_alone",
        "fail" if changed else "pass",
        f"{len(rooms.ended_by_command)} rooms ended by a command, "
        f"{len(rooms.command_refused)} commands came after the reaper's close",
        [{"room": r.id, "status": r.status, "end_reason": r.end_reason} for r in changed],
    )


# -- nothing left behind ---------------------------------------------------------------


ELIGIBLE = """
SELECT id::text, status, extract(epoch FROM clock_timestamp() - last_activity_at) AS idle_s
FROM messenger.conference_sessions
WHERE (status = 'Active' AND active_participant_count = 0
       AND last_activity_at <= clock_timestamp() - make_interval(secs => :grace_s + :late_s))
   OR (status = 'Provisioning'
       AND created_at <= clock_timestamp() - make_interval(secs => :provision_s + :late_s))
   OR (status = 'Active'
       AND last_activity_at <= clock_timestamp() - make_interval(secs => :stale_s + :late_s))
"""


def nothing_eligible_left(
    engine: Engine, grace_s: float, provision_s: float, stale_s: float
) -> Check:
    """Once every fault has healed and one interval plus the lease has passed,
    no room is still open that was eligible before that."""
    late = POLLING_INTERVAL_S + RUN_LEASE_S
    left = _rows(
        engine, ELIGIBLE, grace_s=grace_s, provision_s=provision_s, stale_s=stale_s, late_s=late
    )
    return Check(
        "nothing_eligible_left",
        "fail" if left else "pass",
        f"{len(left)} rooms eligible for longer than one interval plus the lease ({late:g}s)",
        [{"room": r.id, "status": r.status, "idle_s": round(float(r.idle_s), 1)} for r in left],
    )


def stops_sent(engine: Engine) -> Check:
    """Every recording running on a room the reaper closed got its stop signal."""
    left = _rows(
        engine,
        """
        SELECT r.id::text, s.id::text AS room FROM messenger.call_recordings r
        JOIN messenger.conference_sessions s ON s.id = r.conference_id
        WHERE s.end_reason IN ('EmptyTimeout', 'Timeout', 'Error')
          AND r.status IN ('Pending', 'Recording', 'Uploading') AND r.stop_requested_at IS NULL
        """,
    )
    return Check(
        "stops_sent",
        "fail" if left else "pass",
        f"{len(left)} recordings of closed rooms without a stop signal taken",
        [{"recording": r.id, "room": r.room} for r in left],
    )


# -- one runner at a time --------------------------------------------------------------


RUN_TRANSITIONS = """
SELECT r.run_id::text AS run_id, r.started_at, r.finished_at, r.outcome,
       min(pg_xact_commit_timestamp(o.xmin)) AS first_commit,
       max(pg_xact_commit_timestamp(o.xmin)) AS last_commit,
       count(*) AS transitions
FROM messenger.realtime_outbox o
JOIN messenger.conference_sessions s ON s.id = o.conference_id
JOIN messenger.reaper_runs r ON r.as_of = s.ended_at
GROUP BY r.run_id, r.started_at, r.finished_at, r.outcome
ORDER BY first_commit
"""


def one_runner(engine: Engine) -> Check:
    """No two runs' transitions overlap, and no run commits a transition after
    its run was closed (taken over): read from what they wrote, the realtime
    rows of each closing (their commit times, track_commit_timestamp) and
    messenger.reaper_runs (the run of a closing is the one whose as_of is its
    ended_at)."""
    runs = _rows(engine, RUN_TRANSITIONS)
    orphans = _rows(
        engine,
        """
        SELECT o.conference_id::text AS room FROM messenger.realtime_outbox o
        JOIN messenger.conference_sessions s ON s.id = o.conference_id
        WHERE NOT EXISTS (SELECT FROM messenger.reaper_runs r WHERE r.as_of = s.ended_at)
        """,
    )
    problems: list[dict[str, Any]] = []
    for before, after in itertools.pairwise(runs):
        if after.first_commit < before.last_commit:
            problems.append(
                {
                    "overlap": [before.run_id, after.run_id],
                    "first_ends": str(before.last_commit),
                    "second_starts": str(after.first_commit),
                }
            )
    for run in runs:
        if run.finished_at is not None and run.last_commit > run.finished_at:
            problems.append(
                {
                    "after_its_end": run.run_id,
                    "outcome": run.outcome,
                    "finished_at": str(run.finished_at),
                    "last_commit": str(run.last_commit),
                }
            )
    problems += [{"closing_of_no_run": o.room} for o in orphans]
    taken_over = sum(1 for r in runs if r.outcome == "taken_over")
    return Check(
        "one_runner",
        "fail" if problems else ("pass" if runs else "unknown"),
        f"{len(runs)} runs with transitions ({taken_over} taken over), "
        f"{sum(r.transitions for r in runs)} transitions",
        problems,
        {"runs": len(runs), "taken_over": taken_over},
    )


# -- recovery --------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[k]


def recovery(episodes: list[dict[str, Any]]) -> tuple[Check, dict[str, dict[str, float]]]:
    """Each episode recovered (its probe closed, published and stopped) within
    the largest bound of its kinds (bounds.RECOVERY_BOUNDS); the figures per kind."""
    per_kind: dict[str, list[float]] = {}
    late: list[dict[str, Any]] = []
    for episode in episodes:
        took = episode.get("recovered_s")
        bound = max(RECOVERY_BOUNDS[k] for k in episode["kinds"])
        if took is None or took > bound:
            late.append(
                {
                    "episode": episode["episode"],
                    "kinds": episode["kinds"],
                    "took_s": took,
                    "bound_s": bound,
                }
            )
        for kind in episode["kinds"]:
            per_kind.setdefault(kind, []).append(float("inf") if took is None else took)
    stats = {
        kind: {
            "n": len(values),
            "p50": percentile(values, 0.5),
            "p99": percentile(values, 0.99),
            "max": max(values),
            "bound": RECOVERY_BOUNDS[kind],
        }
        for kind, values in sorted(per_kind.items())
    }
    verdict = "fail" if late else ("pass" if episodes else "unknown")
    return (
        Check(
            "recovery",
            verdict,
            f"{len(episodes)} episodes, {len(late)} not recovered within their bound",
            late,
        ),
        stats,
    )


# -- coverage --------------------------------------------------------------------------


def recovery_paths(
    engine: Engine, logs: list[dict[str, Any]], redelivered: int | None
) -> dict[str, int | None]:
    """How often each recovery path was taken (None: this build cannot tell).

    - takeover: a run taken over while its phase was under way (the owner's
      lock was lost: a phase.lost or lock.lost of that run, or its last phase
      never completed);
    - rescued_chain: a run taken over after its last phase completed: its
      chain was lost between two phases (a worker or the broker gone);
    - relay_retry: a relay batch that failed (Kafka unreachable, a send or a
      mark that failed) whose rows were sent later;
    - duplicate_publish: an event id on Kafka more than once (the ledger's
      count of redelivered events)."""
    taken = _rows(
        engine,
        "SELECT run_id::text, phase FROM messenger.reaper_runs WHERE outcome = 'taken_over'",
    )
    completed = {
        (e.get("run_id"), e.get("phase")) for e in logs if e.get("event") == "phase.completed"
    }
    lost = {e.get("run_id") for e in logs if e.get("event") in ("phase.lost", "lock.lost")}
    rescued = sum(1 for r in taken if r.run_id not in lost and (r.run_id, r.phase) in completed)
    relay_failures = sum(
        1
        for e in logs
        if e.get("event") in ("relay.batch_failed", "relay.kafka_unavailable", "relay.db_failed")
    )
    return {
        "takeover": len(taken) - rescued,
        "rescued_chain": rescued,
        "relay_retry": relay_failures,
        "duplicate_publish": redelivered,
    }


def coverage(
    planned: dict[str, int], landed: dict[str, int], paths: dict[str, int | None]
) -> Check:
    """Every kind of fault in the plan landed at least once, and every recovery
    path was taken at least once: otherwise the campaign proved less than it
    says, and its verdict is unknown."""
    missing_kinds = sorted(k for k in planned if not landed.get(k))
    missing_paths = sorted(p for p in RECOVERY_PATHS if not paths.get(p))
    ok = not missing_kinds and not missing_paths
    return Check(
        "coverage",
        "pass" if ok else "unknown",
        "every planned kind landed and every recovery path was taken"
        if ok
        else f"never landed: {missing_kinds or 'none'}; "
        f"paths never taken: {missing_paths or 'none'}",
        [],
        {"landed": landed, "paths": paths},
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
