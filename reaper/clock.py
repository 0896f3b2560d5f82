"""Time, written once: the moment now, RFC 3339 in and out, durations for people.

The reaper compares rows against the database's clock (a cycle's ``as_of`` is
read from PostgreSQL, see docs/design.md#time); the worker's own clock is used
only to measure how far it is off (``clock_skew_seconds``) and, monotonic, to
bound how long a phase runs in this process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

# A monotonic clock in seconds (time.monotonic); tests pass a thread-safe fake.
Monotonic = Callable[[], float]


def utcnow() -> datetime:
    """The worker's wall clock, aware, in UTC."""
    return datetime.now(UTC)


def monotonic() -> float:
    return time.monotonic()


def parse_time(value: str | datetime) -> datetime:
    """RFC 3339 (or an aware datetime) to an aware datetime; a naive value is taken as UTC."""
    parsed = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


# A hand-given as_of (``--as-of``) lies from 1970 to the end of 9998, in UTC. No
# conference is older than 1970, and near the ends of what a datetime holds the
# cut-offs (as_of minus a window) or the conversion to UTC would not fit.
AS_OF_EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
AS_OF_LATEST = datetime(9999, 1, 1, tzinfo=UTC)


def parse_as_of(value: str) -> datetime:
    """A hand-given as_of: RFC 3339 (without an offset it is UTC), in the range
    above; otherwise ValueError, whose message is one line saying why."""
    if not value.strip():
        raise ValueError("is empty: give a moment, RFC 3339 (e.g. 2026-12-02T10:00:00Z)")
    try:
        parsed = parse_time(value)
    except ValueError:
        raise ValueError(
            f"{value!r} is not a moment: RFC 3339 expected (e.g. 2026-12-02T10:00:00Z)"
        ) from None
    out_of_range = ValueError(
        f"{value!r} is out of range: from {rfc3339(AS_OF_EARLIEST)} "
        f"to before {rfc3339(AS_OF_LATEST)}"
    )
    try:
        in_utc = parsed.astimezone(UTC)
    except OverflowError:  # e.g. 9999-12-31T23:00:00-05:00 is in the year 10000 in UTC
        raise out_of_range from None
    if not AS_OF_EARLIEST <= in_utc < AS_OF_LATEST:
        raise out_of_range
    return parsed


def rfc3339(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def rfc3339_or_none(value: datetime | None) -> str | None:
    return None if value is None else rfc3339(value)


def human(seconds: float) -> str:
    """90 -> '1m30s', 14400 -> '4h' (two units at most)."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts[:2])
