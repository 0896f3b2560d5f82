"""One reap cycle: the three phases in order under the single-runner lock.

:class:`Reaper` is the whole engine and knows nothing of Celery: the CLI runs a
cycle in-process with :meth:`Reaper.run_cycle`, the Celery tasks run
:meth:`Reaper.start`, :meth:`Reaper.run_phase` (one task per phase) and
:meth:`Reaper.finish`, carrying :class:`Cycle` between them as JSON.
"""

from __future__ import annotations

import contextvars
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from reaper import metrics, tracing
from reaper.config import Settings
from reaper.db import engine_for
from reaper.lock import millis, run_lock
from reaper.logs import get_logger, log
from reaper.overview import refresh_gauges
from reaper.phases import ORDER, PHASES, STALE_LIVE, BatchOutcome, Phase, reap_batch
from reaper.queries import Queries
from reaper.recorder import RecorderClient

logger = get_logger("cycle")

# Guards what the lanes of one phase share: the cycle's excluded list, the clock.
_SHARED = threading.Lock()


def _copy(items: list[str]) -> list[str]:
    with _SHARED:
        return list(items)


class _Drain:
    """What the lanes of one phase share: batches, rows others held locked, stop."""

    def __init__(self, lanes: int) -> None:
        self.halt = threading.Event()
        # set once the first lane saw a full batch (full) or ended (not full)
        self.decided = threading.Event()
        self.full = False
        self.drained = False
        self.batches = 0
        self._lock = threading.Lock()
        self._locked: set[str] = set()
        # Rows a sibling lane had claimed look "locked" to this lane's batch; the
        # sibling's outcome arrives within a batch or two of it: recent outcomes
        # are enough to tell them apart (and memory stays bounded).
        self._recent: deque[frozenset[str]] = deque(maxlen=4 * lanes)

    def add(self, outcome: BatchOutcome) -> None:
        taken = frozenset(
            [r.conference_id for r in outcome.reaped] + [p.conference_id for p in outcome.poison]
        )
        with self._lock:
            self.batches += 1
            self._locked -= taken
            self._recent.append(taken)
            for room in outcome.locked:
                if not any(room in batch for batch in self._recent):
                    self._locked.add(room)

    @property
    def locked(self) -> set[str]:
        with self._lock:
            return set(self._locked)


COUNT_KEYS = (
    "empty_timeout_count",
    "provision_failed_count",
    "stale_timeout_count",
    "skipped_locked_count",
    "failed_count",
)
RESULT_KEYS = ("run_id", "as_of", "skipped", *COUNT_KEYS, "duration_ms")

Clock = Callable[[], datetime]


def utcnow() -> datetime:
    return datetime.now(UTC)


def parse_time(value: str | datetime) -> datetime:
    """RFC 3339 to an aware datetime; a naive value is taken as UTC."""
    parsed = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def rfc3339(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class Cycle:
    """A cycle's identity and running totals, carried from phase to phase."""

    run_id: str
    as_of: datetime
    started_at: datetime
    deadline: datetime
    skipped: bool = False
    errors: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNT_KEYS, 0))
    # Poison rows are left out for the rest of the cycle, in every phase.
    excluded: list[str] = field(default_factory=list)
    # Phases the mass-closure guard stopped in this cycle.
    blocked: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("as_of", "started_at", "deadline"):
            data[key] = rfc3339(data[key])
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cycle:
        values = dict(data)
        for key in ("as_of", "started_at", "deadline"):
            values[key] = parse_time(values[key])
        return cls(**values)

    def result(self, now: datetime) -> dict[str, Any]:
        """The contract's result: exactly RESULT_KEYS."""
        duration = max(0, round((now - self.started_at).total_seconds() * 1000))
        return {
            "run_id": self.run_id,
            "as_of": rfc3339(self.as_of),
            "skipped": self.skipped,
            **self.counts,
            "duration_ms": duration,
        }


