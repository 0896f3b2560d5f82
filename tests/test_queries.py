"""The named-query loader: one text per query, fragments written once."""

from __future__ import annotations

import ast
import inspect
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reaper import queries as queries_module
from reaper.config import Settings
from reaper.phases import bounds
from reaper.queries import load, parse

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
    queries = load()
    for name in ("end_active_batch", "fail_provisioning_batch"):
        sql = queries[name].text
        assert sql.count("fence AS (") == 1 and sql.count("roster_claimed AS (") == 1
        assert "-- include:" not in sql


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
    for name in ("end_active_batch", "fail_provisioning_batch"):
        sql = load()[name].text
        assert sql.count("\nvisible AS (") == 1 and sql.count("\nclaimed AS (") == 1
        assert sql.count("CAST(:stale_range AS timestamptz)") == 2
        assert sql.count("roster AS (") == 1 and sql.count("SELECT 'fenced'") == 1


BOUNDS = set(bounds(Settings(), datetime.now(UTC), {}))


def _runs_by_method() -> list[tuple[str, str, set[str]]]:
    """``(method of Queries, query name, keyword arguments bound)`` for each
    ``_run(self.conn, "name", key=...)`` call in the class."""
    tree = ast.parse(inspect.getsource(queries_module.Queries))
    runs = []
    for method in ast.walk(tree):
        if not isinstance(method, ast.FunctionDef):
            continue
        for call in ast.walk(method):
            if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "_run"):
                continue
            name = call.args[1]
            assert isinstance(name, ast.Constant), f"{method.name} names its query at run time"
            bound = {keyword.arg for keyword in call.keywords if keyword.arg is not None}
            for keyword in call.keywords:
                # ``**bounds``: every phase's cutoff and range end, as phases.bounds
                # names them; any other mapping would hide what the query binds
                if keyword.arg is None:
                    assert ast.unparse(keyword.value) == "bounds", f"{method.name} binds a mapping"
                    bound |= BOUNDS
            runs.append((method.name, name.value, bound))
    return runs


def test_every_named_query_has_one_method_that_binds_exactly_its_parameters() -> None:
    """The type checker holds the callers to Queries' signatures; this holds the
    methods to queries.sql: each runs a query that exists, binding the parameters
    its text names and no others, and every query is run by one method."""
    statements = load()
    runs = _runs_by_method()
    assert sorted(name for _, name, _ in runs) == sorted(statements)
    for method, name, bound in runs:
        expected = set(statements[name].compile().params)
        assert bound == expected, f"Queries.{method} binds {sorted(bound)} for {name}"
