"""Windows per tenant (docs/design.md#windows-per-tenant): ``reaper policy
set/unset/list``, stored in ``messenger.reaper_tenant_windows``; a tenant's
windows replace the defaults for its conferences only, in the phases, in
``reaper plan`` and ``reaper status``, in the backlog gauge and in the
mass-closure guard's count."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, make_url, text

from reaper import metrics
from reaper.clock import human
from reaper.config import Settings
from reaper.control import OPTIONS, STALE_LIVE_FLOOR, Controls, PolicyRefused, floors
from reaper.cycle import Reaper
from reaper.events import ConferenceReaped, CycleResult, PhaseMassClosure, process_bus
from reaper.overview import plan, status
from reaper.phases import PHASES
from reaper.wiring import Gauges
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.facts import FactRecorder, count_events, log_events
from tests.support.processes import Worker, run_cli, wait_until

A = "aaaaaaaa-0000-4000-8000-000000000001"
B = "bbbbbbbb-0000-4000-8000-000000000002"
C = "cccccccc-0000-4000-8000-000000000003"


def policies(engine: Engine) -> list[dict[str, Any]]:
    """The stored policies, one per tenant: its windows by their Settings field
    (a phase without one: absent), its latest change's time and author."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT * FROM messenger.reaper_tenant_windows ORDER BY tenant_id, phase")
        ).mappings()
        tenants: dict[str, dict[str, Any]] = {}
        for row in rows:
            policy = tenants.setdefault(str(row["tenant_id"]), {"tenant_id": row["tenant_id"]})
            policy[PHASES[row["phase"]].setting] = row["window_length"]
            if row["updated_at"] >= policy.get("updated_at", row["updated_at"]):
                policy |= {"updated_at": row["updated_at"], "updated_by": row["updated_by"]}
        return list(tenants.values())


def status_of(engine: Engine, conference: dict[str, Any]) -> tuple[str, str | None]:
    with engine.connect() as conn:
        return f.statuses(conn)[conference["id"]]


def reaped(facts: FactRecorder) -> dict[str, ConferenceReaped]:
    return {r.conference_id: r for r in facts.of(ConferenceReaped)}


def assert_lateness(
    fact: ConferenceReaped, eligible_from: datetime, window: timedelta, within: tuple
) -> None:
    """lateness = the closing statement's clock - (last_activity_at or created_at + the
    row's own window); the statement ran between the two database readings ``within``."""
    before, after = within
    low = (before - eligible_from - window).total_seconds()
    high = (after - eligible_from - window).total_seconds()
    assert fact.lateness_seconds is not None
    assert low - 0.001 <= fact.lateness_seconds <= high + 0.001, (fact, low, high)


def cycle(settings: Settings, engine: Engine, as_of: datetime) -> tuple[CycleResult, tuple]:
    before = f.db_now(engine)
    result = Reaper(settings, engine=engine).run_cycle(as_of)
    return result, (before, f.db_now(engine))


# -- the engine --------------------------------------------------------------


def test_a_longer_grace_keeps_that_tenants_empty_room_only(settings, engine, facts):
    Controls(engine, settings).set_policy(A, empty_room_grace=timedelta(minutes=10))
    with engine.begin() as conn:  # identical rooms, empty for 5 min (default grace 90 s)
        kept = f.conference(conn, idle=timedelta(minutes=5), tenant_id=A)
        closed = f.conference(conn, idle=timedelta(minutes=5), tenant_id=B)
        # A's policy sets the grace only: its provisioning room has the default timeout
        stuck = f.conference(conn, status="Provisioning", age=timedelta(minutes=5), tenant_id=A)
    result, within = cycle(settings, engine, T0)
    assert (result["empty_timeout_count"], result["provision_failed_count"]) == (1, 1)
    assert status_of(engine, closed) == ("Ended", "EmptyTimeout")
    assert status_of(engine, kept) == ("Active", None)
    assert status_of(engine, stuck) == ("Failed", "Error")
    facts_now = reaped(facts)
    assert_lateness(
        facts_now[closed["id"]], closed["last_activity_at"], timedelta(seconds=90), within
    )
    assert_lateness(facts_now[stuck["id"]], stuck["created_at"], timedelta(minutes=2), within)

    facts.clear()
    later = T0 + timedelta(minutes=6)  # 11 min without activity: past A's grace
    result, within = cycle(settings, engine, later)
    assert result["empty_timeout_count"] == 1
    assert status_of(engine, kept) == ("Ended", "EmptyTimeout")
    # eligible from last activity + A's 10 min, not + 90 s
    assert_lateness(
        reaped(facts)[kept["id"]], kept["last_activity_at"], timedelta(minutes=10), within
    )


