"""The phase statements' plans on an analyzed table with a long history.

A quiet cycle must cost the same at 10,000 or 1,000,000 finished rooms: each
phase reaches its candidates through its partial index only, in index order
(no sort of all candidates, no bitmap over them, no sequential scan of any
table). A few rows are not enough to see this, the planner then scans
everything anyway; so the tables here are seeded with a history and ANALYZEd.

Every plan is checked without tenant policies and with 1,000 of them (windows
longer and shorter than the defaults, some of them the seeded rooms' tenants):
the widest cutoff bounds the index range (an InitPlan), each row is held to
its own tenant's window by a primary-key probe (docs/design.md#windows-per-tenant).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

from reaper.config import Settings
from reaper.phases import IN_ORDER, PHASES, tenant_windows
from reaper.phases import bounds as phase_bounds
from reaper.queries import Queries, load, phase_statement
from tests.conftest import clean
from tests.support.factory import T0

HISTORY = 100_000
LIVE = 2_000
CANDIDATES = 20_000  # per phase: many batches

SEED = """
INSERT INTO messenger.conference_sessions
    (id, chat_id, deal_id, tenant_id, media_type, status, end_reason, started_by_user_id,
     created_at, started_at, ended_at, last_activity_at, updated_at,
     active_participant_count, peak_participant_count, duration_seconds)
SELECT gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), 'Video',
       'Ended', 'Normal', gen_random_uuid(), t, t, t + interval '30 min', t + interval '30 min',
       t + interval '30 min', 0, 2, 1800
FROM generate_series(1, :history) g,
     LATERAL (SELECT CAST(:t0 AS timestamptz) - interval '1 day' - g * interval '10 s' AS t) x;

-- healthy live rooms: in the partial index, never eligible
INSERT INTO messenger.conference_sessions
    (id, chat_id, deal_id, tenant_id, media_type, status, started_by_user_id,
     created_at, started_at, last_activity_at, updated_at,
     active_participant_count, peak_participant_count)
SELECT gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), 'Audio',
       'Active', gen_random_uuid(), :t0 - interval '1 hour', :t0 - interval '1 hour',
       :t0 - g * interval '1 ms', :t0, 2, 2
FROM generate_series(1, :live) g;

-- candidates of each phase: empty, stale (people in), stuck provisioning
INSERT INTO messenger.conference_sessions
    (id, chat_id, deal_id, tenant_id, media_type, status, started_by_user_id,
     created_at, started_at, last_activity_at, updated_at,
     active_participant_count, peak_participant_count)
SELECT gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), 'Video',
       CASE WHEN k = 3 THEN 'Provisioning' ELSE 'Active' END, gen_random_uuid(),
       :t0 - interval '6 hours' - g * interval '1 s',
       CASE WHEN k = 3 THEN NULL ELSE :t0 - interval '6 hours' END,
       CASE WHEN k = 2 THEN :t0 - interval '5 hours' ELSE :t0 - interval '10 min' END
           - g * interval '1 s',
       :t0 - interval '10 min', CASE WHEN k = 2 THEN 2 ELSE 0 END, 2
FROM generate_series(1, :candidates) g, generate_series(1, 3) k;

INSERT INTO messenger.conference_participants (conference_id, user_id, joined_at, left_at)
SELECT s.id, gen_random_uuid(), s.created_at + k * interval '1 min',
       CASE WHEN s.status = 'Ended' THEN s.ended_at END
FROM messenger.conference_sessions s, generate_series(1, 2) k;

INSERT INTO messenger.call_recordings (id, conference_id, status, created_at, updated_at)
SELECT gen_random_uuid(), s.id,
       CASE WHEN s.status = 'Ended' THEN 'Available' ELSE 'Recording' END,
       s.created_at, s.created_at
FROM messenger.conference_sessions s
WHERE s.status <> 'Ended' OR random() < 0.2;

ANALYZE messenger.conference_sessions, messenger.conference_participants,
        messenger.call_recordings, messenger.integration_outbox, messenger.realtime_outbox;
