"""How a test sees a phase's batch running, in pg_stat_activity."""

from __future__ import annotations

import re

# The server shows a statement's text as sent: a phase statement starts with its
# claim (the fragment claim in reaper/sql/queries.sql, its first CTE visible).
# tests/test_queries.py holds every phase statement to this pattern, so a change
# of their text fails there, in the fast layer, not in a fault test that never
# sees a batch.
BATCH_TEXT = "WITH%visible AS (%"
BATCH_RUNNING = f"state = 'active' AND query LIKE '{BATCH_TEXT}'"


def like(pattern: str, value: str) -> bool:
    """SQL's LIKE, for patterns with % only (as BATCH_TEXT)."""
    regex = ".*".join(re.escape(part) for part in pattern.split("%"))
    return re.fullmatch(regex, value, re.DOTALL) is not None
