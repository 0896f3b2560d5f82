"""How the suite runs: in several processes (scripts/test, pytest-xdist), with
the tests marked ``alone`` by themselves, and the figures the tests measure
listed at the end. A pytest plugin, loaded by tests/conftest.py.

Each process is a session of its own: its own database, broker key prefix,
Tansu and PgBouncer (tests/conftest.py), so tests in two processes do not see
each other's rows, locks, queues or records. A test marked ``alone`` still runs
with no other test beside it: it holds an exclusive lock that every other test
takes shared, through a turnstile, so that the other process's next tests do
not starve a waiting ``alone`` test. It is for what a test beside it would
change: a bound on the wall clock that a second test's load would stretch past
what the bound says of the service.

The processes take a file at a time, in the order of the collection, which
puts the files marked ``long`` (minutes each) first: a long file that came
last would run alone while the other process sat idle (pytest-xdist's own
order, most tests first, put the campaign's two tests at the very end).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import figures


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # a stable sort: the long files first, each file's tests in their order
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None:  # one process: nothing runs beside anything
        yield
        return
    run = Path(tempfile.gettempdir()) / f"reaper-test-{workerinput['testrunuid']}"
    turnstile = os.open(f"{run}.turnstile", os.O_RDWR | os.O_CREAT)
    tests = os.open(f"{run}.tests", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if item.get_closest_marker("alone"):
            fcntl.flock(tests, fcntl.LOCK_EX)  # holding the turnstile: no new test starts
        else:
            fcntl.flock(tests, fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    finally:
        os.close(tests)  # closing releases the locks
        os.close(turnstile)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":  # a parallel run carries user_properties back
        report.user_properties.extend(("figures", line) for line in figures.taken())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = [
        (report.nodeid, value)
        for reports in terminalreporter.stats.values()
        for report in reports
        if isinstance(report, pytest.TestReport) and report.when == "call"
        for name, value in report.user_properties
        if name == "figures"
    ]
    if lines:
        terminalreporter.section("figures")
        for nodeid, line in sorted(lines):
            terminalreporter.write_line(f"{nodeid}: {line}")
