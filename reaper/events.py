"""The seam after the commit: facts the engine emits, and the bus that delivers them.

The engine (:mod:`reaper.cycle`, :mod:`reaper.relay`) says what happened, as
plain frozen facts, once the database has committed it: a conference reaped, a
batch selected, a phase completed, a cycle completed, a relay pass completed.
Each fact is named after the log event it becomes (``BatchSelected`` ->
``batch.selected``), and its fields are keywords. A fact whose line is its
fields as they are declares that line where it is defined (:func:`logged`). Logs, Prometheus,
OpenTelemetry and the database gauges are subscribers, connected in one place
when a process sets itself up (:mod:`reaper.wiring`). The engine imports none
of them; a test subscribes a recorder of facts.

A subscriber runs in the thread that emits (for batches: the drain's teller
thread, never a lane) and must be thread-safe. One that raises is logged
(``subscriber.failed``) and the others still run: what happens after a
commit can never undo it, nor stop the engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, TypedDict, TypeVar

from reaper.errors import describe
from reaper.logs import get_logger, log

logger = get_logger("events")

F = TypeVar("F")
Handler = Callable[[Any], None]


class Bus:
    """Facts by type to the handlers subscribed to that type, in subscription order."""

    def __init__(self) -> None:
        self._handlers: dict[type, tuple[Handler, ...]] = {}
        self._lock = threading.Lock()

    def subscribe(self, fact_type: type[F], handler: Callable[[F], None]) -> None:
        with self._lock:  # copy on write: emit() reads without the lock
            self._handlers[fact_type] = (*self._handlers.get(fact_type, ()), handler)

    def unsubscribe(self, fact_type: type[F], handler: Callable[[F], None]) -> None:
        with self._lock:
            self._handlers[fact_type] = tuple(
                h for h in self._handlers.get(fact_type, ()) if h != handler
            )

    def wants(self, fact_type: type) -> bool:
        return bool(self._handlers.get(fact_type))

    def emit(self, fact: object) -> None:
        for handler in self._handlers.get(type(fact), ()):
            try:
                handler(fact)
            except Exception as exc:
                log(
                    logger,
                    "subscriber.failed",
                    level=logging.ERROR,
                    fact=type(fact).__name__,
                    subscriber=getattr(handler, "__qualname__", repr(handler)),
                    error=describe(exc),
                )

    def emit_each(self, facts: Iterable[object], fact_type: type) -> None:
        """Emit every fact of ``facts`` (all of ``fact_type``), only if anyone listens."""
        if self.wants(fact_type):
            for fact in facts:
                self.emit(fact)


@dataclass(frozen=True, slots=True)
class Logged:
    """How a fact is logged when its line is its fields as they are: the event
    name, the level, the logger's area (``reaper.<logger>``) and the fact's
    attributes that make the line's fields, in the line's order."""

    event: str
    level: int
    fields: tuple[str, ...]
    logger: str


# Every fact declared with @logged, by type: reaper.eventlog writes each one, and
# tests/test_docs.py holds docs/design.md#log-events to them.
LOGGED: dict[type, Logged] = {}


def logged(
    event: str, level: int = logging.INFO, *, fields: tuple[str, ...], logger: str
) -> Callable[[type[F]], type[F]]:
    """Declare with a fact how it is logged (:class:`Logged`). A fact whose line
    needs more than its fields (a name or level chosen by its values, a field
    computed or renamed) is not declared: reaper.eventlog has a function for it."""

    def declare(fact_type: type[F]) -> type[F]:
        for name in fields:
            if not hasattr(fact_type, name):
                raise TypeError(f"{fact_type.__name__} has no field {name!r} to log")
        LOGGED[fact_type] = Logged(event, level, fields, logger)
        return fact_type

    return declare


# The bus of this process: the worker and the CLI connect its subscribers at
# set-up (reaper.wiring.install); the engine emits to it unless given another.
process_bus = Bus()


# -- the results of the tasks (docs/design.md#tasks) ------------------------------
#
# Celery returns them as they are (JSON objects); the keys are an interface
# (Flower, cycle.completed, `reaper reap --once`), so they are typed here once
# and every reader is checked against them.

# A count of a cycle's result: one per phase (its Phase.count_key), the rows a
# command held (SKIP LOCKED) and the poison rows.
PhaseCountKey = Literal["empty_timeout_count", "provision_failed_count", "stale_timeout_count"]
CountKey = Literal[PhaseCountKey, "skipped_locked_count", "failed_count"]


class Counts(TypedDict):
    """The counts of a cycle, or of one phase of it (reaper.runs.counts builds them)."""

    empty_timeout_count: int
    provision_failed_count: int
    stale_timeout_count: int
    skipped_locked_count: int
    failed_count: int  # poison rows: the result's name for them (docs/design.md#names)


class CycleResult(Counts):
    """The result of ``reaper.reap`` (and of ``reaper.reap_phase`` by hand), and the
    fields of cycle.completed (reaper.runs.cycle_result builds it)."""

    run_id: str
    as_of: str  # RFC 3339
    skipped: bool
    duration_ms: int
    paused: list[str]


class PhaseResult(Counts):
    """The result of ``reaper.reap_phase`` in a cycle's chain: that phase's counts
    (reaper.cycle.phase_result builds it)."""

    run_id: str
    as_of: str | None  # None: the run was no longer the cycle's
    skipped: bool
    paused: list[str]


class RelayTaskResult(TypedDict):
    """The result of ``reaper.relay_outbox`` and of ``reaper relay --once``."""

    published: int
    failed: int
    parked: int
    pending: int


# -- a cycle -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CycleStarted:
    run_id: str
    as_of: datetime
    started_at: datetime  # the database's clock
    # the worker's clock minus the database's, measured at the start
    clock_skew_seconds: float


@logged("cycle.skipped", fields=("run_id", "reason", "holder_pid", "owner_run_id"), logger="cycle")
@dataclass(frozen=True, slots=True, kw_only=True)
class CycleSkipped:
    """Another cycle owns the run: this one changed nothing."""

    run_id: str
    as_of: datetime | None = None
    reason: str
    holder_pid: int | None = None
    owner_run_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CycleTakenOver:
    """The run's owner died or hung past its lease: this cycle took the run over."""

    run_id: str
    previous_run_id: str
    previous_lease_expired_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class CycleCompleted:
    run_id: str
    result: CycleResult  # the task's result (docs/design.md#tasks)
    errors: int = 0
    started_at: datetime
    finished_at: datetime
    blocked: tuple[str, ...] = ()
    lost: bool = False  # the run was taken over before it finished
    error: str | None = None  # the database failed the cycle's head or end


