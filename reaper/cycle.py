"""One reap cycle: the three phases in order, the cycle owning the run throughout.

:class:`Reaper` is the policy, and knows nothing of Celery, logs, metrics or
traces. A cycle is :meth:`Reaper.start` (take the run, or be skipped),
:meth:`Reaper.run_phase` for each phase, :meth:`Reaper.finish`. The Celery
tasks call these three, each phase in a task of its own; ``reaper reap
--once`` calls :meth:`Reaper.run_cycle`, which calls the very same three.

What happened is told as facts (:mod:`reaper.events`) once committed. A
phase's batches are :class:`PhaseBatches` (one batch, a refused batch in parts,
the report of a committed one), run on lanes by :mod:`reaper.drain`; the run's
ownership is :mod:`reaper.runs`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from reaper import budgets
from reaper.clock import Monotonic, monotonic, parse_time, rfc3339, utcnow
from reaper.config import Settings
from reaper.db import Session, engine_of, session, transaction
from reaper.drain import Drained, SkippedLocked, drain
from reaper.errors import describe, sqlstate
from reaper.events import (
    BatchSelected,
    Bus,
    ConferenceReaped,
    CycleCompleted,
    CycleResult,
    CycleSkipped,
    CycleStarted,
    CycleTakenOver,
    ItemFailed,
    LockLost,
    PhaseCompleted,
    PhaseFailed,
    PhaseMassClosure,
    PhaseResult,
    PhaseUnknown,
    process_bus,
)
from reaper.phases import (
    ORDER,
    PHASES,
    BatchEffect,
    Phase,
    Shortest,
    candidates,
    cutoffs,
    mass_closure,
    reap_batch,
    tenant_windows,
)
from reaper.runs import Run, RunLost, Runs, Start, counts, unowned_result


@dataclass(frozen=True)
class Cycle:
    """A cycle's head: the run it took, or why it does not own the run."""

    run_id: str
    start: Start | None  # None: the head could not reach the database
    failed: str | None = None

    @property
    def owns_run(self) -> bool:
        return self.start is not None and self.start.skipped is None


