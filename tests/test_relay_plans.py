"""The relay's statements keep their plan while the outbox's statistics are stale.

An incident writes tens of thousands of outbox rows between two autovacuum
runs. Until the table is analyzed again, its statistics describe what it held
before: here, nothing at all (analyzed empty), while it holds 20,000 pending
rows. Without statistics the planner rates every ``IS NULL`` as rare, so every
index of the pending rows looks equally cheap; a per-key probe that walks
``ix_integration_outbox_pending`` (id) instead of the (message_key, id) index
then reads every earlier pending row for each candidate, and a batch of 2000
takes seconds instead of milliseconds (docs/history/performance-notes.md).

Each plan is checked twice, on the same rows: with the statistics of an empty
table, and after ``ANALYZE``. Everything runs in one transaction that is
rolled back (autovacuum never sees the rows, so the statistics stay stale).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

from reaper.queries import load

PENDING = 20_000
KEYS = 5_000  # four events per deal: the per-key checks find earlier rows
BATCH = 2_000

FILL = """
INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload, created_at)
SELECT gen_random_uuid(), 'pin.messenger.conference-ended.v1', 'deal-' || (g % :keys),
       jsonb_build_object('eventType', 'ConferenceEnded', 'correlationId', 'c',
                          'roster', repeat('x', 400)),
       now()