# -- a phase -------------------------------------------------------------------


@logged(
    "conference.reaped",
    fields=(
        "run_id",
        "phase",
        "conference_id",
        "chat_id",
        "deal_id",
        "status",
        "end_reason",
        "duration_seconds",
    ),
    logger="cycle",
)
@dataclass(frozen=True, slots=True, kw_only=True)
class ConferenceReaped:
    run_id: str
    phase: str
    conference_id: str
    chat_id: str
    deal_id: str
    tenant_id: str | None
    status: str
    end_reason: str
    duration_seconds: int | None = None
    # ended_at minus the moment the room became eligible (the SLO's measure)
    lateness_seconds: float | None = None


@logged(
    "item.failed",
    logging.ERROR,
    fields=("run_id", "phase", "conference_id", "error"),
    logger="cycle",
)
@dataclass(frozen=True, slots=True, kw_only=True)
class ItemFailed:
    """A poison row (docs/design.md#names): the database refuses it, so it is left
    out of its batch (the rest committed) and of the cycle."""

    run_id: str
    phase: str
    conference_id: str
    error: str  # what the database said


@logged(
    "conference.anomaly",
    logging.WARNING,
    fields=("run_id", "phase", "conference_id", "problem", "duration_seconds"),
    logger="cycle",
)
@dataclass(frozen=True, slots=True, kw_only=True)
class ConferenceAnomaly:
    """A room closed although its started_at could give no duration (it is null)."""

    run_id: str
    phase: str
    conference_id: str
    problem: str

    @property
    def duration_seconds(self) -> None:
        """Null in its line, as in conference.reaped's of such a room: no duration."""
        return None


