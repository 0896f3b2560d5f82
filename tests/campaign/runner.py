"""One campaign run: the plan played against a private world, then the
invariants (docs/campaign.md).

The schedule is the plan's; what was actually done is appended, with
timestamps, to ``actions.jsonl`` beside the plan. Every fault injected is
healed in a ``finally`` (and the world torn down), whatever failed.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text

from tests.campaign import faults as fault_kinds
from tests.campaign import invariants as inv
from tests.campaign.bounds import RECOVERY_BOUNDS
from tests.campaign.environment import GRACE_S, PROVISION_S, STALE_S, World
from tests.campaign.plan import COOL_DOWN_S, Fault, Plan
from tests.campaign.workload import WorkloadThread
from tests.support.facts import output_events

# A planted defect: a run that must be reported failing (tests/test_campaign.py), and
# the invariant that must catch it. A plan may plant several, comma-separated.
PLANTS = {
    # a closed room's event deleted from the outbox before the relay sent it:
    # the ledger must call it lost
    "lost_event": "ledger",
    # a room a participant joined is closed as empty behind the reaper's back
    "closed_after_join": "no_close_after_join",
}
LEDGER_KAFKA_TIMEOUT = timedelta(seconds=15)
LEDGER_TRIES = 3
PROBE = text(
    """
    WITH room AS (
        INSERT INTO messenger.conference_sessions
          (id, chat_id, deal_id, tenant_id, media_type, status, started_by_user_id,
           created_at, started_at, last_activity_at, updated_at,
           active_participant_count, peak_participant_count)
        SELECT gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
               'Audio', 'Active', gen_random_uuid(), t - interval '1 minute',
               t - interval '1 minute', t - make_interval(secs => :grace_s + 1), t, 0, 1
        FROM (SELECT clock_timestamp() AS t) now
        RETURNING id
    )
    INSERT INTO messenger.call_recordings (id, conference_id, status, created_at, updated_at)
    SELECT gen_random_uuid(), id, 'Recording', clock_timestamp(), clock_timestamp() FROM room
    RETURNING conference_id::text
    """
)
PROBE_DONE = text(
    """
    SELECT s.status = 'Ended'
       AND NOT EXISTS (SELECT FROM messenger.integration_outbox o
                       WHERE o.payload->'payload'->>'conferenceId' = :id
                         AND o.published_at IS NULL)
       AND NOT EXISTS (SELECT FROM messenger.call_recordings r
                       WHERE r.conference_id = s.id AND r.stop_requested_at IS NULL)
    FROM messenger.conference_sessions s WHERE s.id = CAST(:id AS uuid)
    """
)


@dataclass
class Log:
    """What was actually done, as JSON lines, with the wall clock and the
    seconds since the campaign's start."""

    path: Path
    t0: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    entries: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, what: str, **data: Any) -> dict[str, Any]:
        entry = {
            "at": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "t": round(time.monotonic() - self.t0, 2),
            "what": what,
            **data,
        }
        with self.lock:
            self.entries.append(entry)
            with self.path.open("a") as out:
                out.write(json.dumps(entry, default=str) + "\n")
        return entry


class Probe(threading.Thread):
    """Recovery of an episode: from its last heal until a room written then
    (eligible at once, with a running recording) is closed, its event
    acknowledged by Kafka and its stop signal taken."""

    def __init__(self, world: World, episode: int, kinds: list[str], limit: float) -> None:
        super().__init__(name=f"probe-{episode}", daemon=True)
        self.world, self.episode, self.kinds, self.limit = world, episode, kinds, limit
        self.took: float | None = None
        self.room: str | None = None

    def run(self) -> None:
        assert self.world.engine is not None
        started = time.monotonic()
        deadline = started + self.limit
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # the database may still be coming back
                if self.room is None:
                    with self.world.engine.begin() as conn:
                        self.room = conn.execute(PROBE, {"grace_s": GRACE_S}).scalar_one()
                with self.world.engine.connect() as conn:
                    if conn.execute(PROBE_DONE, {"id": self.room}).scalar():
                        self.took = round(time.monotonic() - started, 2)
                        return
            time.sleep(0.2)

    def to_json(self) -> dict[str, Any]:
        return {
            "episode": self.episode,
            "kinds": self.kinds,
            "room": self.room,
            "recovered_s": self.took,
        }