FROM generate_series(1, :pending) g
"""

# The relay's statements in the relay's transaction, with their parameters.
MARKS: dict[str, dict[str, Any]] = {
    "mark_outbox_parked": {"ids": [1, 2], "errors": ["refused", "refused"]},
    "mark_outbox_failed": {
        "ids": [3, 4],
        "errors": ["failed", "failed"],
        "charged": True,
        "backoff_initial_s": 1.0,
        "backoff_max_s": 60.0,
        "max_attempts": 20,
    },
}


@pytest.fixture(params=["stale", "analyzed"])
def outbox(request: pytest.FixtureRequest, engine: Engine) -> Iterator[Connection]:
    """A connection in an open transaction whose outbox holds PENDING pending rows;
    "stale": its statistics are those of an empty table."""
    with engine.connect() as conn, conn.begin() as tx:
        conn.execute(text("TRUNCATE messenger.integration_outbox RESTART IDENTITY"))
        conn.execute(text("ANALYZE messenger.integration_outbox"))
        conn.execute(text(FILL), {"keys": KEYS, "pending": PENDING})
        if request.param == "analyzed":
            conn.execute(text("ANALYZE messenger.integration_outbox"))
        else:
            reltuples = conn.execute(
                text("SELECT reltuples FROM pg_class WHERE relname = 'integration_outbox'")
            ).scalar_one()
            assert reltuples == 0, "the statistics must say the table is empty"
        conn.execute(text(load()["relay_planner"].text))
        # the claim as a pass runs it: fenced on the relay lock, held by this session
        assert conn.execute(text(load()["try_relay_lock"].text)).scalar_one() is not None
        try:
            yield conn
        finally:
            tx.rollback()


def nodes(plan: dict[str, Any], ancestors: tuple[dict, ...] = ()) -> Iterator[tuple]:
    yield plan, ancestors
    for child in plan.get("Plans", []):
        yield from nodes(child, (*ancestors, plan))


def outline(plan: dict[str, Any]) -> str:
    return "\n".join(
        "  " * len(ancestors)
        + " ".join(
            str(p) for p in (node["Node Type"], node.get("Index Name"), node.get("Alias")) if p
        )
        for node, ancestors in nodes(plan)
    )


def explain(conn: Connection, sql: str, params: dict[str, Any], *, analyze: bool = False) -> dict:
    options = "ANALYZE, BUFFERS, FORMAT JSON" if analyze else "FORMAT JSON"
    return conn.execute(text(f"EXPLAIN ({options}) {sql}"), params).scalar_one()[0]["Plan"]


def claim_problems(plan: dict[str, Any]) -> list[str]:
    """What makes a claim cost the backlog instead of the batch."""
    found = []
    scans = [(n, a) for n, a in nodes(plan) if n.get("Relation Name") == "integration_outbox"]
    for node, ancestors in scans:
        index = node.get("Index Name")
        if node["Node Type"] == "Seq Scan":
            found.append("sequential scan of integration_outbox")
        elif node.get("Alias") == "o" and index != "ix_integration_outbox_pending":
            found.append(f"the walk uses {index or node['Node Type']}")
        elif node.get("Alias", "").startswith("b") and index != "ix_integration_outbox_pending_key":
            found.append(f"a per-key probe uses {index or node['Node Type']}")
        if node.get("Alias") == "o":
            below_limit = []  # the nodes between the walk and the batch's LIMIT
            for ancestor in reversed(ancestors):
                if ancestor["Node Type"] == "Limit":
                    break
                below_limit.append(ancestor["Node Type"])
            if "Sort" in below_limit:
                found.append("a sort of the backlog below the batch's limit")
    probes = [n for n, _ in scans if n.get("Index Name") == "ix_integration_outbox_pending_key"]
    if len(probes) != 2:
        found.append(f"{len(probes)} probes of ix_integration_outbox_pending_key, expected 2")
    return found


def rows_removed(plan: dict[str, Any]) -> int:
    """Rows the statement read and threw away, over every loop of every node."""
    return sum(
        node.get("Rows Removed by Filter", 0) * node.get("Actual Loops", 1)
        for node, _ in nodes(plan)
    )


def claim(conn: Connection) -> dict[str, Any]:
    """The claim's parameters, fenced on this session's relay lock (a pass's)."""
    pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    return {"batch_size": BATCH, "holder_pid": pid, "from_id": 0}


def test_the_claim_keeps_its_plan_whatever_the_statistics(outbox: Connection) -> None:
    plan = explain(outbox, load()["claim_outbox_batch"].text, claim(outbox))
    assert claim_problems(plan) == [], outline(plan)


def test_a_claim_of_a_fresh_backlog_reads_the_batch_not_the_backlog(outbox: Connection) -> None:
    """Run for real: the rows the per-key probes pass over stay near the batch's
    own rows (each deal has 4 rows here), never the earlier pending rows of every
    candidate (~BATCH**2 / 2)."""
    plan = explain(outbox, load()["claim_outbox_batch"].text, claim(outbox), analyze=True)
    assert plan["Actual Rows"] == BATCH
    assert rows_removed(plan) < 2 * BATCH, outline(plan)


@pytest.mark.parametrize("name", list(MARKS))
def test_the_marks_reach_their_rows_by_key(outbox: Connection, name: str) -> None:
    plan = explain(outbox, load()[name].text, MARKS[name])
    kinds = {(node["Node Type"], node.get("Index Name")) for node, _ in nodes(plan)}
    assert not any(kind == "Seq Scan" for kind, _ in kinds), outline(plan)
    assert {index for _, index in kinds} & {"integration_outbox_pkey"}, outline(plan)


def nested_plans(conn: Connection, sql: str, params: dict[str, Any]) -> tuple[Any, list[dict]]:
    """Run ``sql`` for real; its result and the plans of the statements the
    functions it calls ran (auto_explain, sent to this client as notices, read
    on a cursor of the driver: SQLAlchemy's own execution logs them away)."""
    conn.execute(text("LOAD 'auto_explain'"))
    for name, value in (
        ("auto_explain.log_min_duration", "0"),
        ("auto_explain.log_nested_statements", "on"),
        ("auto_explain.log_level", "notice"),
        ("auto_explain.log_format", "json"),
    ):
        conn.execute(text("SELECT set_config(:n, :v, true)"), {"n": name, "v": value})
    raw = conn.connection.dbapi_connection
    assert raw is not None
    compiled = text(sql).bindparams(**params).compile(dialect=conn.dialect)
    cursor = raw.cursor()
    del raw.notices[:]
    cursor.execute(str(compiled), compiled.params)
    fetched = cursor.fetchone()
    assert fetched is not None
    [result] = fetched
    notices: list[str] = list(raw.notices)
    return result, [json.loads(n.split("plan:", 1)[1]) for n in notices if "plan:" in n]


def test_the_acknowledgement_deletes_its_rows_by_key(outbox: Connection) -> None:
    """The relay's mark of a batch, messenger.acknowledge_outbox: the DELETE inside
    the definer function reaches the batch's rows by the primary key, whatever the
    statistics say (EXPLAIN of the call shows only the call)."""
    ids = list(range(1, BATCH + 1))
    deleted, plans = nested_plans(outbox, load()["acknowledge_outbox"].text, {"ids": ids})
    assert deleted == BATCH
    [delete] = [p["Plan"] for p in plans if p["Query Text"].lstrip().startswith("DELETE")]
    scans = [
        n
        for n, _ in nodes(delete)
        if n["Node Type"] == "Bitmap Index Scan"
        or (n.get("Relation Name") == "integration_outbox" and n["Node Type"] != "ModifyTable")
    ]
    # each row fetched by its id (an index condition, or a bitmap of one), never a
    # walk of an index or of the table filtered by id
    assert scans and all(
        "id = ANY" in n.get("Index Cond", n.get("Recheck Cond", "")) for n in scans
    ), [(n["Node Type"], n.get("Index Name"), n.get("Index Cond", "")[:40]) for n in scans]


def test_the_check_sees_probes_that_walk_another_index(engine: Engine) -> None:
    """Without the (message_key, id) index the probes walk another one, and both
    checks above say so: they can fail."""
    with engine.connect() as conn, conn.begin() as tx:
        conn.execute(text("TRUNCATE messenger.integration_outbox RESTART IDENTITY"))
        conn.execute(text("ANALYZE messenger.integration_outbox"))
        conn.execute(text(FILL), {"keys": KEYS, "pending": PENDING})
        conn.execute(text("DROP INDEX messenger.ix_integration_outbox_pending_key"))
        conn.execute(text(load()["relay_planner"].text))
        conn.execute(text(load()["try_relay_lock"].text))
        sql = load()["claim_outbox_batch"].text
        found = claim_problems(explain(conn, sql, claim(conn)))
        removed = rows_removed(explain(conn, sql, claim(conn), analyze=True))
        tx.rollback()
    assert any(p.startswith("a per-key probe uses") for p in found), found
    assert removed > 2 * BATCH