"""

# 1,000 tenant policies: 300 of them the tenants of seeded live rooms, the rest
# other tenants; grace 30 s or 10 min, provision timeout 1 min or 10 min,
# stale-live timeout 1 h, 2 h, 3 h or 6 h, or the default (each row sets one at least).
POLICIES = """
INSERT INTO messenger.reaper_tenant_windows
    (tenant_id, phase, window_length, updated_at, updated_by)
SELECT p.tenant_id, w.phase, w.window_length, p.updated_at, p.updated_by
FROM (
SELECT t,
       CASE g % 3 WHEN 0 THEN interval '30 s' WHEN 1 THEN interval '10 min' END,
       CASE g % 4 WHEN 0 THEN interval '1 min' WHEN 1 THEN interval '10 min' END,
       CASE WHEN g % 5 = 0 THEN interval '1 hour' WHEN g % 5 = 1 THEN interval '6 hours'
            WHEN g % 5 = 2 THEN interval '2 hours'
            WHEN g % 3 = 2 AND g % 4 >= 2 THEN interval '3 hours' END,
       CAST(:t0 AS timestamptz), 'test'
FROM (SELECT row_number() OVER () AS g, t
      FROM ((SELECT tenant_id AS t FROM messenger.conference_sessions
             WHERE status IN ('Provisioning', 'Active') ORDER BY id LIMIT :ours)
            UNION ALL
            (SELECT gen_random_uuid() FROM generate_series(1, :policies - :ours))) x) y
) AS p (tenant_id, empty_room_grace, provision_timeout, stale_live_timeout, updated_at, updated_by)
-- a policy row of 0.4.0's shape, one window row per phase it sets
CROSS JOIN LATERAL (VALUES ('empty_room', p.empty_room_grace),
                           ('provision_timeout', p.provision_timeout),
                           ('stale_live', p.stale_live_timeout)) AS w (phase, window_length)
WHERE w.window_length IS NOT NULL;

ANALYZE messenger.reaper_tenant_windows;
"""

TABLES = {
    "conference_sessions",
    "conference_participants",
    "call_recordings",
    "integration_outbox",
    "realtime_outbox",
}

# The partial index each phase's claim must use (its migration made it).
INDEX = {
    "empty_room": "ix_conf_empty_active",
    "provision_timeout": "ix_conf_provisioning",
    "stale_live": "ix_conf_active",
}
# A phase's default window (Settings' defaults).
DEFAULTS = Settings()
STATEMENTS = load(IN_ORDER)


def statement_of(phase: str) -> str:
    """The statement a phase's batch runs (phases.reap_batch)."""
    return "end_active_batch" if PHASES[phase].ends_active else "fail_provisioning_batch"


def window(phase: str) -> timedelta:
    return PHASES[phase].window(DEFAULTS)


@pytest.fixture(scope="module")
def seeded(database_url: str) -> Iterator[Engine]:
    from reaper.db import engine_for

    engine = engine_for(database_url)
    with engine.begin() as conn:
        clean(conn)
        conn.execute(
            text(SEED),
            {"t0": T0, "history": HISTORY, "live": LIVE, "candidates": CANDIDATES},
        )
    yield engine
    with engine.begin() as conn:
        conn.execute(
            text(
                "TRUNCATE messenger.realtime_outbox, messenger.integration_outbox,"
                " messenger.call_recordings, messenger.conference_participants,"
                " messenger.conference_sessions, messenger.reaper_tenant_windows"
                " RESTART IDENTITY CASCADE"
            )
        )


@pytest.fixture(scope="module", params=[0, 1000], ids=["no-policies", "1000-policies"])
def policies(request: pytest.FixtureRequest, seeded: Engine) -> Iterator[int]:
    """The seeded history without tenant policies, then with 1,000 of them."""
    with seeded.begin() as conn:
        conn.execute(text("TRUNCATE messenger.reaper_tenant_windows"))
        if request.param:
            conn.execute(text(POLICIES), {"t0": T0, "policies": request.param, "ours": 300})
        conn.execute(text("ANALYZE messenger.reaper_tenant_windows"))
    yield request.param
    with seeded.begin() as conn:
        conn.execute(text("TRUNCATE messenger.reaper_tenant_windows"))


