"""The figures a test measures (a time, a rate, a count), said at the end of the
run: pytest's summary lists them under "figures", test by test.

A test's own output is not shown when it passes, and not at all from the
processes of a parallel run (pytest-xdist); the summary is. tests/conftest.py
moves the figures recorded during a test onto its report, which the parallel
run carries back to the main process."""

from __future__ import annotations

_recorded: list[str] = []


def figure(line: str) -> None:
    """Record one line of figures for the test running now."""
    _recorded.append(" ".join(line.split()))


def taken() -> list[str]:
    """The lines recorded since the last call, now taken off."""
    lines = list(_recorded)
    _recorded.clear()
    return lines