def test_a_longer_provision_timeout_keeps_that_tenants_room_provisioning(settings, engine, facts):
    Controls(engine, settings).set_policy(A, provision_timeout=timedelta(minutes=10))
    with engine.begin() as conn:
        kept = f.conference(conn, status="Provisioning", age=timedelta(minutes=5), tenant_id=A)
        failed = f.conference(conn, status="Provisioning", age=timedelta(minutes=5), tenant_id=B)
    result, within = cycle(settings, engine, T0)
    assert result["provision_failed_count"] == 1
    assert status_of(engine, failed) == ("Failed", "Error")
    assert status_of(engine, kept) == ("Provisioning", None)
    assert_lateness(reaped(facts)[failed["id"]], failed["created_at"], timedelta(minutes=2), within)

    facts.clear()
    result, within = cycle(settings, engine, T0 + timedelta(minutes=6))
    assert result["provision_failed_count"] == 1
    assert status_of(engine, kept) == ("Failed", "Error")
    assert_lateness(reaped(facts)[kept["id"]], kept["created_at"], timedelta(minutes=10), within)


def test_stale_live_closes_earlier_or_later_by_the_tenants_timeout(settings, engine, facts):
    controls = Controls(engine, settings)
    controls.set_policy(A, stale_live_timeout=timedelta(hours=1))  # shorter than 4 h
    controls.set_policy(C, stale_live_timeout=timedelta(hours=6))  # longer
    with engine.begin() as conn:  # people "in", heartbeats stopped
        early = f.conference(
            conn, idle=timedelta(hours=2), age=timedelta(hours=3), participants=2, tenant_id=A
        )
        default_young = f.conference(
            conn, idle=timedelta(hours=2), age=timedelta(hours=3), participants=2, tenant_id=B
        )
        default_old = f.conference(
            conn, idle=timedelta(hours=5), age=timedelta(hours=6), participants=2, tenant_id=B
        )
        late = f.conference(
            conn, idle=timedelta(hours=5), age=timedelta(hours=6), participants=2, tenant_id=C
        )
        for _ in range(10):  # live rooms: the guard's share stays low
            f.conference(conn, idle=timedelta(minutes=1), participants=2)
    result, within = cycle(settings, engine, T0)
    assert result["stale_timeout_count"] == 2
    assert status_of(engine, early) == ("Ended", "Timeout")  # before the default would
    assert status_of(engine, default_old) == ("Ended", "Timeout")
    assert status_of(engine, default_young) == ("Active", None)
    assert status_of(engine, late) == ("Active", None)  # after the default would
    now = reaped(facts)
    assert_lateness(now[early["id"]], early["last_activity_at"], timedelta(hours=1), within)
    assert_lateness(
        now[default_old["id"]], default_old["last_activity_at"], timedelta(hours=4), within
    )

    facts.clear()
    result, within = cycle(settings, engine, T0 + timedelta(hours=1, minutes=1))
    assert result["stale_timeout_count"] == 1
    assert status_of(engine, late) == ("Ended", "Timeout")
    assert status_of(engine, default_young) == ("Active", None)  # 3 h 1 min < 4 h
    assert_lateness(reaped(facts)[late["id"]], late["last_activity_at"], timedelta(hours=6), within)