@dataclass(frozen=True)
class StopRequest:
    """A running recording of a reaped room, due to the recorder stop task
    (:mod:`reaper.recorder` sends it; the engine only reports it)."""

    recording_id: str
    conference_id: str
    reason: str
    attempts: int = 0  # signals sent before that the recorder did not take


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchSelected:
    """A batch committed: what it claimed, and what became of those rooms."""

    run_id: str
    phase: str
    label: str  # the phase's value of the outcome label of items_total
    claimed: int = 0
    reaped: tuple[ConferenceReaped, ...] = ()
    poison: tuple[ItemFailed, ...] = ()
    # rows a command held (SKIP LOCKED) as this batch saw them
    skipped_locked: int = 0
    # the running recordings of the reaped rooms, now due to the stop task (the
    # state is in the database; nothing here sends them)
    stops: tuple[StopRequest, ...] = ()
    started_ns: int  # wall clock, for spans
    ended_ns: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseMassClosure:
    """stale_live would end too many live rooms at once (see cycle.Reaper)."""

    run_id: str
    phase: str
    eligible: int
    active: int
    share: float
    floor: int
    allowed: bool  # the operator's one-run override


@logged("phase.unknown", logging.WARNING, fields=("run_id", "phase", "known"), logger="cycle")
@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseUnknown:
    """A cycle's chain named a phase this release does not know (a newer
    release's, during a rolling deploy): this worker went on with the chain
    without it, and the run records it (reaper_runs.unknown_phases). Told once
    per phase by each process."""

    run_id: str
    phase: str
    known: tuple[str, ...]  # the phases this release knows, in their order


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseCompleted:
    run_id: str
    phase: str
    batches: int = 0
    reaped: int = 0
    poison: int = 0
    skipped_locked: int = 0
    drained: bool = False
    started_ns: int  # wall clock, for spans
    ended_ns: int
    blocked: bool = False  # the mass-closure guard stopped it
    lost: bool = False  # the run was no longer this cycle's: nothing done
    paused: str | None = None  # an operator's pause left it alone: why


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseFailed:
    run_id: str
    phase: str
    error: str
    started_ns: int
    ended_ns: int
    reaped: int = 0  # batches committed before the failure


@logged("lock.lost", logging.ERROR, fields=("run_id", "phase", "error"), logger="cycle")
@dataclass(frozen=True, slots=True, kw_only=True)
class LockLost:
    """The phase's lock session was gone at its release: the server or the network
    ended it (a frozen or partitioned owner, a hung one past REAPER_LOCK_TTL)."""

    run_id: str
    phase: str
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PassLockLost:
    """A relay pass or a stop pass lost its lock midway (reaper/lease.py): the
    server or the network ended its lock session (a frozen or cut-off holder, a
    hung one past its give-up bound). Its later claims and marks were fenced
    off; another pass sends what it left."""

    lock: str  # "relay" or "stop"
    error: str


# -- after the commit ------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StopSignalsSent:
    requested: int = 0
    taken: int = 0

    @property
    def failed(self) -> int:
        return self.requested - self.taken


@dataclass(frozen=True, slots=True, kw_only=True)
class RecorderPassCompleted:
    """A stop-signal pass (reaper/recorder.py) ended: what it sent and what is left."""

    requested: int = 0  # signals sent
    taken: int = 0  # of which the recorder took
    unsent: int = 0  # claimed, not started before the pass's deadline: due again at once
    retried: int = 0  # signals sent that had been sent before
    retried_taken: int = 0
    skipped: bool = False  # another pass was running
    lock_lost: bool = False  # the stop lock was lost midway: its marks were fenced off
    duration_ms: int = 0

    @property
    def failed(self) -> int:
        return self.requested - self.taken


@dataclass(frozen=True, slots=True, kw_only=True)
class GaugesMeasured:
    """What the database says now: the census behind active_backlog, the rooms
    whose activity is ahead of the clock, the outbox, the last completed run."""

    active_backlog: int = 0
    outbox_pending: int = 0
    outbox_oldest_pending_age_seconds: float = 0.0
    outbox_parked: int = 0
    outbox_discarded: int = 0  # rows of messenger.outbox_discards (migration 0013)
    paused: tuple[str, ...] = ()  # the phases paused now
    # when a run last completed, whichever replica ran it (None: never)
    last_run_completed_at: datetime | None = None
    # Active rooms whose last_activity_at is ahead of the database's clock: held
    # (docs/design.md#anomalies)
    activity_ahead: int = 0


# -- the operator ---------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPaused:
    phase: str
    reason: str
    paused_at: datetime
    paused_until: datetime | None = None
    paused_by: str


