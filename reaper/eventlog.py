"""The facts as JSON log lines, each with a stable ``event`` name.

A subscriber of the engine's facts (:func:`subscribe`), connected at process
set-up by :mod:`reaper.wiring`. The names are part of the interface (dashboards
and alerts in the log pipeline use them; tests assert them): rename none.
Fields are ids, enums and counts, never names or tokens.

A fact declared with ``@logged`` (reaper/events.py) says its event, level and
fields itself, and :func:`writer` writes it; a function here is for a fact whose
line needs more than its fields: a name or level chosen by its values, a field
computed, renamed or constant, or a second line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import timedelta

from reaper.clock import rfc3339, rfc3339_or_none
from reaper.events import (
    LOGGED,
    BatchSelected,
    Bus,
    ControlPaused,
    ControlPolicySet,
    ControlPolicyUnset,
    CycleCompleted,
    CycleStarted,
    CycleTakenOver,
    Logged,
    PassLockLost,
    PhaseCompleted,
    PhaseFailed,
    PhaseMassClosure,
    RecorderPassCompleted,
    RelayBatchCommitted,
    RelayPassCompleted,
    RelayTopicMissing,
)
from reaper.logs import get_logger, log

logger = get_logger("cycle")
relay_logger = get_logger("relay")
recorder_logger = get_logger("recorder")

# A worker and its database further apart than this are worth a line (the
# comparisons use the database's clock; see docs/design.md#time).
SKEW_WORTH_LOGGING_S = 1.0

MASS_CLOSURE_HINT = (
    "presence outage? check heartbeats; to end them anyway run "
    "`reaper reap --once --allow-mass-closure`"
)


def subscribe(bus: Bus) -> None:
    for fact_type, declared in LOGGED.items():
        bus.subscribe(fact_type, writer(declared))
    bus.subscribe(CycleStarted, cycle_started)
    bus.subscribe(CycleTakenOver, cycle_taken_over)
    bus.subscribe(CycleCompleted, cycle_completed)
    bus.subscribe(BatchSelected, batch_selected)
    bus.subscribe(PhaseMassClosure, phase_mass_closure)
    bus.subscribe(PhaseCompleted, phase_completed)
    bus.subscribe(PhaseFailed, phase_failed)
    bus.subscribe(PassLockLost, pass_lock_lost)
    bus.subscribe(RelayBatchCommitted, relay_batch)
    bus.subscribe(RelayTopicMissing, relay_topic_missing)
    bus.subscribe(RelayPassCompleted, relay_pass)
    bus.subscribe(ControlPaused, paused)
    bus.subscribe(ControlPolicySet, policy_set)
    bus.subscribe(ControlPolicyUnset, policy_unset)
    bus.subscribe(RecorderPassCompleted, recorder_pass_completed)


def writer(declared: Logged) -> Callable[[object], None]:
    """The subscriber that logs a declared fact: its fields, as they are."""
    area = get_logger(declared.logger)  # once, not per line: a drain logs thousands

    def write(fact: object) -> None:
        fields = {name: getattr(fact, name) for name in declared.fields}
        log(area, declared.event, level=declared.level, **fields)

    write.__qualname__ = f"write[{declared.event}]"  # subscriber.failed names it
    return write


def cycle_started(fact: CycleStarted) -> None:
    log(logger, "cycle.started", run_id=fact.run_id, as_of=rfc3339(fact.as_of))
    if abs(fact.clock_skew_seconds) > SKEW_WORTH_LOGGING_S:
        log(
            logger,
            "clock.skew",
            level=logging.WARNING,
            run_id=fact.run_id,
            skew_seconds=round(fact.clock_skew_seconds, 3),
            database_clock=rfc3339(fact.started_at),
            reason="the worker's clock is off the database's; as_of is the database's",
        )


def cycle_taken_over(fact: CycleTakenOver) -> None:
    log(
        logger,
        "cycle.taken_over",
        level=logging.WARNING,
        run_id=fact.run_id,
        previous_run_id=fact.previous_run_id,
        lease_expired_at=rfc3339(fact.previous_lease_expired_at),
        reason="the previous cycle's owner gave no sign of life for REAPER_RUN_LEASE",
    )


def cycle_completed(fact: CycleCompleted) -> None:
    fields = {**fact.result, "errors": fact.errors}
    if fact.lost:
        fields["lost"] = True
    if fact.error is not None:
        fields["error"] = fact.error
    level = logging.ERROR if fact.error is not None or fact.lost else logging.INFO
    log(logger, "cycle.completed", level=level, **fields)


def batch_selected(fact: BatchSelected) -> None:
    log(
        logger,
        "batch.selected",
        run_id=fact.run_id,
        phase=fact.phase,
        count=fact.claimed,
        reaped=len(fact.reaped),
        failed=len(fact.poison),
        skipped_locked=fact.skipped_locked,
    )


def phase_mass_closure(fact: PhaseMassClosure) -> None:
    fields = {
        "run_id": fact.run_id,
        "phase": fact.phase,
        "eligible": fact.eligible,
        "active": fact.active,
        "share": fact.share,
        "floor": fact.floor,
    }
    if fact.allowed:
        log(logger, "phase.mass_closure_allowed", level=logging.WARNING, **fields)
    else:
        log(
            logger,
            "phase.mass_closure_blocked",
            level=logging.ERROR,
            **fields,
            hint=MASS_CLOSURE_HINT,
        )


def phase_completed(fact: PhaseCompleted) -> None:
    if fact.paused is not None:
        log(logger, "phase.paused", run_id=fact.run_id, phase=fact.phase, reason=fact.paused)
        return
    if fact.lost:
        log(
            logger,
            "phase.lost",
            level=logging.WARNING,
            run_id=fact.run_id,
            phase=fact.phase,
            reason="the run is no longer this cycle's (taken over after its lease expired)",
        )
        return
    log(
        logger,
        "phase.completed",
        run_id=fact.run_id,
        phase=fact.phase,
        batches=fact.batches,
        reaped=fact.reaped,
        skipped_locked=fact.skipped_locked,
        drained=fact.drained,
        blocked=fact.blocked,
    )


def phase_failed(fact: PhaseFailed) -> None:
    log(
        logger,
        "phase.failed",
        level=logging.ERROR,
        run_id=fact.run_id,
        phase=fact.phase,
        error=fact.error,
        reaped_before=fact.reaped,
    )


def relay_batch(fact: RelayBatchCommitted) -> None:
    if fact.published:
        log(relay_logger, "relay.published", count=fact.published, claimed=fact.claimed)
    if fact.failures:
        log(
            relay_logger,
            "relay.batch_failed",
            level=logging.WARNING,
            failed=fact.failures,
            claimed=fact.claimed,
            error=fact.error,
        )
    if fact.out_of_attempts:
        log(
            relay_logger,
            "relay.out_of_attempts",
            level=logging.ERROR,
            parked=fact.out_of_attempts,
            max_attempts=fact.max_attempts,
        )


def relay_topic_missing(fact: RelayTopicMissing) -> None:
    log(
        relay_logger,
        "relay.topic_missing",
        level=logging.ERROR,
        topic=fact.topic,
        reason=f"Kafka has no topic {fact.topic!r}; create it (the relay never does)",
    )


def pass_lock_lost(fact: PassLockLost) -> None:
    if fact.lock == "relay":
        log(relay_logger, "relay.lock_lost", level=logging.ERROR, error=fact.error)
    else:
        log(recorder_logger, "recorder.lock_lost", level=logging.ERROR, error=fact.error)


def relay_pass(fact: RelayPassCompleted) -> None:
    result = fact.result
    if result.skipped:
        log(relay_logger, "relay.skipped", reason="another relay pass is running")
        return
    if result.timed_out:
        # the batches in flight rolled back: their rows go again next pass
        log(relay_logger, "relay.time_limit", level=logging.WARNING, published=result.published)
    log(
        relay_logger,
        "relay.completed",
        published=result.published,
        failed=result.failed,
        parked=result.parked,
        held_back=result.held_back,
        pending=result.pending,
        oldest_pending_age_seconds=round(result.oldest_pending_age_seconds, 3),
        outbox_parked=result.outbox_parked,
        deleted=result.deleted,
        kafka_unavailable=result.kafka_unavailable,
        timed_out=result.timed_out,
        lock_lost=result.lock_lost,
        duration_ms=fact.duration_ms,
    )


control_logger = get_logger("control")


def paused(fact: ControlPaused) -> None:
    log(
        control_logger,
        "control.paused",
        level=logging.WARNING,
        phase=fact.phase,
        reason=fact.reason,
        paused_at=rfc3339(fact.paused_at),
        paused_until=rfc3339_or_none(fact.paused_until),
        paused_by=fact.paused_by,
    )


def _seconds(window: timedelta | None) -> float | None:
    return None if window is None else window.total_seconds()


def _windows(windows: Mapping[str, timedelta | None]) -> dict[str, float | None]:
    """A policy's windows as fields: ``<setting>_seconds`` for every phase."""
    return {f"{name}_seconds": _seconds(window) for name, window in windows.items()}


