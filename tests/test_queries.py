"""The named-query loader: one text per query, fragments written once."""

from __future__ import annotations

import ast
import inspect
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reaper import queries as queries_module
from reaper.config import Settings
from reaper.phases import IN_ORDER, PHASES, bounds
from reaper.queries import PhaseSql, load, parse, phase_statement
from tests.support.activity import BATCH_TEXT, like

SOURCE = """
-- fragment: recent
recent AS (SELECT id FROM t WHERE at > now() - interval '1 hour'),

-- name: first
WITH
-- include: recent
other AS (SELECT 1)
SELECT * FROM recent;

-- name: second
WITH
-- include: recent
SELECT count(*) FROM recent;
"""


def test_a_fragment_stands_in_every_query_that_includes_it() -> None:
    queries = parse(SOURCE)
    assert set(queries) == {"first", "second"}  # a fragment is not a query
    fragment = "recent AS (SELECT id FROM t WHERE at > now() - interval '1 hour'),"
    assert queries["first"] == f"WITH\n{fragment}\nother AS (SELECT 1)\nSELECT * FROM recent;"
    assert queries["second"] == f"WITH\n{fragment}\nSELECT count(*) FROM recent;"


def test_an_unknown_fragment_or_a_name_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fragment 'missing'"):
        parse("-- name: q\nWITH\n-- include: missing\nSELECT 1;")
    with pytest.raises(ValueError, match="name 'q' is defined twice"):
        parse("-- name: q\nSELECT 1;\n-- name: q\nSELECT 2;")


def test_the_phase_statements_share_one_fence_and_one_roster_lock() -> None:
    for name, sql in phase_statements().items():
        assert sql.count("fence AS (") == 1 and sql.count("roster_claimed AS (") == 1, name
        assert "-- include:" not in sql


def test_the_fault_tests_see_a_phase_batch_and_nothing_else_as_one() -> None:
    """The fault tests find a batch in flight in pg_stat_activity by its text
    (tests/support/activity.py): every phase statement has it, no other query."""
    batches = phase_statements()
    for name, statement in load(IN_ORDER).items():
        assert like(BATCH_TEXT, statement.text) == (name in batches), name


def phase_statements() -> dict[str, str]:
    """Every phase statement, as the loader writes it for each of its phases."""
    return {
        name: statement.text
        for name, statement in load(IN_ORDER).items()
        if name.startswith(("end_active_batch[", "fail_provisioning_batch["))
    }


def test_a_fragment_may_include_another_indented_and_without_its_comment() -> None:
    queries = parse(
        "-- fragment: inner\n-- why inner, written once\nx > 1\n\n"
        "-- fragment: outer\n-- why outer\nWHERE\n    -- include: inner\n\n"
        "-- name: q\nSELECT * FROM t\n-- include: outer\n;"
    )
    assert queries["q"] == "SELECT * FROM t\nWHERE\nx > 1\n;"


def test_a_fragment_that_includes_itself_is_refused() -> None:
    with pytest.raises(ValueError, match="fragment 'loop' includes itself"):
        parse("-- fragment: loop\nx\n-- include: loop\n\n-- name: q\n-- include: loop\n")


def test_each_phase_statement_writes_each_phases_rooms_once() -> None:
    """The claim (visible and claimed) is one fragment, the rooms of a phase one
    fragment in it: the expanded statements hold them twice, the file once."""
    source = (Path(__file__).parents[1] / "reaper" / "sql" / "queries.sql").read_text()
    assert source.count("-- fragment: batch_rooms") == 1
    # visible and claimed (the fragment claim), batch_candidates
    assert source.count("-- include: batch_rooms") == 3
    # every phase's statement: one per phase (written for it), one transition each
    written = phase_statements()
    assert len(written) == len(PHASES)
    for sql in phase_statements().values():
        assert sql.count("\nvisible AS (") == 1 and sql.count("\nclaimed AS (") == 1
        assert sql.count("roster AS (") == 1 and sql.count("SELECT 'fenced'") == 1


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_phase_statement_holds_its_own_phases_rooms_and_no_other(phase: str) -> None:
    """Written once per phase, each statement selects its phase's rooms (their
    range in visible and claimed) and names no other phase's bounds, so the
    server parses and plans only what runs."""
    own = PHASES[phase]
    statement = "end_active_batch" if own.ends_active else "fail_provisioning_batch"
    sql = load(IN_ORDER)[phase_statement(statement, phase)].text
    assert sql.count(f"CAST(:{phase}_range AS timestamptz)") == 2
    for other in PHASES:
        if other != phase:
            assert f":{other}_" not in sql and f"'{other}'" not in sql
    assert ":phase" not in sql and "{" not in sql.replace("jsonb_build_object", "")
    assert f"SET status = '{own.status}',\n        end_reason = '{own.end_reason}'" in sql
    candidates = load(IN_ORDER)[phase_statement("batch_candidates", phase)].text
    assert candidates.count(f"CAST(:{phase}_range AS timestamptz)") == 1