class Reaper:
    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine | None = None,
        bus: Bus | None = None,
        clock: Monotonic = monotonic,
        stop_event: threading.Event | None = None,
        allow_mass_closure: bool = False,
    ) -> None:
        self.settings = settings
        self.engine = engine or engine_of(settings)
        self.bus = bus or process_bus
        self.runs = Runs(self.engine, settings)
        # Bounds a phase in this process; tests pass a thread-safe fake.
        self.clock = clock
        # Asked to stop (SIGTERM, a warm shutdown): end after the batches in flight.
        self.stop_event = stop_event or threading.Event()
        # The operator's one-run override of the mass-closure guard.
        self.allow_mass_closure = allow_mass_closure
        # the unknown phases this process has told (PhaseUnknown): each once
        self._unknown_told: set[str] = set()

    # -- a cycle -----------------------------------------------------------

    def run_cycle(
        self,
        as_of: datetime | str | None = None,
        run_id: str | None = None,
        phases: Iterable[str] = ORDER,
    ) -> CycleResult:
        """A whole cycle in this process: what the Celery tasks run, one after the other."""
        cycle = self.start(as_of, run_id)
        if not cycle.owns_run:
            return self.end_unowned(cycle)
        for name in phases:
            self.run_phase(name, cycle.run_id)
        return self.finish(cycle.run_id)

    def start(self, as_of: datetime | str | None = None, run_id: str | None = None) -> Cycle:
        """Take the run for a new cycle whose ``as_of`` is the database's clock, or the
        given moment unless it is in the database's future (raises runs.AsOfRefused)."""
        run_id = run_id or str(uuid.uuid4())
        given = parse_time(as_of) if as_of else None
        try:
            start = self.runs.take(run_id, given)
        except SQLAlchemyError as exc:
            return Cycle(run_id, None, failed=describe(exc))
        self.bus.emit(
            CycleStarted(
                run_id=start.run_id,
                as_of=start.as_of,
                started_at=start.started_at,
                clock_skew_seconds=start.clock_skew_seconds,
            )
        )
        if start.taken_over is not None and start.taken_over_lease is not None:
            self.bus.emit(
                CycleTakenOver(
                    run_id=start.run_id,
                    previous_run_id=start.taken_over,
                    previous_lease_expired_at=start.taken_over_lease,
                )
            )
        return Cycle(run_id, start)

    def end_unowned(self, cycle: Cycle) -> CycleResult:
        """The result of a cycle that does not own the run: skipped (another cycle
        owns it) or failed (no database). Either way nothing changed."""
        start = cycle.start
        if start is None:
            return self._failed(cycle.run_id, cycle.failed or "")
        self.bus.emit(
            CycleSkipped(
                run_id=start.run_id,
                as_of=start.as_of,
                reason=start.skipped or "",
                holder_pid=start.holder_pid,
                owner_run_id=start.owner_run_id,
            )
        )
        result = unowned_result(start.run_id, start.as_of, skipped=True)
        self.bus.emit(
            CycleCompleted(
                run_id=start.run_id,
                result=result,
                started_at=start.started_at,
                finished_at=start.started_at,
            )
        )
        return result

    def finish(self, run_id: str) -> CycleResult:
        """Close the run and report the cycle's totals."""
        try:
            finished = self.runs.finish(run_id)
        except SQLAlchemyError as exc:  # the run stays open: taken over after its lease
            return self._failed(run_id, describe(exc))
        if finished is None:  # no such run: as a run taken over, this cycle's end is lost
            now = utcnow()
            result = unowned_result(run_id, now, skipped=False)
            self.bus.emit(
                CycleCompleted(
                    run_id=run_id,
                    result=result,
                    errors=1,
                    started_at=now,
                    finished_at=now,
                    lost=True,
                )
            )
            return result
        result = finished.result()
        self.bus.emit(
            CycleCompleted(
                run_id=run_id,
                result=result,
                errors=finished.errors,
                started_at=finished.started_at,
                finished_at=finished.finished_at or finished.started_at,
                blocked=tuple(finished.blocked),
                lost=finished.lost,
            )
        )
        return result

    def _failed(self, run_id: str, error: str) -> CycleResult:
        """A cycle the database failed at its head or its end: reported, counted."""
        now = utcnow()
        result = unowned_result(run_id, now, skipped=False)
        self.bus.emit(
            CycleCompleted(
                run_id=run_id, result=result, errors=1, started_at=now, finished_at=now, error=error
            )
        )
        return result

    # -- one phase -----------------------------------------------------------

    def run_phase(self, name: str, run_id: str) -> PhaseResult:
        """One phase of the run's cycle: lock, own the run, guard, drain, report.

        A phase always runs at least one batch, so a backlog in one phase never
        starves the next. Any error ends the phase (the batch in flight rolls
        back, those committed stay) and is counted; the cycle goes on.
        Returns the phase's own share of the cycle's result. A phase this release
        does not know (a newer release's, its chain reaching this worker during
        a rolling deploy) is left out: the run records it and the chain goes on.
        """
        if name not in PHASES:
            return self._unknown_phase(name, run_id)
        phase = PHASES[name]
        started_ns = time.time_ns()
        try:
            claim = self.runs.claim(run_id, phase.name)
        except Exception as exc:  # the database is gone, or the lock is held elsewhere
            self.runs.count_error(run_id)
            error = describe(exc)
            self.bus.emit(
                PhaseFailed(
                    run_id=run_id,
                    phase=phase.name,
                    error=error,
                    started_ns=started_ns,
                    ended_ns=time.time_ns(),
                )
            )
            return phase_result(run_id, None, {}, {})
        if claim is None:  # taken over (or ended): this cycle no longer owns the run
            self.bus.emit(
                PhaseCompleted(
                    run_id=run_id,
                    phase=phase.name,
                    started_ns=started_ns,
                    ended_ns=time.time_ns(),
                    lost=True,
                )
            )
            return phase_result(run_id, None, {}, {})
        run = claim.run
        before = dict(run.counts)
        fact: PhaseCompleted | PhaseFailed
        try:
            if claim.paused is not None:  # an operator's pause: change nothing
                run.paused.append(phase.name)
                fact = PhaseCompleted(
                    run_id=run_id,
                    phase=phase.name,
                    started_ns=started_ns,
                    ended_ns=time.time_ns(),
                    paused=claim.paused,
                )
            elif phase.guarded and self._mass_closure_blocked(phase, run):
                run.blocked.append(phase.name)
                fact = PhaseCompleted(
                    run_id=run_id,
                    phase=phase.name,
                    started_ns=started_ns,
                    ended_ns=time.time_ns(),
                    blocked=True,
                )
            else:
                fact = self._drain(phase, run, started_ns)
        except Exception as exc:
            run.errors += 1
            fact = PhaseFailed(
                run_id=run_id,
                phase=phase.name,
                error=describe(exc),
                started_ns=started_ns,
                ended_ns=time.time_ns(),
                reaped=run.counts[phase.count_key] - before[phase.count_key],
            )
        # Celery's soft time limit is an Exception: the phase fails as above. Only
        # an interrupt or SystemExit gets here: free the lock now, not a lease later.
        except BaseException:
            claim.release()
            raise
        lost = claim.release()
        if lost is not None:
            self.bus.emit(LockLost(run_id=run_id, phase=phase.name, error=lost))
        self.bus.emit(fact)
        return phase_result(
            run_id, run, before, run.counts, [phase.name] if claim.paused is not None else []
        )

    def _unknown_phase(self, name: str, run_id: str) -> PhaseResult:
        """Nothing done for a phase this release does not know; told once per
        process, recorded in the run (best effort: the database may be gone,
        and the chain goes on either way)."""
        with contextlib.suppress(SQLAlchemyError):
            self.runs.record_unknown(run_id, name)
        if name not in self._unknown_told:
            self._unknown_told.add(name)
            self.bus.emit(PhaseUnknown(run_id=run_id, phase=name, known=ORDER))
        return phase_result(run_id, None, {}, {})

    def _mass_closure_blocked(self, phase: Phase, run: Run) -> bool:
        """True when this phase would end too many live rooms at once (then it ends none).

        When presence heartbeats stop arriving, every live room looks stale: that
        is an outage of the presence pipeline, not of the rooms. Above the floor,
        ending more than the configured share of the Active conferences in one
        cycle is refused until an operator allows it for one run.
        """
        settings = self.settings
        with transaction(self.engine, budgets.batch(self.settings)) as queries:
            queries.census_planner()
            eligible = queries.guard_eligible(
                phase=phase,
                as_of=run.as_of,
                bounds=cutoffs(self.settings, run.as_of),
                excluded=run.excluded_now(),
            )
            # Counting every live room costs what the live rooms cost: only when it can matter.
            active = queries.active_count() if eligible > settings.mass_closure_floor else 0
        if not mass_closure(eligible, active, settings):
            return False
        self.bus.emit(
            PhaseMassClosure(
                run_id=run.run_id,
                phase=phase.name,
                eligible=eligible,
                active=active,
                share=settings.mass_closure_share,
                floor=settings.mass_closure_floor,
                allowed=self.allow_mass_closure,
            )
        )
        return not self.allow_mass_closure

    def _drain(self, phase: Phase, run: Run, started_ns: int) -> PhaseCompleted:
        """The phase's batches on ``REAPER_DRAIN_LANES`` lanes until the work runs out."""
        settings = self.settings
        # The shortest tenant windows bound every batch's index range: read once
        # per phase, as its pause is (a window made shorter meanwhile applies from
        # the next phase; a longer one at once: each row's own window is read by
        # the batch statement itself). docs/design.md#windows-per-tenant
        with transaction(self.engine, budgets.batch(settings)) as queries:
            shortest = tenant_windows(queries)
        batches = PhaseBatches(settings, self.bus, phase, run, shortest)
        drained: Drained = drain(
            batches.batch,
            batches.report,
            session=lambda: session(self.engine, budgets.batch(settings)),
            full=lambda done: done.effect.full(settings.batch_size),
            lanes=settings.drain_lanes,
            deadline=self.clock() + run.remaining.total_seconds(),
            clock=self.clock,
            stop=self.stop_event,
        )
        skipped_locked = len(batches.locked)
        run.counts["skipped_locked_count"] += skipped_locked
        return PhaseCompleted(
            run_id=run.run_id,
            phase=phase.name,
            batches=drained.batches,
            reaped=batches.reaped,
            poison=batches.poison,
            skipped_locked=skipped_locked,
            drained=drained.drained,
            started_ns=started_ns,
            ended_ns=time.time_ns(),
        )