def test_a_policy_is_read_by_the_next_cycle_and_unset_restores_the_defaults(settings, engine):
    controls = Controls(engine, settings)
    controls.set_policy(A, empty_room_grace=timedelta(minutes=10))
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5), tenant_id=A)
    assert Reaper(settings, engine=engine).run_cycle(T0)["empty_timeout_count"] == 0
    unset = controls.unset_policy(A)
    assert unset is not None and unset.windows["empty_room_grace"] == timedelta(minutes=10)
    assert policies(engine) == [] and controls.unset_policy(A) is None
    assert Reaper(settings, engine=engine).run_cycle(T0)["empty_timeout_count"] == 1
    assert status_of(engine, room) == ("Ended", "EmptyTimeout")


def test_an_empty_room_past_its_stale_timeout_but_within_its_grace_waits_for_the_grace(
    database_url, engine
):
    """Validated against the defaults of the day: if REAPER_STALE_LIVE_TIMEOUT is later
    lowered below a tenant's grace, the phases (first one wins) and the census agree."""
    Controls(engine, Settings(database_url=database_url)).set_policy(
        A, empty_room_grace=timedelta(hours=2)
    )
    settings = Settings(database_url=database_url, stale_live_timeout=timedelta(hours=1))
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=90), age=timedelta(hours=3), tenant_id=A)
    planned = plan(engine, settings, T0, per_phase=10)["phases"]
    assert (planned["empty_room"]["eligible"], planned["stale_live"]["eligible"]) == (0, 1)
    result = Reaper(settings, engine=engine).run_cycle(T0)
    assert (result["empty_timeout_count"], result["stale_timeout_count"]) == (0, 1)
    assert status_of(engine, room) == ("Ended", "Timeout")


# -- reaper plan, reaper status, the backlog gauge ------------------------------------


def seed_mixed(engine: Engine, as_of: datetime) -> dict[str, dict[str, Any]]:
    """Rooms of three tenants: A (longer windows), B (defaults), C (shorter windows)."""
    rooms: dict[str, dict[str, Any]] = {}
    spec: dict[str, dict[str, Any]] = {
        "empty_5m": {"idle": timedelta(minutes=5)},
        "empty_60s": {"idle": timedelta(seconds=60)},
        "empty_20m": {"idle": timedelta(minutes=20)},
        "provisioning_5m": {"status": "Provisioning", "age": timedelta(minutes=5)},
        "provisioning_90s": {"status": "Provisioning", "age": timedelta(seconds=90)},
        "stale_2h": {"idle": timedelta(hours=2), "age": timedelta(hours=3), "participants": 2},
        "stale_5h": {"idle": timedelta(hours=5), "age": timedelta(hours=6), "participants": 1},
        "stale_7h": {"idle": timedelta(hours=7), "age": timedelta(hours=8), "participants": 1},
    }
    with engine.begin() as conn:
        for tenant in (A, B, C):
            for what, kwargs in spec.items():
                rooms[f"{tenant[0]}:{what}"] = f.conference(
                    conn, as_of=as_of, tenant_id=tenant, **kwargs
                )
        for _ in range(20):  # healthy live rooms: the guard stays quiet
            f.conference(conn, as_of=as_of, idle=timedelta(seconds=10), participants=3)
    return rooms


WILL_CLOSE = {
    # A: grace 10 min, provision 10 min, stale 6 h
    "a:empty_20m": "empty_room",
    "a:stale_7h": "stale_live",
    # B: the defaults (90 s, 2 min, 4 h)
    "b:empty_5m": "empty_room",
    "b:empty_20m": "empty_room",
    "b:provisioning_5m": "provision_timeout",
    "b:stale_5h": "stale_live",
    "b:stale_7h": "stale_live",
    # C: grace 30 s, provision 1 min, stale 1 h
    "c:empty_5m": "empty_room",
    "c:empty_60s": "empty_room",
    "c:empty_20m": "empty_room",
    "c:provisioning_5m": "provision_timeout",
    "c:provisioning_90s": "provision_timeout",
    "c:stale_2h": "stale_live",
    "c:stale_5h": "stale_live",
    "c:stale_7h": "stale_live",
}
# what a room became says which phase closed it
PHASE_OF = {(p.status, p.end_reason): p.name for p in PHASES.values()}


