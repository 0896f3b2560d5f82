"""Prometheus metrics (docs/design.md#metrics): the families and the subscriber
that counts the engine's facts into them.

A subscriber of the engine's facts (:func:`subscribe`). Every metric lives in a
private registry, so no other process that happens to load the app (``celery
flower`` serves its own default registry) ever shows or serves them. How the
prefork pool's processes count together is reaper/multiproc.py; the HTTP
endpoint that serves them, reaper/endpoint.py.
"""

from __future__ import annotations

import math
import threading
import time
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, write_to_textfile

from reaper.events import (
    BatchSelected,
    Bus,
    CycleCompleted,
    CycleStarted,
    GaugesMeasured,
    LockLost,
    PassLockLost,
    PhaseCompleted,
    PhaseFailed,
    PhaseMassClosure,
    RelayBatchCommitted,
    RelayKafkaUnavailable,
    RelayPassCompleted,
    StopSignalsSent,
)
from reaper.kafka import UnavailableCause
from reaper.ledger import CATEGORIES, Verdict
from reaper.phases import ORDER, PHASES

RUN_RESULTS = ("completed", "skipped", "failed")
# docs/design.md#metrics: closed conferences only. A run the mass-closure guard stopped
# closed nothing: it has its own counter (mass_closure_blocked_total).
ITEM_OUTCOMES = tuple(phase.label for phase in PHASES.values())
PHASE_NAMES = ORDER
KAFKA_UNAVAILABLE_CAUSES = get_args(UnavailableCause)

# The names a dashboard or alert may use (the test of ops/ checks against it).
EXPORTED = (
    "messenger_conf_reaper_run_total",
    "messenger_conf_reaper_cycle_duration_seconds",
    "messenger_conf_reaper_items_total",
    "messenger_conf_reaper_active_backlog",
    "messenger_conf_reaper_activity_ahead",
    "messenger_conf_reaper_skip_locked_total",
    "messenger_conf_reaper_errors_total",
    "messenger_conf_reaper_closing_lateness_seconds",
    "messenger_conf_reaper_mass_closure_blocked_total",
    "messenger_conf_reaper_recorder_stop_failed_total",
    "messenger_outbox_relay_published_total",
    "messenger_outbox_relay_kafka_unavailable_total",
    "messenger_outbox_pending",
    "messenger_outbox_oldest_pending_age_seconds",
    "messenger_outbox_parked",
    "messenger_outbox_discarded",
    "messenger_outbox_dead_rows",
    "messenger_outbox_oldest_snapshot_age_seconds",
    "messenger_conf_reaper_paused",
    "messenger_conf_reaper_clock_skew_seconds",
    "messenger_conf_reaper_last_cycle_timestamp_seconds",
    "messenger_outbox_last_relay_timestamp_seconds",
    "messenger_conf_reaper_last_run_completed_timestamp_seconds",
)

# What `reaper reconcile --metrics-file` writes (docs/delivery.md#metrics): not
# this registry's, as the command is a run of its own, not the worker.
RECONCILE_EXPORTED = (
    "messenger_conf_reaper_reconcile_findings",
    "messenger_conf_reaper_reconcile_lost",
    "messenger_conf_reaper_reconcile_closings",
    "messenger_conf_reaper_reconcile_until_timestamp_seconds",
)