@dataclass(frozen=True, slots=True)
class Done:
    """A committed batch, as a lane hands it to the report."""

    effect: BatchEffect
    began_ns: int
    ended_ns: int


class PhaseBatches:
    """One phase's batches in one cycle: what a lane runs (:meth:`batch`, on its
    own session) and what the teller thread reports once committed (:meth:`report`).
    """

    def __init__(
        self, settings: Settings, bus: Bus, phase: Phase, run: Run, shortest: Shortest
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.phase = phase
        self.run = run
        self.shortest = shortest
        self.locked = SkippedLocked(settings.drain_lanes)
        # rooms a command holds a roster row of: left out for the rest of the phase
        self._held: set[str] = set()
        self._held_lock = threading.Lock()
        self.reaped = 0  # counted by report() alone (one thread)
        self.poison = 0

    def batch(self, lane: Session) -> Done:
        """The next batch; a batch the database refuses is retried in parts."""
        began = time.time_ns()
        try:
            effect = self._batch(lane)
        except DBAPIError as exc:
            if not is_poison_error(exc):
                raise
            with lane.transaction() as queries:
                ids = candidates(
                    queries,
                    self.phase,
                    self.settings,
                    as_of=self.run.as_of,
                    excluded=self._excluded(),
                    shortest=self.shortest,
                )
            effect = self._retry(lane, ids)
            effect.candidates = len(ids)
        self.locked.add(
            [r.conference_id for r in effect.reaped] + [r.conference_id for r in effect.poison],
            effect.locked + effect.held,
        )
        return Done(effect, began, time.time_ns())

    def _excluded(self) -> list[str]:
        """Rooms no batch of this phase claims: the cycle's poison, and the rooms a
        command held a roster row of (a later cycle closes them)."""
        with self._held_lock:
            return self.run.excluded_now() + list(self._held)

    def report(self, done: Done) -> None:
        """Count a committed batch and tell it (the teller thread only)."""
        effect, run, phase = done.effect, self.run, self.phase
        self.reaped += len(effect.reaped)
        self.poison += len(effect.poison)
        run.counts[phase.count_key] += len(effect.reaped)
        run.counts["failed_count"] += len(effect.poison)  # the result's name for poison rows
        self.bus.emit(
            BatchSelected(
                run_id=run.run_id,
                phase=phase.name,
                label=phase.label,
                claimed=len(effect.reaped) + len(effect.poison),
                reaped=tuple(effect.reaped),
                poison=tuple(effect.poison),
                skipped_locked=len(effect.locked) + len(effect.held),
                stops=tuple(effect.stops),
                started_ns=done.began_ns,
                ended_ns=done.ended_ns,
            )
        )
        self.bus.emit_each(effect.reaped, ConferenceReaped)
        self.bus.emit_each(effect.poison, ItemFailed)
        for anomaly in effect.anomalies:
            self.bus.emit(anomaly)

    def _batch(self, lane: Session, only: list[str] | None = None) -> BatchEffect:
        """One batch, one transaction; poison rows are left out for the rest of the cycle."""
        run = self.run
        with lane.transaction() as queries:
            effect = reap_batch(
                queries,
                self.phase,
                self.settings,
                as_of=run.as_of,
                run_id=run.run_id,
                holder_pid=run.holder_pid,
                excluded=self._excluded(),
                only=only,
                shortest=self.shortest,
            )
            if effect.fenced:  # changed nothing: no lane of this phase may go on
                raise RunLost(
                    f"run {run.run_id} is fenced off: its lock session (backend "
                    f"{run.holder_pid}) is gone or another cycle took the run over"
                )
            # Before the commit: a lane whose batch starts after it leaves them out.
            with self._held_lock:
                self._held.update(effect.held)
            fresh = set(run.exclude([r.conference_id for r in effect.poison]))
            effect.poison = [r for r in effect.poison if r.conference_id in fresh]
        return effect

    def _retry(self, lane: Session, ids: list[str]) -> BatchEffect:
        """These rows again, in a transaction of their own; refused, in halves.

        The rows read after a refused batch need not be the rows it refused: a lane
        beside this one may have isolated or claimed some of them meanwhile. So a
        row is poison only once the database has refused it alone."""
        if not ids:
            return BatchEffect()
        try:
            return self._batch(lane, only=ids)
        except DBAPIError as exc:
            if not is_poison_error(exc):
                raise
            return self._isolate(lane, ids, exc)

    def _isolate(self, lane: Session, ids: list[str], error: DBAPIError) -> BatchEffect:
        """The database refused a batch: the same batch in halves, each its own
        transaction, until the row it refuses is alone. That row is poison (left
        out for the cycle, counted, logged); every other row commits."""
        if len(ids) == 1:
            if not self.run.exclude(ids):  # another lane isolated it first
                return BatchEffect()
            poison = ItemFailed(
                run_id=self.run.run_id,
                phase=self.phase.name,
                conference_id=ids[0],
                error=describe(error),
            )
            return BatchEffect(poison=[poison])
        effect = BatchEffect()
        for half in (ids[: len(ids) // 2], ids[len(ids) // 2 :]):
            effect = effect.merge(self._retry(lane, half))
        return effect


def is_poison_error(exc: DBAPIError) -> bool:
    """PostgreSQL refused the data of some row (a data exception, a constraint, a
    trigger raising), not the statement or the connection."""
    code = sqlstate(exc) or ""
    return code[:2] in ("22", "23", "P0")


def phase_result(
    run_id: str,
    run: Run | None,
    before: dict[str, int],
    after: dict[str, int],
    paused: list[str] | None = None,
) -> PhaseResult:
    """A phase task's result: the cycle's result keys, counting that phase alone;
    ``skipped`` when the phase found the run no longer its cycle's."""
    return {
        "run_id": run_id,
        "as_of": rfc3339(run.as_of) if run else None,
        "skipped": run is None,
        **counts({key: after.get(key, 0) - before.get(key, 0) for key in after}),
        "paused": paused or [],
    }