def set_mixed_policies(controls: Controls) -> None:
    controls.set_policy(
        A,
        empty_room_grace=timedelta(minutes=10),
        provision_timeout=timedelta(minutes=10),
        stale_live_timeout=timedelta(hours=6),
    )
    controls.set_policy(
        C,
        empty_room_grace=timedelta(seconds=30),
        provision_timeout=timedelta(minutes=1),
        stale_live_timeout=timedelta(hours=1),
    )


def test_plan_lists_exactly_what_the_next_cycle_closes_with_policies(settings, engine):
    set_mixed_policies(Controls(engine, settings))
    rooms = seed_mixed(engine, T0)
    name_of = {room["id"]: name for name, room in rooms.items()}
    planned = plan(engine, settings, T0, per_phase=100)
    listed = {
        name_of[c["conference_id"]]: phase
        for phase, p in planned["phases"].items()
        for c in p["conferences"]
    }
    assert listed == WILL_CLOSE
    by_name = {
        name_of[c["conference_id"]]: c for p in planned["phases"].values() for c in p["conferences"]
    }
    assert by_name["c:empty_60s"]["window_seconds"] == 30
    assert by_name["c:empty_60s"]["tenant_policy"]
    assert "grace 30s, tenant policy" in by_name["c:empty_60s"]["reason"]
    assert by_name["b:empty_5m"]["window_seconds"] == 90
    assert not by_name["b:empty_5m"]["tenant_policy"]
    assert "timeout 6h, tenant policy" in by_name["a:stale_7h"]["reason"]

    result = Reaper(settings, engine=engine).run_cycle(T0)
    with engine.connect() as conn:
        closed = {
            name_of[cid]: PHASE_OF[state]
            for cid, state in f.statuses(conn).items()
            if state in PHASE_OF
        }
    assert closed == WILL_CLOSE
    assert {name: p["would_close"] for name, p in planned["phases"].items()} == {
        p.name: result[p.count_key] for p in PHASES.values()
    }
    assert plan(engine, settings, T0, per_phase=100)["would_close"] == 0


def test_status_and_the_backlog_gauge_count_with_the_policies(settings, engine):
    set_mixed_policies(Controls(engine, settings))
    now = f.db_now(engine)
    rooms = seed_mixed(engine, now)
    data = status(engine, settings)
    expected = {phase: list(WILL_CLOSE.values()).count(phase) for phase in PHASE_OF.values()}
    assert {name: p["eligible"] for name, p in data["phases"].items()} == expected
    assert data["active_backlog"] == len(WILL_CLOSE)
    assert data["tenant_policies"] == 2
    # the oldest eligible empty room became eligible at its own last activity + its
    # own grace: C's 20 min room at 30 s (B's 20 min room at 90 s is later)
    since = datetime.fromisoformat(data["phases"]["empty_room"]["oldest_eligible_since"])
    assert since == rooms["c:empty_20m"]["last_activity_at"] + timedelta(seconds=30)
    since = datetime.fromisoformat(data["phases"]["stale_live"]["oldest_eligible_since"])
    assert since == rooms["c:stale_7h"]["last_activity_at"] + timedelta(hours=1)
    Gauges(engine, settings, process_bus).refresh()
    assert metrics.sample("messenger_conf_reaper_active_backlog") == len(WILL_CLOSE)


# -- the mass-closure guard ------------------------------------------------------------