A = PhaseSql(name="a", since="made_at", status="Ended", end_reason="Gone")
B = PhaseSql(name="b", since="seen_at", status="Failed", end_reason="Broke")


def test_a_query_for_each_phase_is_written_once_per_phase_with_its_values() -> None:
    queries = parse(
        "-- fragment: a_selects\nx = 1\n\n-- fragment: b_selects\nx = 2\n\n"
        "-- fragment: rooms\n-- why, written once\n-- include: {phase}_selects\n"
        "AND t.{since} < :{phase}_cutoff\n\n"
        "-- name: q\n-- for each phase\nSELECT '{status}' FROM t WHERE\n-- include: rooms\n;\n\n"
        "-- name: ended\n-- for each phase becoming Ended\nSELECT '{end_reason}';\n\n"
        "-- name: others\n-- for each phase not becoming Ended\nSELECT '{end_reason}';\n\n"
        "-- name: plain\nSELECT 1;",
        (A, B),
    )
    assert queries == {
        "q[a]": "SELECT 'Ended' FROM t WHERE\nx = 1\nAND t.made_at < :a_cutoff\n;",
        "q[b]": "SELECT 'Failed' FROM t WHERE\nx = 2\nAND t.seen_at < :b_cutoff\n;",
        "ended[a]": "SELECT 'Gone';",
        "others[b]": "SELECT 'Broke';",
        "plain": "SELECT 1;",
    }
    assert phase_statement("q", "a") == "q[a]"


def test_a_query_over_the_phases_follows_their_order_and_leaves_out_the_earlier_ones() -> None:
    source = (
        "-- fragment: a_selects\nx = 1\n\n-- fragment: b_selects\nx = 2\n\n"
        "-- fragment: not_earlier\nAND NOT (\n    -- include: {phase}_selects\n)\n\n"
        "-- fragment: count\n(SELECT '{phase}', count(*) FROM t WHERE\n"
        "    -- include: {phase}_selects\n    -- include each earlier phase: not_earlier\n)\n\n"
        "-- name: census\n-- include each phase joined by UNION ALL: count\n;"
    )
    first = "(SELECT 'a', count(*) FROM t WHERE\nx = 1\n\n)"
    second = "(SELECT 'b', count(*) FROM t WHERE\nx = 2\nAND NOT (\nx = 1\n)\n)"
    assert parse(source, (A, B)) == {"census": f"{first}\nUNION ALL\n{second}\n;"}
    # the order decides which phase takes a room first
    first = "(SELECT 'b', count(*) FROM t WHERE\nx = 2\n\n)"
    second = "(SELECT 'a', count(*) FROM t WHERE\nx = 1\nAND NOT (\nx = 2\n)\n)"
    assert parse(source, (B, A)) == {"census": f"{first}\nUNION ALL\n{second}\n;"}


def test_a_phase_include_needs_a_phase_and_a_fragment_for_each() -> None:
    with pytest.raises(ValueError, match="outside a statement written for a phase"):
        parse("-- fragment: a_selects\nx\n\n-- name: q\nSELECT\n-- include: {phase}_selects\n")
    with pytest.raises(ValueError, match="unknown fragment 'b_selects'"):
        parse(
            "-- fragment: a_selects\nx\n\n"
            "-- name: q\n-- for each phase\nSELECT\n-- include: {phase}_selects\n",
            (A, B),
        )
    with pytest.raises(ValueError, match="not a plain name"):
        parse(
            "-- name: q\n-- for each phase\nSELECT {since}\n",
            (PhaseSql(name="a", since="x; DROP", status="Ended", end_reason="Gone"),),
        )


BOUNDS = set(bounds(Settings(), datetime.now(UTC), {}))


RUNNERS = ("_run", "_run_phase", "_run_phases")