def nodes(plan: dict[str, Any], ancestors: tuple[dict, ...] = ()) -> Iterator[tuple]:
    yield plan, ancestors
    for child in plan.get("Plans", []):
        yield from nodes(child, (*ancestors, plan))


def widest(conn: Connection, phase: str, as_of: datetime) -> datetime:
    """The phase's range_cutoff, as phases.reap_batch passes it: the shortest of the
    default window and every tenant's."""
    return PHASES[phase].range_cutoff(DEFAULTS, as_of, tenant_windows(Queries(conn)))


FENCE_RUN = "plan-test-run"


def open_fence(conn: Connection) -> None:
    """What a phase's batch needs to change anything, in the caller's transaction:
    an open run and the run lock held by this connection."""
    conn.execute(
        text(
            "SELECT pg_advisory_xact_lock(hashtextextended('messenger.conference-room-reaper', 0))"
        )
    )
    # a run another test left open is closed here too (the caller rolls back)
    conn.execute(
        text(
            "UPDATE messenger.reaper_runs SET finished_at = now(), outcome = 'taken_over'"
            " WHERE finished_at IS NULL"
        )
    )
    conn.execute(
        text(
            "INSERT INTO messenger.reaper_runs (run_id, as_of, started_at, deadline,"
            " lease_expires_at, owner) VALUES (:run, now(), now(), now() + interval '1 min',"
            " now() + interval '1 min', 'plan test')"
        ),
        {"run": FENCE_RUN},
    )


def explain(
    conn: Connection,
    phase: str,
    as_of,
    batch_size: int = 100,
    *,
    analyze: bool = False,
    only: list[str] | None = None,
    statement: str | None = None,
) -> dict[str, Any]:
    """The phase statement's plan (or that of ``statement``, bound the same way);
    ``analyze`` runs it (the caller rolls back)."""
    name = statement_of(phase)
    params = {
        "as_of": as_of,
        **bounds(conn, as_of),
        "batch_size": batch_size,
        "excluded": [],
        "only": only,
        # the fence: a run that open_fence() opened, the lock held by this connection
        "run_id": FENCE_RUN,
        "holder_pid": conn.execute(text("SELECT pg_backend_pid()")).scalar_one(),
    }
    if name == "end_active_batch":
        params |= {"topic": "pin.messenger.conference-ended.v1"}
    options = "ANALYZE, FORMAT JSON" if analyze else "FORMAT JSON"
    sql = f"EXPLAIN ({options}) " + (statement or STATEMENTS[phase_statement(name, phase)].text)
    return conn.execute(text(sql), params).scalar_one()[0]["Plan"]


def outline(plan: dict[str, Any]) -> str:
    """The plan as indented node lines, for a failing assertion's message."""
    return "\n".join(
        "  " * len(ancestors)
        + " ".join(
            str(part)
            for part in (node["Node Type"], node.get("Relation Name"), node.get("Index Name"))
            if part
        )
        for node, ancestors in nodes(plan)
    )


