"""This release with a phase more, or a phase less: how another release's phases
look to this one's workers (docs/design.md#releases-and-the-schema).

A worker of a variant is this release's code with ``reaper.phases`` changed
before anything else reads it: its directory's ``sitecustomize.py`` (first on
PYTHONPATH) calls :func:`more` or :func:`less` at the interpreter's start, so
every ``from reaper.phases import ORDER`` of that process sees the variant.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

# The phase a newer release would add: an Active room nobody ever joined, ended
# a window after it started (REAPER_POLLING_INTERVAL stands in for its window
# here, a field of Settings this release has). Its name is one no real phase
# would have, so a real phase added to reaper/phases.py never collides with it.
EXTRA = "test_only_phase"
EXTRA_SELECTS = (
    f"\n-- fragment: {EXTRA}_selects\n"
    "s.status = 'Active' AND s.active_participant_count = 0 AND s.peak_participant_count = 0\n"
)
# The phase a release without it would not know.
DROPPED = "stale_live"
VARIANTS = Path(__file__).with_name("variants")


def _install(phases: tuple[object, ...]) -> None:
    from reaper import phases as module

    module.IN_ORDER = phases  # type: ignore[assignment]
    module.PHASES = {p.name: p for p in module.IN_ORDER}
    module.ORDER = tuple(module.PHASES)


def more() -> None:
    """This release's phases and EXTRA after them; its predicate written into a
    copy of sql/queries.sql that the loader reads instead."""
    from reaper import phases, queries

    written = Path(tempfile.mkdtemp(prefix="reaper-variant-")) / "queries.sql"
    written.write_text(queries.QUERIES_FILE.read_text() + EXTRA_SELECTS)
    queries.QUERIES_FILE = written
    queries.source.cache_clear()
    extra = replace(
        phases.EMPTY_ROOM,
        name=EXTRA,
        since="started_at",
        label=EXTRA,
        count_key="empty_timeout_count",
        setting="polling_interval",
        reason="nobody joined in {age} (window {window})",
    )
    _install((*phases.IN_ORDER, extra))


def less() -> None:
    """This release's phases without DROPPED."""
    from reaper import phases

    _install(tuple(p for p in phases.IN_ORDER if p.name != DROPPED))


def pythonpath(variant: str, root: Path) -> str:
    """PYTHONPATH of a variant's process: its sitecustomize first, then the tree."""
    return f"{VARIANTS / variant}:{root}"
