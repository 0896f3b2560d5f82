"""The result keys of the tasks, as docs/design.md#tasks lists them: what callers of
``celery call`` and ``reaper reap --once --json`` rely on."""

from reaper.phases import IN_ORDER

# docs/design.md#tasks, "Result keys of a cycle": these, and one count per phase
# (its Phase.count_key), so a new phase adds its key here by being a phase.
CYCLE_RESULT_KEYS = {
    "run_id",
    "as_of",
    "skipped",
    "skipped_locked_count",
    "failed_count",
    "duration_ms",
    "paused",
} | {phase.count_key for phase in IN_ORDER}
RELAY_RESULT_KEYS = {"published", "failed", "parked", "pending"}