def problems(plan: dict[str, Any], index: str) -> list[str]:
    """What makes a plan's cost grow with the table, or with the square of the
    batch, instead of with the batch."""
    found = []
    claims = []
    for node, ancestors in nodes(plan):
        kind, relation = node["Node Type"], node.get("Relation Name")
        if kind == "Nested Loop":
            # the inner side runs once per outer row: a CTE read there is read
            # whole each time, a batch times a batch
            [inner] = [c for c in node["Plans"] if c["Parent Relationship"] == "Inner"]
            for scan, _ in nodes(inner):
                if scan["Node Type"] == "CTE Scan":
                    found.append(f"nested loop over {scan['CTE Name']} (quadratic in the batch)")
        if kind == "Seq Scan" and relation in TABLES:
            found.append(f"sequential scan of {relation}")
        if kind == "Bitmap Index Scan" and node["Index Name"].startswith("ix_conf_"):
            found.append(f"bitmap scan of {node['Index Name']} (all candidates, unordered)")
        if relation == "conference_sessions" and kind in ("Index Scan", "Index Only Scan"):
            if node.get("Index Name") == index:
                claims.append(node)
            if any(a["Node Type"] in ("Sort", "Incremental Sort") for a in ancestors):
                found.append(f"sort above a scan of conference_sessions ({node['Index Name']})")
    if not claims:
        found.append(f"no index scan using {index}")
    return found


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("moment", ["backlog", "quiet"])
@pytest.mark.parametrize("batch_size", [100, 1000])
def test_phase_statement_plan_stays_on_its_partial_index(
    seeded: Engine, policies: int, phase: str, moment: str, batch_size: int
) -> None:
    # "quiet": a cycle's moment at which nothing is eligible yet
    as_of = T0 if moment == "backlog" else T0 - timedelta(hours=7)
    with seeded.connect() as conn:
        plan = explain(conn, phase, as_of, batch_size)
    assert problems(plan, INDEX[phase]) == [], outline(plan)


def locked_scan_loops(plan: dict[str, Any]) -> int:
    """How often the batch looked for rows a command holds (its ``visible`` scan)."""
    [scan] = [node for node, _ in nodes(plan) if node.get("Alias") == "v"]
    return scan["Actual Loops"]


def fence_probes(plan: dict[str, Any]) -> list[str]:
    """How the batch reads its run (the fence): the index of each read of reaper_runs."""
    return [
        node.get("Index Name", node["Node Type"])
        for node, _ in nodes(plan)
        if node.get("Relation Name") == "reaper_runs"
    ]


@pytest.mark.parametrize("phase", list(PHASES))
def test_only_a_short_batch_looks_for_rows_a_command_holds(seeded: Engine, phase: str) -> None:
    """A full batch leaves the search for locked rows to the batch that comes back
    short (a second walk of the index range, a policy probe per row, per batch)."""
    with seeded.connect() as conn, conn.begin() as tx:
        open_fence(conn)
        full = explain(conn, phase, T0, 100, analyze=True)
        # three of the phase's rooms (its candidates), by its own statement
        few = (
            conn.execute(
                STATEMENTS[phase_statement("batch_candidates", phase)],
                {"as_of": T0, **bounds(conn, T0), "batch_size": 3, "excluded": [], "only": None},
            )
            .scalars()
            .all()
        )
        short = explain(conn, phase, T0, 100, analyze=True, only=list(few))
        tx.rollback()
    assert len(few) == 3
    # one index probe for the run: the open run is one row, by key or by the open index
    assert fence_probes(full) in (["reaper_runs_pkey"], ["ux_reaper_runs_one_open"]), outline(full)
    assert locked_scan_loops(full) == 0, outline(full)
    assert locked_scan_loops(short) == 1, outline(short)


# The per-cycle census (the backlog gauge, the mass-closure guard) and reaper
# plan: each phase's count is a range of that phase's own partial index.
CENSUS: dict[str, set[str]] = {
    "eligible_census": set(INDEX.values()),
    **{phase_statement("guard_eligible", p.name): {INDEX[p.name]} for p in IN_ORDER if p.guarded},
    "plan_candidates": set(INDEX.values()),
    # the rooms ahead of the clock: a range of ix_conf_active past the data's clock (T0)
    "activity_ahead_count": {"ix_conf_active"},
    "activity_ahead": {"ix_conf_active"},
}


def bounds(conn: Connection, as_of: datetime) -> dict[str, datetime]:
    """Every phase's default cutoff and range end, as phases.bounds names them."""
    return phase_bounds(DEFAULTS, as_of, tenant_windows(Queries(conn)))


def census_problems(plan: dict[str, Any], indexes: set[str]) -> list[str]:
    found = []
    used = set()
    for node, _ in nodes(plan):
        if node["Node Type"] == "Seq Scan" and node.get("Relation Name") in TABLES:
            found.append(f"sequential scan of {node['Relation Name']}")
        if node.get("Index Name", "").startswith("ix_conf_"):  # a range of it, bitmap or not
            used.add(node["Index Name"])
    if used != indexes:
        found.append(f"indexes used: {sorted(used)}, expected {sorted(indexes)}")
    return found


