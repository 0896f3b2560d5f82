"""A hand-given ``--as-of`` through the real CLI (docs/design.md#time).

Every verb that takes ``--as-of`` (``reaper plan``, ``reaper reap --once``)
refuses a bad one with one line on stderr and exit 2, before it changes or
even reads anything; a good one at either end of the range is used as given.
Which values are bad is the parser's (``reaper.clock.parse_as_of``), each
checked in process; the CLI is run with one of each kind of refusal.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from sqlalchemy import Engine

from reaper.clock import parse_as_of, rfc3339
from tests.support import factory as f
from tests.support.processes import run_cli

BAD = {
    "garbage": ("garbage", "is not a moment"),
    "empty": ("", "is empty"),
    "blank": ("   ", "is empty"),
    "month 13": ("2026-13-01T10:00:00Z", "is not a moment"),
    "30 February": ("2026-02-30T10:00:00Z", "is not a moment"),
    "year 10000": ("10000-01-01T00:00:00Z", "is not a moment"),
    "infinity": ("infinity", "is not a moment"),
    "two lines": ("2026-12-02\nT10:00:00Z", "is not a moment"),
    "before 1970": ("1969-12-31T23:59:59Z", "is out of range"),
    "year 1, before UTC": ("0001-01-01T00:00:00+01:00", "is out of range"),
    "year 9999": ("9999-01-01T00:00:00Z", "is out of range"),
    "year 10000 in UTC": ("9999-12-31T23:00:00-05:00", "is out of range"),
}
VERBS = {"plan": ("plan",), "reap --once": ("reap", "--once")}
# Through the real CLI, one case of each refusal and the value argv carries
# oddly (a newline); every case of BAD is the parser's, in process, below.
THROUGH_THE_CLI = ("garbage", "empty", "two lines", "year 10000 in UTC")


@pytest.mark.parametrize("case", BAD)
def test_a_bad_as_of_is_refused_by_the_parser_the_cli_runs(case: str):
    value, why = BAD[case]
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_as_of(value)


@pytest.fixture
def overdue(engine: Engine) -> str:
    """A room any cycle now would close: a refused --as-of must leave it open."""
    with engine.begin() as conn:
        return f.conference(conn, as_of=f.db_now(engine), idle=timedelta(hours=5))["id"]


@pytest.mark.process
@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("case", THROUGH_THE_CLI)
def test_a_bad_as_of_is_one_line_and_exit_2(engine: Engine, overdue: str, verb: str, case: str):
    value, why = BAD[case]
    done = run_cli(*VERBS[verb], "--as-of", value)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("reaper: --as-of: ") and why in lines[0], lines[0]
    assert "Traceback" not in done.stderr and done.stdout == ""
    with engine.connect() as conn:
        assert f.session_row(conn, overdue)["status"] == "Active"
        assert f.outbox(conn) == []


@pytest.mark.process
def test_an_as_of_in_the_databases_future_is_one_line_and_exit_2(engine: Engine, overdue: str):
    """In range, but later than the database's clock plus 5 s: refused by the cycle's head."""
    done = run_cli("reap", "--once", "--as-of", "9998-12-31T23:59:59Z")
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert "is later than the database's clock" in line and "Traceback" not in done.stderr
    with engine.connect() as conn:
        assert f.session_row(conn, overdue)["status"] == "Active"


@pytest.mark.process
def test_the_ends_of_the_range_are_taken_as_given(engine: Engine, overdue: str):
    """1970 for a cycle (nothing that old: nothing closed); the last second of 9998
    for a plan (it only reads, any moment); a moment without an offset is UTC."""
    early = run_cli("reap", "--once", "--json", "--as-of", "1970-01-01T00:00:00Z")
    assert early.returncode == 0, early.stderr
    result = json.loads(early.stdout)
    assert result["as_of"] == "1970-01-01T00:00:00Z" and result["skipped"] is False
    assert result["empty_timeout_count"] == result["stale_timeout_count"] == 0
    late = run_cli("plan", "--json", "--as-of", "9998-12-31T23:59:59Z")
    assert late.returncode == 0, late.stderr
    planned = json.loads(late.stdout)
    assert planned["as_of"] == "9998-12-31T23:59:59Z"
    assert [c["conference_id"] for c in planned["phases"]["empty_room"]["conferences"]] == [overdue]
    now = f.db_now(engine)
    naive = run_cli("plan", "--json", "--as-of", rfc3339(now).removesuffix("Z"))
    assert naive.returncode == 0, naive.stderr
    assert json.loads(naive.stdout)["as_of"] == rfc3339(now)
    with engine.connect() as conn:
        assert f.session_row(conn, overdue)["status"] == "Active"