def policy_set(fact: ControlPolicySet) -> None:
    log(
        control_logger,
        "control.policy_set",
        level=logging.WARNING,
        tenant_id=fact.tenant_id,
        **_windows(fact.windows),
        updated_at=rfc3339(fact.updated_at),
        updated_by=fact.updated_by,
    )


def policy_unset(fact: ControlPolicyUnset) -> None:
    log(
        control_logger,
        "control.policy_unset",
        level=logging.WARNING,
        tenant_id=fact.tenant_id,
        **_windows(fact.windows),
        unset_by=fact.unset_by,
    )


def recorder_pass_completed(fact: RecorderPassCompleted) -> None:
    if fact.skipped:
        log(recorder_logger, "recorder.pass_skipped", reason="another stop pass is running")
        return
    # a pass that found nothing due is the common case: not worth a line at INFO
    level = logging.INFO if fact.requested or fact.unsent else logging.DEBUG
    log(
        recorder_logger,
        "recorder.pass_completed",
        level=level,
        requested=fact.requested,
        taken=fact.taken,
        failed=fact.failed,
        unsent=fact.unsent,
        duration_ms=fact.duration_ms,
    )
    if fact.retried:
        log(recorder_logger, "recorder.retried", due=fact.retried, taken=fact.retried_taken)