@pytest.mark.parametrize("statement", list(CENSUS))
@pytest.mark.parametrize("moment", ["backlog", "quiet"])
def test_census_statements_count_index_ranges_not_live_rooms(
    seeded: Engine, policies: int, statement: str, moment: str
) -> None:
    as_of = T0 if moment == "backlog" else T0 - timedelta(hours=7)
    params = {
        "as_of": as_of,
        "excluded": [],
        "per_phase": 100,
        "now": T0,  # the seeded rooms' clock: none of them is ahead of it
        "ahead_of": T0 + timedelta(seconds=5),
        "limit": 100,
        "phases": list(PHASES),
    }
    with seeded.connect() as conn:
        params |= bounds(conn, as_of)
        sql = "EXPLAIN (FORMAT JSON) " + STATEMENTS[statement].text
        plan = conn.execute(text(sql), params).scalar_one()[0]["Plan"]
    assert census_problems(plan, CENSUS[statement]) == [], outline(plan)


def test_the_plan_check_sees_a_scan_of_all_candidates(seeded: Engine) -> None:
    """Without the partial indexes the same statement scans: the check above can fail."""
    with seeded.connect() as conn, conn.begin() as tx:
        conn.execute(text("DROP INDEX messenger.ix_conf_empty_active, messenger.ix_conf_active"))
        found = problems(explain(conn, "empty_room", T0), "ix_conf_empty_active")
        tx.rollback()
    assert "no index scan using ix_conf_empty_active" in found
    assert any("scan" in p and "conference_sessions" in p for p in found), found


def joined_windows(plan: dict[str, Any]) -> list[str]:
    """The scans of the tenants' windows joined to the rooms (not a subquery's: the
    range bound's InitPlan, a probe per row)."""
    return [
        node.get("Index Cond") or node.get("Filter", "")
        for node, ancestors in nodes(plan)
        if node.get("Relation Name") == "reaper_tenant_windows"
        and not any(
            n.get("Parent Relationship") in ("InitPlan", "SubPlan") for n in (*ancestors, node)
        )
    ]


@pytest.mark.parametrize("moment", ["backlog", "quiet"])
def test_the_census_joins_each_phase_s_windows_once(
    seeded: Engine, policies: int, moment: str
) -> None:
    """Each phase's count joins its own windows, and nothing more: an earlier
    phase's window is a probe, reached only for a room that phase's predicate
    selects (none, where the two phases cannot select the same room). Joined for
    every earlier phase, the census planned and ran a join per pair of phases,
    and (under an unknown range bound) hashed the windows table for each."""
    as_of = T0 if moment == "backlog" else T0 - timedelta(hours=7)
    with seeded.connect() as conn:
        sql = "EXPLAIN (FORMAT JSON) " + STATEMENTS["eligible_census"].text
        given = {"as_of": as_of, **bounds(conn, as_of)}
        plan = conn.execute(text(sql), given).scalar_one()[0]["Plan"]
    joined = joined_windows(plan)
    assert len(joined) == len(IN_ORDER), joined
    for phase in IN_ORDER:
        assert sum(f"'{phase.name}'" in cond for cond in joined) == 1, joined


# the closed rooms' roster rows, as close_roster picks them, and as a bare IN would
HASHED_MEMBERSHIP = "(r.conference_id IN (SELECT x.id FROM closed x)) IS TRUE"
JOINED_MEMBERSHIP = "r.conference_id IN (SELECT x.id FROM closed x)"