class Reaper:
    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine | None = None,
        recorder: RecorderClient | None = None,
        clock: Clock = utcnow,
        stop_event: threading.Event | None = None,
        allow_mass_closure: bool = False,
    ) -> None:
        self.settings = settings
        # The operator's one-run override of the mass-closure guard.
        self.allow_mass_closure = allow_mass_closure
        self.engine = engine or engine_for(settings.database_url)
        if recorder is None and settings.recorder_url:
            recorder = RecorderClient(settings.recorder_url, settings.recorder_timeout)
        self.recorder = recorder
        self.clock = clock
        self.stop_event = stop_event or threading.Event()

    # -- the cycle ---------------------------------------------------------

    def start(self, as_of: datetime | str | None = None, run_id: str | None = None) -> Cycle:
        now = self.clock()
        cycle = Cycle(
            run_id=run_id or str(uuid.uuid4()),
            as_of=parse_time(as_of) if as_of else now,
            started_at=now,
            deadline=now + self.settings.max_run_duration,
        )
        log(logger, "cycle.started", run_id=cycle.run_id, as_of=rfc3339(cycle.as_of))
        return cycle

    def lock_holder(self) -> int | None:
        """Try the lock for an instant: the holder's pid, or None when free."""
        with run_lock(self.engine, self.settings.lock_ttl) as holder:
            return holder

    def skip(self, cycle: Cycle, holder: int | None, phase: str | None = None) -> Cycle:
        cycle.skipped = True
        log(
            logger,
            "cycle.skipped",
            run_id=cycle.run_id,
            phase=phase,
            reason="the single-runner lock is held by another session",
            holder_pid=holder,
        )
        return cycle

    def finish(self, cycle: Cycle) -> dict[str, Any]:
        result = cycle.result(self.clock())
        log(logger, "cycle.completed", **result, errors=cycle.errors)
        metrics.cycle_finished(
            skipped=cycle.skipped,
            failed=cycle.errors > 0,
            duration_seconds=result["duration_ms"] / 1000,
        )
        tracing.cycle_span(cycle, result, self.clock())
        refresh_gauges(self.engine, self.settings, self.clock())  # active_backlog, outbox
        return result

    def run_cycle(
        self, as_of: datetime | str | None = None, run_id: str | None = None
    ) -> dict[str, Any]:
        """A whole cycle in this process (``reaper reap --once``)."""
        cycle = self.start(as_of, run_id)
        for name in ORDER:
            self.run_phase(name, cycle)
        return self.finish(cycle)

    # -- one phase ---------------------------------------------------------

    @tracing.phase_span
    def run_phase(self, name: str, cycle: Cycle) -> Cycle:
        """Batches of one phase until one comes back short or the cycle's time is spent.

        A phase always runs at least one batch, so a large backlog in one phase
        never starves the next. A database failure rolls back the batch in
        flight and ends the phase; the next cycle retries.
        """
        phase = PHASES[name]
        try:
            with run_lock(self.engine, self.settings.lock_ttl) as holder:
                if holder is not None:
                    return self.skip(cycle, holder, phase.name)
                if phase is STALE_LIVE and self._mass_closure_blocked(phase, cycle):
                    return cycle
                self._drain(phase, cycle)
        except SQLAlchemyError as exc:
            cycle.errors += 1
            metrics.errors()
            log(
                logger,
                "phase.failed",
                level=40,
                run_id=cycle.run_id,
                phase=phase.name,
                error=type(exc).__name__,
                detail=str(getattr(exc, "orig", exc)).strip().splitlines()[0][:300],
            )
        return cycle

    def _mass_closure_blocked(self, phase: Phase, cycle: Cycle) -> bool:
        """True when this phase would end too many live rooms at once (then it ends none).

        When presence heartbeats stop arriving, every live room looks stale: that
        is an outage of the presence pipeline, not of the rooms. Above the floor,
        ending more than the configured share of the Active conferences in one
        cycle is refused until an operator allows it for one run.
        """
        with self.engine.begin() as conn:
            queries = Queries(conn)
            queries.bound_transaction(
                idle_ms=millis(self.settings.lock_ttl),
                statement_ms=millis(self.settings.max_run_duration),
            )
            eligible, active = queries.stale_live_census(
                as_of=cycle.as_of,
                cutoff=phase.cutoff(self.settings, cycle.as_of),
                excluded=cycle.excluded,
            )
        share, floor = self.settings.mass_closure_share, self.settings.mass_closure_floor
        if eligible <= floor or eligible <= share * active:
            return False
        fields = {
            "run_id": cycle.run_id,
            "phase": phase.name,
            "eligible": eligible,
            "active": active,
            "share": share,
            "floor": floor,
        }
        if self.allow_mass_closure:
            log(logger, "phase.mass_closure_allowed", level=30, **fields)
            return False
        cycle.blocked.append(phase.name)
        metrics.mass_closure_blocked()
        log(
            logger,
            "phase.mass_closure_blocked",
            level=40,
            **fields,
            hint="presence outage? check heartbeats; to end them anyway run "
            "`reaper reap --once --allow-mass-closure`",
        )
        return True

    def _drain(self, phase: Phase, cycle: Cycle) -> None:
        """Batches on ``drain_lanes`` connections side by side until one comes back short.

        bench/ showed a drain on one connection taking turns with itself: the
        batch statement, then the Python of its report, then the next. Lanes
        claim disjoint batches (SKIP LOCKED, oldest first) so PostgreSQL works
        on more than one core, and a committed batch is told (counts, metrics,
        spans, log lines) on one helper thread while the next batches run.
        """
        lanes = self.settings.drain_lanes
        drain = _Drain(lanes)
        with (
            ThreadPoolExecutor(lanes, thread_name_prefix="reaper-lane") as pool,
            ThreadPoolExecutor(1, thread_name_prefix="reaper-tell") as teller,
        ):

            def lane() -> Future[None]:
                return pool.submit(
                    contextvars.copy_context().run, self._lane, phase, cycle, drain, teller
                )

            running = [lane()]
            try:
                # The other lanes only after a full first batch: a quiet phase is
                # one statement, as before.
                drain.decided.wait()
                if drain.full and not drain.halt.is_set():
                    running += [lane() for _ in range(lanes - 1)]
                wait(running)
            except BaseException:  # a soft time limit: every lane ends its batch, then stop
                drain.halt.set()
                wait(running)
                raise
            for finished in running:
                finished.result()  # a lane's database error ends the phase (run_phase)
        locked = drain.locked
        cycle.counts["skipped_locked_count"] += len(locked)
        metrics.skipped_locked(len(locked))
        log(
            logger,
            "phase.completed",
            run_id=cycle.run_id,
            phase=phase.name,
            batches=drain.batches,
            reaped=cycle.counts[phase.count_key],
            skipped_locked=len(locked),
            drained=drain.drained,
        )

    def _lane(self, phase: Phase, cycle: Cycle, drain: _Drain, teller: Executor) -> None:
        told: Future[None] | None = None
        try:
            while not drain.halt.is_set():
                start_ns = time.time_ns()
                outcome = self._batch(phase, cycle)
                end_ns = time.time_ns()
                drain.add(outcome)
                if told is not None:
                    told.result()  # one report per lane in flight: memory stays flat
                told = teller.submit(
                    contextvars.copy_context().run,
                    self._tell,
                    phase,
                    cycle,
                    outcome,
                    start_ns,
                    end_ns,
                )
                self._after_commit(outcome)
                if outcome.claimed < self.settings.batch_size:
                    drain.drained = True
                    break
                drain.full = True
                drain.decided.set()
                with _SHARED:  # the clock may be a test's plain iterator
                    spent = self.clock() >= cycle.deadline
                if spent or self.stop_event.is_set():
                    break
        except BaseException:
            drain.halt.set()  # the other lanes end their batch in flight and stop
            raise
        finally:
            drain.decided.set()
            if told is not None:
                told.result()

    def _batch(self, phase: Phase, cycle: Cycle) -> BatchOutcome:
        with self.engine.begin() as conn:
            queries = Queries(conn)
            queries.bound_transaction(
                idle_ms=millis(self.settings.lock_ttl),
                statement_ms=millis(self.settings.max_run_duration),
            )
            outcome = reap_batch(
                queries,
                phase,
                self.settings,
                as_of=cycle.as_of,
                run_id=cycle.run_id,
                excluded=_copy(cycle.excluded),
            )
            # Before the commit: a lane whose batch starts after it must leave them
            # out. Two lanes may both have claimed one (between a claim and
            # this line): it is counted and told once.
            with _SHARED:
                fresh = [p for p in outcome.poison if p.conference_id not in cycle.excluded]
                cycle.excluded.extend(p.conference_id for p in fresh)
            outcome.poison = fresh
        return outcome

    def _tell(
        self, phase: Phase, cycle: Cycle, outcome: BatchOutcome, start_ns: int, end_ns: int
    ) -> None:
        """Counts, metrics, spans and log lines of a committed batch (see _drain)."""
        cycle.counts[phase.count_key] += len(outcome.reaped)
        cycle.counts["failed_count"] += len(outcome.poison)
        metrics.items_closed(
            phase.name, phase.outcome, [item.lateness_seconds for item in outcome.reaped]
        )
        metrics.errors(len(outcome.poison))
        tracing.conference_spans(phase, cycle, outcome, start_ns, end_ns)
        log(
            logger,
            "batch.selected",
            run_id=cycle.run_id,
            phase=phase.name,
            count=outcome.claimed,
            reaped=len(outcome.reaped),
            failed=len(outcome.poison),
            skipped_locked=len(outcome.locked),
        )
        for item in outcome.reaped:
            log(
                logger,
                "conference.reaped",
                run_id=cycle.run_id,
                phase=phase.name,
                conference_id=item.conference_id,
                chat_id=item.chat_id,
                deal_id=item.deal_id,
                status=phase.status,
                end_reason=phase.end_reason,
                duration_seconds=item.duration_seconds,
            )
        for item in outcome.poison:
            log(
                logger,
                "item.failed",
                level=40,
                run_id=cycle.run_id,
                phase=phase.name,
                conference_id=item.conference_id,
                error=item.reason,
            )

    def _after_commit(self, outcome: BatchOutcome) -> None:
        if not outcome.stops or self.recorder is None:
            return
        done = self.recorder.stop_all(outcome.stops)
        if done:
            try:
                with self.engine.begin() as conn:
                    Queries(conn).mark_stop_requested(
                        [stop.recording_id for stop in done], self.clock()
                    )
            except SQLAlchemyError as exc:  # best effort: the signal itself went out
                log(logger, "recorder.mark_failed", level=30, error=type(exc).__name__)