@logged(
    "control.resumed",
    logging.WARNING,
    fields=("phase", "reason", "resumed_by"),
    logger="control",
)
@dataclass(frozen=True, slots=True, kw_only=True)
class ControlResumed:
    phase: str
    reason: str  # of the pause that ended
    resumed_by: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPolicySet:
    """A tenant's windows as stored after ``reaper policy set``: every phase's, by
    the Settings field of its default (``empty_room_grace``, ...; None: the default)."""

    tenant_id: str
    windows: Mapping[str, timedelta | None]
    updated_at: datetime
    updated_by: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPolicyUnset:
    """A tenant's policy removed: its conferences get the defaults again."""

    tenant_id: str
    windows: Mapping[str, timedelta | None]  # the windows it had, as ControlPolicySet's
    unset_by: str


@logged(
    "outbox.requeued",
    logging.WARNING,
    fields=("count", "event_id", "requeued_by"),
    logger="control",
)
@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxRequeued:
    count: int = 0
    event_id: str | None = None  # None: all parked rows
    requeued_by: str


# WARNING: an event its consumers will never get, by an operator's decision
@logged(
    "outbox.discarded",
    logging.WARNING,
    fields=("event_id", "message_key", "topic", "reason", "discarded_by", "discarded_login"),
    logger="control",
)
@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxDiscarded:
    """A parked row taken out of delivery for good, kept in messenger.outbox_discards:
    its deal's later events go on without it."""

    event_id: str
    message_key: str  # the deal
    topic: str
    reason: str
    discarded_by: str  # REAPER_OPERATOR, else the OS user
    discarded_login: str  # the database login that ran it


# -- the relay --------------------------------------------------------------------


@dataclass
class RelayResult:
    """A relay pass's totals: what the pass adds up (reaper.relay) and emits, as it is,
    in :class:`RelayPassCompleted` (nothing changes it after that); its JSON is the
    task's result."""

    published: int = 0
    failed: int = 0  # will be tried again, after a back-off
    parked: int = 0  # refused for good, or out of attempts, in this pass
    held_back: int = 0
    pending: int = 0  # the outbox after the pass
    oldest_pending_age_seconds: float = 0.0
    outbox_parked: int = 0
    # what a snapshot held elsewhere does to the outbox (migration 0012)
    outbox_dead_rows: int = 0
    oldest_snapshot_age_seconds: float | None = 0.0  # None: unknown
    deleted: int = 0
    kafka_unavailable: bool = False
    database_failed: bool = False
    skipped: bool = False  # another relay's pass was running
    timed_out: bool = False  # Celery's soft time limit ended it
    lock_lost: bool = False  # the relay lock was lost midway: the rest was fenced off

    def to_json(self) -> RelayTaskResult:
        """The task's result and ``reaper relay --once``'s (docs/design.md#tasks)."""
        return {
            "published": self.published,
            "failed": self.failed,
            "parked": self.parked,
            "pending": self.pending,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayBatchCommitted:
    claimed: int
    published: int
    failed: int
    parked: int
    # of the failures charged an attempt: the first one's error (None: none failed)
    error: str | None = None
    failures: int = 0
    out_of_attempts: int = 0  # of the parked, parked for having no attempt left
    max_attempts: int = 0


@logged(
    "relay.kafka_unavailable",
    logging.ERROR,
    fields=("bootstrap_servers", "cause", "error", "rows"),
    logger="relay",
)
@dataclass(frozen=True, slots=True, kw_only=True)
class RelayKafkaUnavailable:
    """A batch found Kafka unreachable: its rows not yet sent are backed off uncharged."""

    bootstrap_servers: str
    error: str
    rows: int
    # unreachable, tls (a certificate refused) or authentication (a SASL login
    # refused): reaper.kafka.diagnose
    cause: str = "unreachable"


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayTopicMissing:
    """The brokers answer but know no partition of the topic (the relay never creates one)."""

    topic: str


@logged("relay.db_failed", logging.ERROR, fields=("error",), logger="relay")
@dataclass(frozen=True, slots=True, kw_only=True)
class RelayDbFailed:
    error: str


@logged("relay.close_failed", logging.ERROR, fields=("error",), logger="relay")
@dataclass(frozen=True, slots=True, kw_only=True)
class RelayCloseFailed:
    """Awaiting and marking a batch failed other than by the database."""

    error: str


@logged("relay.retention_deleted", fields=("count", "cutoff"), logger="relay")
@dataclass(frozen=True, slots=True, kw_only=True)
class RelayRetentionDeleted:
    count: int
    cutoff: datetime  # this process's view; the database compares by its own clock


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayPassCompleted:
    result: RelayResult
    duration_ms: int