def run(plan: Plan, workdir: Path | None = None, *, keep: bool = False) -> dict[str, Any]:
    """Play ``plan``; the report as JSON-able data (report.py prints it)."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="reaper-campaign-"))
    workdir.mkdir(parents=True, exist_ok=True)
    plan.write(workdir / "plan.json")
    log = Log(workdir / "actions.jsonl")
    world = World(workdir)
    injected: dict[int, fault_kinds.Injected] = {}
    probes: list[Probe] = []
    landed: dict[str, int] = {}
    missed: dict[str, int] = {}
    workload: WorkloadThread | None = None
    started_at: datetime | None = None
    report: dict[str, Any] = {}
    planted: dict[str, str] = {}
    try:
        world.start()
        assert world.engine is not None
        log("world_started", workers=list(world.workers), topic=world.topic)
        with world.engine.connect() as conn:
            started_at = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        log.t0 = time.monotonic()
        workload = WorkloadThread(world.engine, plan.workload)
        workload.start()
        schedule = _schedule(plan)
        plant_at = plan.duration_s / 2 if plan.plant else None
        for at, step, index, fault in schedule:
            if plant_at is not None and at >= plant_at:
                _sleep_until(log, plant_at)
                _plants(world, plan.plant, workload, log, planted)
                plant_at = None
            _sleep_until(log, at)
            if step == "inject":
                try:
                    injected[index] = fault_kinds.inject(world, fault.kind, fault.target)
                    landed[fault.kind] = landed.get(fault.kind, 0) + 1
                    log(
                        "inject",
                        index=index,
                        kind=fault.kind,
                        target=fault.target,
                        detail=injected[index].detail,
                    )
                except fault_kinds.Missed as exc:
                    missed[fault.kind] = missed.get(fault.kind, 0) + 1
                    log(
                        "missed", index=index, kind=fault.kind, target=fault.target, detail=str(exc)
                    )
                except Exception as exc:  # the campaign's own defect: shown, never landed
                    missed[fault.kind] = missed.get(fault.kind, 0) + 1
                    log("inject_failed", index=index, kind=fault.kind, error=repr(exc))
            else:
                done = injected.get(index)
                if done is not None:
                    try:
                        fault_kinds.heal(world, done)
                        del injected[index]  # else the finally tries again
                        log("heal", index=index, kind=fault.kind, target=fault.target)
                    except Exception as exc:
                        log("heal_failed", index=index, kind=fault.kind, error=repr(exc))
                if _last_heal_of_episode(plan, fault, index, injected):
                    kinds = sorted({f.kind for f in plan.faults if f.episode == fault.episode})
                    limit = 2 * max(RECOVERY_BOUNDS[k] for k in kinds)
                    probe = Probe(world, fault.episode, kinds, limit)
                    probe.start()
                    probes.append(probe)
                    log("probe", episode=fault.episode, kinds=kinds)
        if plant_at is not None:
            _sleep_until(log, plant_at)
            _plants(world, plan.plant, workload, log, planted)
        # the last rooms written must have had time to become eligible and close
        _sleep_until(log, plan.duration_s - COOL_DOWN_S)
        workload.stop_writing.set()
        log("workload_stopped_writing", rooms=len(workload.rooms.kind))
        for probe in probes:
            probe.join()
        _sleep_until(log, plan.duration_s)
        log("checking")
        report = _check(plan, world, workload, probes, landed, missed, started_at, log)
    finally:
        for index, done in list(injected.items()):
            with contextlib.suppress(Exception):
                fault_kinds.heal(world, done)
                log("heal_in_finally", index=index, kind=done.kind)
        if workload is not None:
            workload.stop_writing.set()
            workload.stop.set()
            workload.join(timeout=10)
        logs_text = world.logs()
        (workdir / "workers.log").write_text(logs_text)
        with contextlib.suppress(Exception):
            world.close()
        log("world_closed")
    report["workdir"] = str(workdir)
    report["planted"] = planted
    (workdir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def _schedule(plan: Plan) -> list[tuple[float, str, int, Fault]]:
    steps = []
    for index, fault in enumerate(plan.faults):
        steps.append((fault.start, "inject", index, fault))
        steps.append((fault.end, "heal", index, fault))
    # at the same moment, a heal before an inject
    return sorted(steps, key=lambda s: (s[0], s[1] == "inject", s[2]))


def _last_heal_of_episode(
    plan: Plan, fault: Fault, index: int, in_force: dict[int, fault_kinds.Injected]
) -> bool:
    """This heal ends its episode: no other fault of the episode ends later."""
    return all(
        f.end < fault.end or (f.end == fault.end and i <= index)
        for i, f in enumerate(plan.faults)
        if f.episode == fault.episode
    )


def _sleep_until(log: Log, at: float) -> None:
    delay = at - (time.monotonic() - log.t0)
    if delay > 0:
        time.sleep(delay)


def _plants(
    world: World, plants: str, workload: WorkloadThread, log: Log, planted: dict[str, str]
) -> None:
    for plant in plants.split(","):
        planted[plant] = _plant(world, plant, workload, log)


def _plant(world: World, plant: str, workload: WorkloadThread, log: Log) -> str:
    """Plant one defect; the room it concerns."""
    assert world.engine is not None
    if plant == "lost_event":
        # an event of a closed room deleted before the relay sends it: the relay
        # is held off by taking its lock (as a pass would) for the deletion
        with world.engine.begin() as conn:
            conn.execute(
                text(
                    "SELECT pg_advisory_xact_lock("
                    "hashtextextended('messenger.conference-room-reaper.relay', 0))"
                )
            )
            with world.engine.begin() as rooms:
                room = rooms.execute(PROBE, {"grace_s": GRACE_S}).scalar_one()
            deadline = time.monotonic() + 30
            deleted = None
            while deleted is None and time.monotonic() < deadline:
                deleted = conn.execute(
                    text(
                        "DELETE FROM messenger.integration_outbox"
                        " WHERE payload->'payload'->>'conferenceId' = :id AND published_at IS NULL"
                        " RETURNING event_id::text"
                    ),
                    {"id": room},
                ).scalar()
                if deleted is None:
                    time.sleep(0.2)
        log("plant", plant=plant, room=room, event_id=deleted)
        return str(room)
    elif plant == "closed_after_join":
        with world.engine.begin() as conn:
            room = conn.execute(
                text(
                    """
                    WITH r AS (
                        INSERT INTO messenger.conference_sessions
                          (id, chat_id, deal_id, tenant_id, media_type, status,
                           started_by_user_id, created_at, started_at, last_activity_at,
                           updated_at, active_participant_count, peak_participant_count)
                        SELECT gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
                               gen_random_uuid(), 'Audio', 'Active', gen_random_uuid(),
                               clock_timestamp(), clock_timestamp(), clock_timestamp(),
                               clock_timestamp(), 1, 1
                        RETURNING id)
                    INSERT INTO messenger.conference_participants
                      (conference_id, user_id, joined_at)
                    SELECT id, gen_random_uuid(), clock_timestamp() FROM r
                    RETURNING conference_id::text
                    """
                )
            ).scalar_one()
        workload.rooms.joined.add(room)
        with world.engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE messenger.conference_sessions SET status = 'Ended',"
                    " end_reason = 'EmptyTimeout', ended_at = clock_timestamp(),"
                    " active_participant_count = 0 WHERE id = CAST(:id AS uuid)"
                ),
                {"id": room},
            )
        log("plant", plant=plant, room=room)
        return str(room)
    raise ValueError(f"unknown plant {plant!r}; one of {', '.join(PLANTS)}")


def _check(
    plan: Plan,
    world: World,
    workload: WorkloadThread,
    probes: list[Probe],
    landed: dict[str, int],
    missed: dict[str, int],
    started_at: datetime | None,
    log: Log,
) -> dict[str, Any]:
    from reaper.config import Settings

    engine = world.engine
    assert engine is not None and started_at is not None
    with engine.connect() as conn:
        until = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
    # The checker is patient where the subject is not: the workers' Kafka
    # timeout is 3 s (faults show fast), but a broker behind a Python proxy on
    # a busy machine took longer than half of that to bootstrap once in a
    # 10-minute run, and the ledger gave up. It gets LEDGER_KAFKA_TIMEOUT and
    # LEDGER_TRIES reads.
    settings = Settings(
        database_url=world.admin_url,
        kafka_bootstrap_servers=world.bootstrap,
        conference_ended_topic=world.topic,
        kafka_timeout=LEDGER_KAFKA_TIMEOUT,
    )
    checks: list[inv.Check] = []
    redelivered: int | None = None
    ledger_check = inv.Check("ledger", "unknown", "not read")
    for attempt in range(1, LEDGER_TRIES + 1):
        try:
            ledger_check, verdict = inv.ledger(engine, settings, started_at, until)
            redelivered = verdict.redelivered
            break
        except Exception as exc:  # the ledger could not read: undecided, never a pass
            ledger_check = inv.Check(
                "ledger", "unknown", f"the ledger could not read ({attempt} tries): {exc!r}"
            )
            log("ledger_unreadable", attempt=attempt, error=repr(exc))
    checks.append(ledger_check)
    checks.append(inv.no_close_after_join(engine, workload.rooms))
    checks.append(inv.command_ended_left_alone(engine, workload.rooms))
    checks.append(inv.nothing_eligible_left(engine, GRACE_S, PROVISION_S, STALE_S))
    checks.append(inv.stops_sent(engine))
    checks.append(inv.one_runner(engine))
    recovery_check, recovery_stats = inv.recovery([p.to_json() for p in probes])
    checks.append(recovery_check)
    if workload.error is not None:
        checks.append(inv.Check("workload", "fail", f"the workload stopped: {workload.error!r}"))
    events = output_events(world.logs())
    paths = inv.recovery_paths(engine, events, redelivered)
    checks.append(inv.coverage(plan.kinds(), landed, paths))
    verdicts = [c.verdict for c in checks]
    overall = "fail" if "fail" in verdicts else ("unknown" if "unknown" in verdicts else "pass")
    rooms = workload.rooms
    return {
        "seed": plan.seed,
        "plan_sha256": plan.sha256,
        "plant": plan.plant,
        "duration_s": plan.duration_s,
        "verdict": overall,
        "faults": {"planned": plan.kinds(), "landed": landed, "missed": missed},
        "most_at_once": plan.most_at_once(),
        "invariants": {c.name: c.to_json() for c in checks},
        "recovery": recovery_stats,
        "episodes": [p.to_json() for p in probes],
        "paths": paths,
        "rooms": {
            "written": len(rooms.kind),
            "by_kind": {k: len(rooms.of(k)) for k in sorted(set(rooms.kind.values()))},
            "joined": len(rooms.joined),
            "ended_by_command": len(rooms.ended_by_command),
            "workload_errors": rooms.errors,
        },
        "workers_started": world.started_workers,
        "actions": len(log.entries),
    }