def test_the_guard_counts_with_the_tenant_windows(settings, engine, caplog):
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:  # 30 of 40 live rooms idle 2 h: stale only for tenant A
        for _ in range(30):
            f.conference(
                conn, idle=timedelta(hours=2), age=timedelta(hours=3), participants=2, tenant_id=A
            )
        for _ in range(10):
            f.conference(conn, idle=timedelta(minutes=1), participants=2)
    facts = FactRecorder(process_bus, PhaseMassClosure)
    try:
        assert Reaper(settings, engine=engine).run_cycle(T0)["stale_timeout_count"] == 0
        assert facts.of(PhaseMassClosure) == []  # not stale by the default 4 h: nothing to guard
        Controls(engine, settings).set_policy(A, stale_live_timeout=timedelta(hours=1))
        planned = plan(engine, settings, T0, per_phase=5)["phases"]["stale_live"]
        assert planned["eligible"] == 30 and planned["blocked"]
        result = Reaper(settings, engine=engine).run_cycle(T0)
        [guard] = facts.of(PhaseMassClosure)
    finally:
        facts.close()
    assert result["stale_timeout_count"] == 0 and (guard.eligible, guard.active) == (30, 40)
    assert len(log_events(caplog, "phase.mass_closure_blocked")) == 1


def test_a_longer_stale_timeout_keeps_rooms_out_of_the_guards_count(settings, engine):
    with engine.begin() as conn:  # 30 rooms stale by the default, 25 of them tenant C's
        for tenant in [C] * 25 + [B] * 5:
            f.conference(
                conn,
                idle=timedelta(hours=5),
                age=timedelta(hours=6),
                participants=2,
                tenant_id=tenant,
            )
        for _ in range(10):
            f.conference(conn, idle=timedelta(minutes=1), participants=2)
    Controls(engine, settings).set_policy(C, stale_live_timeout=timedelta(hours=6))
    result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["stale_timeout_count"] == 5  # 5 of 40 is under the floor: not guarded


# -- the controls, in this process ---------------------------------------------------


def test_set_merges_into_the_tenants_policy_and_tells_who(settings, engine, facts, caplog):
    caplog.set_level(logging.INFO, "reaper")
    controls = Controls(engine, Settings(database_url=settings.database_url, operator="alice"))
    first = controls.set_policy(A.upper(), empty_room_grace=timedelta(minutes=10))
    assert first.tenant_id == A  # canonical form
    second = controls.set_policy(A, stale_live_timeout=timedelta(hours=6))
    given = {"empty_room_grace": timedelta(minutes=10), "stale_live_timeout": timedelta(hours=6)}
    # every phase's window, the others the default (None)
    assert second.windows == {name: given.get(name) for name in OPTIONS}
    [row] = policies(engine)
    assert row["updated_by"] == "alice" and row["updated_at"] == second.updated_at
    # stored as seconds (no day part): as_of - window is exact in any time zone
    controls.set_policy(A, stale_live_timeout=timedelta(days=7))
    with engine.connect() as conn:
        stored = conn.execute(
            text(
                "SELECT window_length::text FROM messenger.reaper_tenant_windows"
                " WHERE phase = 'stale_live'"
            )
        ).scalar_one()
    assert stored == "168:00:00"
    logged = log_events(caplog, "control.policy_set")
    assert logged[0] == {
        "tenant_id": A,
        # a field per phase's window, the ones not set null
        **{f"{name}_seconds": None for name in OPTIONS},
        "empty_room_grace_seconds": 600.0,
        "updated_at": logged[0]["updated_at"],
        "updated_by": "alice",
    }
    controls.unset_policy(A)
    [gone] = log_events(caplog, "control.policy_unset")
    assert (gone["tenant_id"], gone["unset_by"], gone["stale_live_timeout_seconds"]) == (
        A,
        "alice",
        7 * 86400.0,
    )