# A cycle's target is < 5 s, its budget REAPER_MAX_RUN_DURATION (30 s).
CYCLE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
# The SLO: closed within one polling interval (30 s) of becoming eligible.
LATENESS_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600, 1800, 3600)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.run_total = Counter(
            "messenger_conf_reaper_run_total",
            "Reap cycles by result (completed, skipped: lock held elsewhere, failed).",
            ["result"],
            registry=r,
        )
        self.cycle_duration = Histogram(
            "messenger_conf_reaper_cycle_duration_seconds",
            "Wall time of a reap cycle that ran (skipped cycles are not observed).",
            buckets=CYCLE_BUCKETS,
            registry=r,
        )
        self.items = Counter(
            "messenger_conf_reaper_items_total",
            "Conferences closed, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.backlog = Gauge(
            "messenger_conf_reaper_active_backlog",
            "Active or Provisioning conferences already past their phase's window.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.activity_ahead = Gauge(
            "messenger_conf_reaper_activity_ahead",
            "Active conferences whose last_activity_at is later than the database's clock"
            " (infinity included): held, never closed until an operator decides.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.skip_locked = Counter(
            "messenger_conf_reaper_skip_locked_total",
            "Eligible conferences left for the next cycle because a command held their row.",
            registry=r,
        )
        self.errors = Counter(
            "messenger_conf_reaper_errors_total",
            "Failed phases (database errors), poison conferences the database refused,"
            " and run locks lost mid-phase.",
            registry=r,
        )
        self.lateness = Histogram(
            "messenger_conf_reaper_closing_lateness_seconds",
            "ended_at minus the moment the conference became eligible, per phase.",
            ["phase"],
            buckets=LATENESS_BUCKETS,
            registry=r,
        )
        self.mass_closure_blocked = Counter(
            "messenger_conf_reaper_mass_closure_blocked_total",
            "stale_live runs the mass-closure guard stopped (they closed nothing).",
            registry=r,
        )
        self.recorder_stop_failed = Counter(
            "messenger_conf_reaper_recorder_stop_failed_total",
            "Recording stop signals the recorder did not take (error, timeout, refused).",
            registry=r,
        )
        self.relay_published = Counter(
            "messenger_outbox_relay_published_total",
            "integration_outbox rows published to Kafka.",
            registry=r,
        )
        self.relay_kafka_unavailable = Counter(
            "messenger_outbox_relay_kafka_unavailable_total",
            "Relay batches that found no Kafka broker to take them, by cause: "
            "unreachable, tls (a certificate refused), authentication (a SASL login refused).",
            ["cause"],
            registry=r,
        )
        self.outbox_pending = Gauge(
            "messenger_outbox_pending",
            "integration_outbox rows not yet published.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.outbox_oldest = Gauge(
            "messenger_outbox_oldest_pending_age_seconds",
            "Age of the oldest unpublished integration_outbox row (0 when none).",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.outbox_parked = Gauge(
            "messenger_outbox_parked",
            "integration_outbox rows parked: refused by Kafka for good, or out of attempts.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.outbox_discarded = Gauge(
            "messenger_outbox_discarded",
            "integration_outbox rows an operator discarded (reaper outbox discard): kept in "
            "messenger.outbox_discards, never sent.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.outbox_dead_rows = Gauge(
            "messenger_outbox_dead_rows",
            "Dead row versions in integration_outbox (pg_stat_user_tables.n_dead_tup).",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.oldest_snapshot_age = Gauge(
            "messenger_outbox_oldest_snapshot_age_seconds",
            "Age of the oldest transaction of the database holding a snapshot, which keeps "
            "the outbox's dead rows (0 when none; NaN when the database may not say).",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.paused = Gauge(
            "messenger_conf_reaper_paused",
            "1 while an operator's pause keeps the phase from changing anything.",
            ["phase"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.clock_skew = Gauge(
            "messenger_conf_reaper_clock_skew_seconds",
            "The worker's clock minus the database's, measured at the start of each cycle.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        # The health check reads these two (/healthz): when this worker last
        # finished a piece of a cycle and a relay pass. A cycle's pieces (its
        # tick, three phases, its last link) land on whichever replica takes
        # them from the shared queue, so a cycle's end alone would leave a
        # healthy replica without one for intervals at a time, by chance.
        self.last_cycle = Gauge(
            "messenger_conf_reaper_last_cycle_timestamp_seconds",
            "Unix time this worker last finished a piece of a reap cycle: a phase,"
            " a cycle's end, or a tick skipped for another runner.",
            multiprocess_mode="max",
            registry=r,
        )
        self.last_relay = Gauge(
            "messenger_outbox_last_relay_timestamp_seconds",
            "Unix time a relay pass of this worker last ran.",
            multiprocess_mode="max",
            registry=r,
        )
        # Closings, whoever runs them: the alert ConferenceReaperNotClosing reads
        # it, so a lock held by a session that is not the reaper shows although
        # every tick of every worker is skipped.
        self.last_run_completed = Gauge(
            "messenger_conf_reaper_last_run_completed_timestamp_seconds",
            "Unix time (the database's clock) a reap run last completed, by any worker;"
            " 0 until one has.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        # Series exist (at 0) from the start: an alert on increase() needs them.
        for result in RUN_RESULTS:
            self.run_total.labels(result=result)
        for outcome in ITEM_OUTCOMES:
            self.items.labels(outcome=outcome)
        for phase in PHASE_NAMES:
            self.lateness.labels(phase=phase)
            self.paused.labels(phase=phase)
        for cause in KAFKA_UNAVAILABLE_CAUSES:
            self.relay_kafka_unavailable.labels(cause=cause)


_lock = threading.Lock()
_metrics: _Metrics | None = None


def _m() -> _Metrics:
    global _metrics
    if _metrics is None:
        with _lock:
            if _metrics is None:
                _metrics = _Metrics()
    return _metrics


def created() -> bool:
    """Whether this process's metrics exist (multiprocess mode must come before)."""
    return _metrics is not None


# -- the subscriber: facts to series ------------------------------------------


def subscribe(bus: Bus) -> None:
    """Count what the engine tells (reaper.wiring connects it at process set-up)."""
    bus.subscribe(CycleStarted, _cycle_started)
    bus.subscribe(CycleCompleted, _cycle_finished)
    bus.subscribe(BatchSelected, _batch_selected)
    bus.subscribe(PhaseCompleted, _phase_completed)
    bus.subscribe(PhaseFailed, _phase_failed)
    bus.subscribe(LockLost, _lock_lost)
    bus.subscribe(PassLockLost, _pass_lock_lost)
    bus.subscribe(PhaseMassClosure, _mass_closure)
    bus.subscribe(StopSignalsSent, _stop_signals)
    bus.subscribe(GaugesMeasured, _gauges)
    bus.subscribe(RelayBatchCommitted, _relay_batch)
    bus.subscribe(RelayPassCompleted, _relay_pass)
    bus.subscribe(RelayKafkaUnavailable, _relay_kafka_unavailable)


def _cycle_started(fact: CycleStarted) -> None:
    _m().clock_skew.set(fact.clock_skew_seconds)


def _cycle_finished(fact: CycleCompleted) -> None:
    m = _m()
    skipped = bool(fact.result.get("skipped"))
    result = "skipped" if skipped else "failed" if fact.errors > 0 else "completed"
    m.run_total.labels(result=result).inc()
    if fact.error is not None:
        m.errors.inc()
    if not skipped:
        m.cycle_duration.observe(fact.result.get("duration_ms", 0) / 1000)
    if result != "failed":
        m.last_cycle.set(time.time())


def _batch_selected(fact: BatchSelected) -> None:
    m = _m()
    if fact.reaped:
        histogram = m.lateness.labels(phase=fact.phase)  # once per batch, not per room
        for item in fact.reaped:
            if item.lateness_seconds is not None:
                histogram.observe(max(0.0, item.lateness_seconds))
        m.items.labels(outcome=fact.label).inc(len(fact.reaped))
    if fact.poison:
        m.errors.inc(len(fact.poison))


def _phase_completed(fact: PhaseCompleted) -> None:
    m = _m()
    if fact.skipped_locked > 0:
        m.skip_locked.inc(fact.skipped_locked)
    m.last_cycle.set(time.time())  # this worker's pool does the cycles' work


def _phase_failed(fact: PhaseFailed) -> None:
    _m().errors.inc()


def _lock_lost(fact: LockLost) -> None:
    # Its own error, also when it made the phase fail (counted there too): a lock
    # lost after the phase's last batch fails nothing and would go uncounted.
    _m().errors.inc()


def _pass_lock_lost(fact: PassLockLost) -> None:
    # A relay or stop pass that lost its lock midway: a frozen or cut-off worker.
    _m().errors.inc()


def _mass_closure(fact: PhaseMassClosure) -> None:
    if not fact.allowed:
        _m().mass_closure_blocked.inc()


def _stop_signals(fact: StopSignalsSent) -> None:
    if fact.failed > 0:
        _m().recorder_stop_failed.inc(fact.failed)


def _gauges(fact: GaugesMeasured) -> None:
    m = _m()
    m.backlog.set(fact.active_backlog)
    m.activity_ahead.set(fact.activity_ahead)
    for phase in PHASE_NAMES:
        m.paused.labels(phase=phase).set(1 if phase in fact.paused else 0)
    _set_outbox(m, fact.outbox_pending, fact.outbox_oldest_pending_age_seconds, fact.outbox_parked)
    m.outbox_discarded.set(fact.outbox_discarded)
    if fact.last_run_completed_at is not None:
        m.last_run_completed.set(fact.last_run_completed_at.timestamp())


def _relay_batch(fact: RelayBatchCommitted) -> None:
    if fact.published > 0:
        _m().relay_published.inc(fact.published)


def _relay_kafka_unavailable(fact: RelayKafkaUnavailable) -> None:
    _m().relay_kafka_unavailable.labels(cause=fact.cause).inc()


def _relay_pass(fact: RelayPassCompleted) -> None:
    result = fact.result
    _set_outbox(_m(), result.pending, result.oldest_pending_age_seconds, result.outbox_parked)
    _m().outbox_dead_rows.set(result.outbox_dead_rows)
    age = result.oldest_snapshot_age_seconds
    _m().oldest_snapshot_age.set(math.nan if age is None else max(0.0, age))
    if not result.skipped:
        _m().last_relay.set(time.time())


def _set_outbox(m: _Metrics, pending: int, oldest_age_seconds: float, parked: int) -> None:
    m.outbox_pending.set(pending)
    m.outbox_oldest.set(max(0.0, oldest_age_seconds))
    m.outbox_parked.set(parked)


# -- reading -----------------------------------------------------------------


def registry() -> CollectorRegistry:
    """This process's own registry (in-process use and tests)."""
    return _m().registry


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of this process's registry (0 when absent)."""
    return _m().registry.get_sample_value(name, labels or {}) or 0.0


# -- reaper reconcile ----------------------------------------------------------


def write_reconcile(path: str, verdict: Verdict) -> None:
    """The verdict of one `reaper reconcile` as a Prometheus text file, for a
    collector that reads such files (node_exporter's textfile directory): the
    command exits, so nothing could scrape it. Every category and every
    phase's end reason is written, zeros included, so an alert on a lost event
    reads a series that exists. The file is replaced whole (written beside it,
    then renamed): a scrape never reads half of it."""
    r = CollectorRegistry()
    findings = Gauge(
        "messenger_conf_reaper_reconcile_findings",
        "What the last reaper reconcile found, by category (lost, unexpected, ...).",
        ["category"],
        registry=r,
    )
    for category in CATEGORIES:
        findings.labels(category).set(len(getattr(verdict, category)))
    lost = Gauge(
        "messenger_conf_reaper_reconcile_lost",
        "Rooms closed whose conference-ended event is neither in the outbox nor on "
        "Kafka, by end reason, in the last reaper reconcile's window.",
        ["end_reason"],
        registry=r,
    )
    reasons = {phase.end_reason for phase in PHASES.values()} | set(verdict.by_end_reason)
    for reason in sorted(reasons):
        counts = verdict.by_end_reason.get(reason)
        lost.labels(reason).set(counts["lost"] if counts is not None else 0)
    Gauge(
        "messenger_conf_reaper_reconcile_closings",
        "Rooms closed in the last reaper reconcile's window.",
        registry=r,
    ).set(verdict.closings)
    Gauge(
        "messenger_conf_reaper_reconcile_until_timestamp_seconds",
        "The end of the last reaper reconcile's window (the database's clock): "
        "closings before it have been checked.",
        registry=r,
    ).set(verdict.until.timestamp())
    write_to_textfile(path, r)
