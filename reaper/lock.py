"""Who holds the single-runner lock (docs/design.md#the-single-runner-lock).

The lock itself is taken by the run's phases (:mod:`reaper.runs`); this reads,
from ``pg_locks``, which backend holds it, without taking it.
"""

from __future__ import annotations

from sqlalchemy import Engine

from reaper.queries import Queries


def holder(engine: Engine) -> int | None:
    """The backend pid holding the lock, or None when it is free (read-only)."""
    with engine.connect() as conn:
        return Queries(conn).run_lock_holder()