@pytest.mark.parametrize(
    ("windows", "option"),
    [
        ({"empty_room_grace": timedelta(0)}, "--empty-room-grace"),
        ({"provision_timeout": timedelta(seconds=-1)}, "--provision-timeout"),
        ({"stale_live_timeout": timedelta(days=7, seconds=1)}, "--stale-live-timeout"),
        ({"empty_room_grace": timedelta(hours=4)}, "--empty-room-grace"),  # = default stale
        # below the floors: one polling interval (30 s), 15 minutes for stale_live
        ({"empty_room_grace": timedelta(seconds=29)}, "--empty-room-grace"),
        ({"provision_timeout": timedelta(seconds=1)}, "--provision-timeout"),
        ({"stale_live_timeout": timedelta(minutes=14, seconds=59)}, "--stale-live-timeout"),
        ({}, "policy set"),
    ],
)
def test_refused_windows_change_nothing(settings, engine, windows, option):
    controls = Controls(engine, settings)
    controls.set_policy(A, provision_timeout=timedelta(minutes=5))
    before = policies(engine)
    with pytest.raises(PolicyRefused) as refused:
        controls.set_policy(A, **windows)
    assert refused.value.option == option and str(refused.value).startswith(f"{option}: ")
    with pytest.raises(PolicyRefused):  # a new tenant: nothing inserted either
        controls.set_policy(B, **windows)
    assert policies(engine) == before


def test_the_floors_are_one_polling_interval_and_fifteen_minutes(database_url, engine):
    settings = Settings(database_url=database_url, polling_interval=timedelta(minutes=1))
    controls = Controls(engine, settings)
    # a guarded phase ends occupied rooms: its floor is STALE_LIVE_FLOOR; any
    # other phase's is one polling interval (here 1 minute)
    assert floors(settings) == {
        p.setting: STALE_LIVE_FLOOR if p.guarded else timedelta(minutes=1) for p in PHASES.values()
    }
    assert floors(settings)["stale_live_timeout"] == STALE_LIVE_FLOOR
    assert floors(settings)["empty_room_grace"] == timedelta(minutes=1)
    assert timedelta(minutes=15) == STALE_LIVE_FLOOR
    for name, option in OPTIONS.items():
        floor = floors(settings)[name]
        with pytest.raises(PolicyRefused) as refused:
            controls.set_policy(A, **{name: floor - timedelta(milliseconds=1)})
        assert str(refused.value) == (
            f"{option}: must be at least {human(floor.total_seconds())}"
            f" (got {(floor - timedelta(milliseconds=1)).total_seconds():g} s)"
        )
        assert policies(engine) == []
    # each floor itself is a valid window
    controls.set_policy(
        A,
        empty_room_grace=timedelta(minutes=1),
        provision_timeout=timedelta(minutes=1),
        stale_live_timeout=STALE_LIVE_FLOOR,
    )
    [stored] = policies(engine)
    assert (stored["empty_room_grace"], stored["stale_live_timeout"]) == (
        timedelta(minutes=1),
        STALE_LIVE_FLOOR,
    )


def test_the_grace_is_checked_against_the_merged_policy(settings, engine):
    controls = Controls(engine, settings)
    controls.set_policy(A, empty_room_grace=timedelta(hours=2))  # below the default 4 h
    with pytest.raises(PolicyRefused, match=r"^--stale-live-timeout: .*grace \(2h\).*\(1h\)"):
        controls.set_policy(A, stale_live_timeout=timedelta(hours=1))
    with pytest.raises(PolicyRefused, match=r"^--empty-room-grace: .*\(4h, the default\)"):
        controls.set_policy(B, empty_room_grace=timedelta(hours=5))
    controls.set_policy(A, stale_live_timeout=timedelta(hours=3))
    assert policies(engine)[0]["stale_live_timeout"] == timedelta(hours=3)
    with pytest.raises(PolicyRefused, match=r"^--tenant: 'x' is not a UUID"):
        controls.set_policy("x", empty_room_grace=timedelta(minutes=1))


# -- the worker's role ---------------------------------------------------------------