def _runs_by_method() -> list[tuple[str, str, set[str], bool]]:
    """``(method of Queries, query name, keyword arguments bound, **bounds too)``
    for each ``_run(self.conn, "name", key=...)`` call in the class; a
    ``_run_phase(self.conn, "name", phase, key=...)`` call runs the query
    written for each phase (``name[phase]``), a ``_run_phases`` call the one
    statement written over them."""
    tree = ast.parse(inspect.getsource(queries_module.Queries))
    statements = load(IN_ORDER)
    runs = []
    for method in ast.walk(tree):
        if not isinstance(method, ast.FunctionDef):
            continue
        for call in ast.walk(method):
            if not (isinstance(call, ast.Call) and ast.unparse(call.func) in RUNNERS):
                continue
            name = call.args[1]
            assert isinstance(name, ast.Constant) and isinstance(name.value, str), (
                f"{method.name} names its query at run time"
            )
            bound = {keyword.arg for keyword in call.keywords if keyword.arg is not None}
            mapping = False
            for keyword in call.keywords:
                # ``**bounds``: phases' cutoffs and range ends, as phases.bounds
                # names them; any other mapping would hide what the query binds
                if keyword.arg is None:
                    assert ast.unparse(keyword.value) == "bounds", f"{method.name} binds a mapping"
                    mapping = True
            if ast.unparse(call.func) != "_run_phase":
                runs.append((method.name, name.value, bound, mapping))
                continue
            written = [key for p in PHASES if (key := phase_statement(name.value, p)) in statements]
            assert written, f"{method.name} runs {name.value!r}, not written for each phase"
            runs += [(method.name, n, bound, mapping) for n in written]
    return runs


def test_every_named_query_has_one_method_that_binds_exactly_its_parameters() -> None:
    """The type checker holds the callers to Queries' signatures; this holds the
    methods to queries.sql: each runs a query that exists, binding the parameters
    its text names and no others, and every query is run by one method. A
    statement about phases names phases' bounds, which ``**bounds`` binds (the
    caller passes phases.bounds or phases.cutoffs: the statement's own and more)."""
    statements = load(IN_ORDER)
    runs = _runs_by_method()
    assert sorted(name for _, name, _, _ in runs) == sorted(statements)
    for method, name, bound, mapping in runs:
        expected = set(statements[name].compile().params)
        if mapping:
            named = expected & BOUNDS
            assert named, f"Queries.{method} binds **bounds for {name}, which names none"
            expected -= BOUNDS
        assert bound == expected, f"Queries.{method} binds {sorted(bound)} for {name}"


def test_a_fragment_takes_fragments_as_arguments_and_may_pass_them_on() -> None:
    queries = parse(
        "-- fragment: key_a\n-- why a\nhash('a')\n\n-- fragment: key_b\nhash('b')\n\n"
        "-- fragment: row(key)\n-- why, written once\nl.k = {key}\n\n"
        "-- fragment: held(key)\nEXISTS (SELECT FROM l WHERE l.pid = :pid AND\n"
        "    -- include: row(key)\n)\n\n"
        "-- name: qa\nSELECT\n-- include: held(key_a)\n;\n\n"
        "-- name: qb\nSELECT * FROM l WHERE\n-- include: row(key_b)\n;"
    )
    assert queries == {
        "qa": "SELECT\nEXISTS (SELECT FROM l WHERE l.pid = :pid AND\nl.k = hash('a')\n)\n;",
        "qb": "SELECT * FROM l WHERE\nl.k = hash('b')\n;",
    }


def test_a_fragment_given_the_wrong_arguments_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fragment 'row' takes \(key\), given \(\)"):
        parse("-- fragment: row(key)\nl.k = {key}\n\n-- name: q\n-- include: row\n")
    with pytest.raises(ValueError, match="unknown fragment 'nokey'"):
        parse("-- fragment: row(key)\nl.k = {key}\n\n-- name: q\n-- include: row(nokey)\n")
    with pytest.raises(ValueError, match=r"fragment 'row' has \{other\}"):
        parse(
            "-- fragment: k\n1\n\n-- fragment: row(key)\nl.k = {other}\n\n"
            "-- name: q\n-- include: row(k)\n"
        )
    with pytest.raises(ValueError, match="query 'q' takes arguments"):
        parse("-- name: q(key)\nSELECT 1;\n")


def test_each_lock_key_is_written_once_and_pg_locks_is_read_by_one_fragment() -> None:
    """The run lock, the relay's and the stop pass's (and the gates of the marks)
    are taken, waited for and tested by fragments that take the key: the file
    writes each key once and how a lock looks in pg_locks once."""
    source = (Path(__file__).parents[1] / "reaper" / "sql" / "queries.sql").read_text()
    sql = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("--"))
    assert sql.count("l.locktype = 'advisory'") == 1
    assert sql.count("pg_try_advisory_xact_lock(") == 1
    assert sql.count("pg_advisory_xact_lock(") == 1
    keys = re.findall(r"hashtextextended\('([a-z.-]+)', 0\)", sql)
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 5
    # the run lock's key, as the interface fixes it
    statements = load()
    assert "pg_try_advisory_xact_lock(hashtextextended('messenger.conference-room-reaper', 0))" in (
        statements["try_run_lock"].text
    )
    for name in ("try_run_lock", "wait_run_lock", "run_lock_holder", "try_relay_lock"):
        assert "{" not in statements[name].text, name
