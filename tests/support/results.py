"""The result keys of the tasks, as docs/design.md#tasks lists them: what callers of
``celery call`` and ``reaper reap --once --json`` rely on."""

# docs/design.md#tasks, "Result keys of a cycle"
CYCLE_RESULT_KEYS = {
    "run_id",
    "as_of",
    "skipped",
    "empty_timeout_count",
    "provision_failed_count",
    "stale_timeout_count",
    "skipped_locked_count",
    "failed_count",
    "duration_ms",
    "paused",
}
RELAY_RESULT_KEYS = {"published", "failed", "parked", "pending"}