@pytest.fixture
def worker_role_engine(database_url: str, engine: Engine) -> Iterator[Engine]:
    """A LOGIN member of reaper_worker (migrations 0004, 0008), as the worker logs in."""
    name = f"reaper_policy_{uuid.uuid4().hex[:8]}"
    password = f"pw-{uuid.uuid4().hex}"
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE ROLE {name} LOGIN PASSWORD '{password}' IN ROLE reaper_worker"
        )
    url = make_url(database_url).set(username=name, password=password)
    role_engine = create_engine(url)
    yield role_engine
    role_engine.dispose()
    with engine.begin() as conn:
        conn.execute(
            text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :n"),
            {"n": name},
        )
        conn.exec_driver_sql(f"DROP ROLE {name}")


def test_the_worker_role_reads_the_policies_in_a_cycle(settings, engine, worker_role_engine):
    Controls(engine, settings).set_policy(A, empty_room_grace=timedelta(minutes=10))
    with engine.begin() as conn:
        kept = f.conference(conn, idle=timedelta(minutes=5), tenant_id=A)
        f.conference(conn, idle=timedelta(minutes=5), tenant_id=B)
    result = Reaper(settings, engine=worker_role_engine).run_cycle(T0)
    assert result["empty_timeout_count"] == 1 and result["failed_count"] == 0
    assert status_of(engine, kept) == ("Active", None)


# -- the command ---------------------------------------------------------------------


def stderr_events(stderr: str, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return [line for line in lines if line["event"] == name]


@pytest.mark.process
def test_policy_set_list_unset_round_trip(engine):
    env = {"REAPER_OPERATOR": "alice"}
    done = run_cli(
        "policy",
        "set",
        "--tenant",
        A,
        "--empty-room-grace",
        "PT10M",
        "--stale-live-timeout",
        "21600",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"set the policy of tenant {A}: empty_room_grace 10m, provision_timeout default (2m),"
        " stale_live_timeout 6h (by alice)"
    )
    [logged] = stderr_events(done.stderr, "control.policy_set")
    assert (logged["tenant_id"], logged["updated_by"], logged["level"]) == (A, "alice", "WARNING")
    # again for the same tenant: merged (the grace stays)
    again = run_cli("policy", "set", "--tenant", A, "--provision-timeout", "90", env=env)
    assert again.returncode == 0, again.stderr
    assert "empty_room_grace 10m, provision_timeout 1m30s, stale_live_timeout 6h" in again.stdout
    assert run_cli("policy", "set", "--tenant", B, "--empty-room-grace", "30").returncode == 0

    listed = run_cli("policy", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [r["tenant_id"] for r in rows] == [A, B]
    assert {k: v for k, v in rows[0].items() if k != "updated_at"} == {
        "tenant_id": A,
        "empty_room_grace_seconds": 600.0,
        "provision_timeout_seconds": 90.0,
        "stale_live_timeout_seconds": 21600.0,
        "updated_by": "alice",
    }
    assert rows[0]["updated_at"].endswith("Z")
    assert rows[1]["provision_timeout_seconds"] is None
    assert rows[1]["stale_live_timeout_seconds"] is None
    text_list = run_cli("policy", "list").stdout
    assert text_list.startswith("2 tenant policies (defaults: empty_room_grace 1m30s,")
    assert f"{B}  30s" in text_list and "default (2m)" in text_list

    status = json.loads(run_cli("status", "--json").stdout)
    assert status["tenant_policies"] == 2

    unset = run_cli("policy", "unset", "--tenant", A, env=env)
    assert unset.returncode == 0, unset.stderr
    assert unset.stdout.startswith(f"removed the policy of tenant {A}: empty_room_grace 10m")
    [logged] = stderr_events(unset.stderr, "control.policy_unset")
    assert (logged["tenant_id"], logged["unset_by"]) == (A, "alice")
    missing = run_cli("policy", "unset", "--tenant", A)
    assert missing.returncode == 1 and "has no policy" in missing.stdout
    assert [r["tenant_id"] for r in json.loads(run_cli("policy", "list", "--json").stdout)] == [B]
    assert run_cli("policy", "unset", "--tenant", B).returncode == 0
    assert run_cli("policy", "list").stdout.startswith("no tenant policies")


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--empty-room-grace", "0"], "--empty-room-grace: '0' must be a positive duration"),
        (["--provision-timeout=-30"], "--provision-timeout: '-30' must be a positive duration"),
        (["--stale-live-timeout", "P8D"], "--stale-live-timeout: must be at most 7 days (got 8d)"),
        (["--empty-room-grace", "604801"], "--empty-room-grace: must be at most 7 days"),
        (["--empty-room-grace", "1h"], "--empty-room-grace: '1h' must be seconds (90) or an ISO"),
        (["--provision-timeout", "soon"], "--provision-timeout: 'soon' must be seconds (90)"),
        # the tenant's effective grace must stay below its effective stale-live timeout
        (["--empty-room-grace", "PT4H"], "--empty-room-grace: the tenant's empty-room grace (4h)"),
        (["--stale-live-timeout", "900"], "--stale-live-timeout: the tenant's empty-room grace"),
        # below the floors: one polling interval (30 s), 15 minutes for stale_live
        (["--empty-room-grace", "29"], "--empty-room-grace: must be at least 30s (got 29 s)"),
        (["--provision-timeout", "PT10S"], "--provision-timeout: must be at least 30s (got 10 s)"),
        (["--stale-live-timeout", "1"], "--stale-live-timeout: must be at least 15m (got 1 s)"),
        ([], "policy set: give at least one of --empty-room-grace, --provision-timeout,"),
        (["--tenant", "not-a-uuid", "--empty-room-grace", "60"], "--tenant: 'not-a-uuid' is not"),
    ],
)
def test_policy_set_refuses_with_one_line_and_changes_nothing(settings, engine, args, line):
    # the policy it must leave alone, set in process: the same code as the command's
    Controls(engine, settings).set_policy(A, empty_room_grace=timedelta(seconds=1200))
    before = policies(engine)
    tenant = [] if "--tenant" in args else ["--tenant", A]
    refused = run_cli("policy", "set", *tenant, *args)
    assert refused.returncode == 2, refused
    assert refused.stdout == ""
    [only] = refused.stderr.strip().splitlines()
    assert only.startswith(f"reaper: {line}"), only
    assert policies(engine) == before