@pytest.mark.parametrize("phase", list(PHASES))
def test_the_closed_rooms_roster_is_matched_by_hash_where_the_planner_would_loop(
    seeded: Engine, phase: str
) -> None:
    """On a big table the planner takes a batch's CTEs for a row each and joins them
    by nested loops (the bench's 1,000-room batch spent 39 of its 123 ms there).
    With hash and merge joins off, as it then plans, the statement still reads no
    CTE once per row; the same statement with a bare IN does: the check can fail."""
    written = STATEMENTS[phase_statement(statement_of(phase), phase)].text
    assert HASHED_MEMBERSHIP in written
    joined = written.replace(HASHED_MEMBERSHIP, JOINED_MEMBERSHIP)
    with seeded.connect() as conn, conn.begin() as tx:
        conn.execute(text("SET LOCAL enable_hashjoin = off"))
        conn.execute(text("SET LOCAL enable_mergejoin = off"))
        kept = problems(explain(conn, phase, T0, 1000), INDEX[phase])
        bare = problems(explain(conn, phase, T0, 1000, statement=joined), INDEX[phase])
        tx.rollback()
    assert kept == []
    assert any(p.endswith("(quadratic in the batch)") for p in bare), bare


@pytest.mark.parametrize("policies", [1000], indirect=True)
@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("moment", ["backlog", "quiet"])
def test_tenant_windows_widen_the_range_and_probe_each_row_by_key(
    seeded: Engine, policies: int, phase: str, moment: str
) -> None:
    """The claim's index range ends at the widest cutoff, a constant the planner
    can estimate; a row's own window is one probe of the policies' primary key,
    never a scan of them per row."""
    as_of = T0 if moment == "backlog" else T0 - timedelta(hours=7)
    with seeded.connect() as conn:
        assert widest(conn, phase, as_of) > as_of - window(phase)  # shorter ones
        plan = explain(conn, phase, as_of)
    index = INDEX[phase]
    found, probes = [], 0
    for node, _ in nodes(plan):
        if node.get("Relation Name") == "reaper_tenant_windows":
            if (node["Node Type"], node.get("Index Name")) != (
                "Index Scan",
                "reaper_tenant_windows_pkey",
            ) or "tenant_id = " not in node.get("Index Cond", ""):
                found.append(f"{node['Node Type']} of reaper_tenant_windows")
            probes += 1
        if node.get("Index Name") == index and "SubPlan" in node.get("Index Cond", ""):
            found.append(f"{index} bounded by a subquery")
    assert found == [] and probes, outline(plan)


@pytest.mark.parametrize("policies", [1000], indirect=True)
def test_the_census_counts_what_the_claims_would_select(seeded: Engine, policies: int) -> None:
    """The counts join the policies, the claims probe them per row (and their ranges
    are bounded differently): the same rooms.
    And the policies make a difference on this seed (else this proves nothing)."""
    guarded = [p.name for p in IN_ORDER if p.guarded]

    def guard_counts(conn: Connection) -> dict[str, int]:
        given = {"as_of": T0, **bounds(conn, T0), "excluded": []}
        return {
            name: conn.execute(
                STATEMENTS[phase_statement("guard_eligible", name)], given
            ).scalar_one()
            for name in guarded
        }

    with seeded.connect() as conn:

        def claimable(phase: str) -> set[str]:
            rows = conn.execute(
                STATEMENTS[phase_statement("batch_candidates", phase)],
                {
                    "as_of": T0,
                    **bounds(conn, T0),
                    "batch_size": 1_000_000,
                    "excluded": [],
                    "only": None,
                },
            )
            return set(rows.scalars())

        given = {"as_of": T0, **bounds(conn, T0)}
        census = {row.phase: row.n for row in conn.execute(STATEMENTS["eligible_census"], given)}
        guards = guard_counts(conn)
        claims = {phase: claimable(phase) for phase in PHASES}
    with seeded.connect() as conn, conn.begin() as tx:
        conn.execute(text("DELETE FROM messenger.reaper_tenant_windows"))
        without_policies = guard_counts(conn)
        tx.rollback()
    # each room counted in the first phase that would claim it (the later phases
    # run after the earlier ones closed theirs)
    earlier: set[str] = set()
    for phase in IN_ORDER:
        assert census[phase.name] == len(claims[phase.name] - earlier), phase.name
        earlier |= claims[phase.name]
    for name in guarded:
        assert guards[name] == len(claims[name])
    assert guards != without_policies  # shorter and longer windows than the default apply