@pytest.mark.process
def test_policy_unset_refuses_a_bad_uuid():
    refused = run_cli("policy", "unset", "--tenant", "12345")
    assert refused.returncode == 2
    assert refused.stderr.strip() == "reaper: --tenant: '12345' is not a UUID"


# -- through the real worker -------------------------------------------------------


@pytest.mark.process
def test_the_worker_keeps_a_tenants_room_until_its_policy_is_unset(engine, tmp_path):
    assert run_cli("policy", "set", "--tenant", A, "--empty-room-grace", "PT1H").returncode == 0
    worker = Worker(tmp_path, {"REAPER_POLLING_INTERVAL": "1", "REAPER_EMPTY_ROOM_GRACE": "2"})
    worker.start()
    try:
        now = f.db_now(engine)
        with engine.begin() as conn:  # identical rooms, empty for 10 s
            kept = f.conference(conn, as_of=now, idle=timedelta(seconds=10), tenant_id=A)
            closed = f.conference(conn, as_of=now, idle=timedelta(seconds=10), tenant_id=B)
        wait_until(
            lambda: f.session_row_status(engine, closed["id"]) == "Ended", 30, "B's room closed"
        )

        def cycles() -> int:
            return count_events(worker.output(), "cycle.completed")

        seen = cycles()
        wait_until(lambda: cycles() >= seen + 3, 30, "three more cycles")
        assert f.session_row_status(engine, kept["id"]) == "Active"
        unset = run_cli("policy", "unset", "--tenant", A)
        assert unset.returncode == 0, unset.stderr
        wait_until(
            lambda: f.session_row_status(engine, kept["id"]) == "Ended",
            15,
            "A's room closed after the unset",
        )
    finally:
        worker.stop()
    with engine.connect() as conn:
        assert f.session_row(conn, kept["id"])["end_reason"] == "EmptyTimeout"
