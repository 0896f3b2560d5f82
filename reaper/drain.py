"""The machinery of a phase: a batch function on N lanes until the work runs out.

:func:`drain` calls ``batch(session)`` on ``lanes`` threads, each batch its own
transaction, until one comes back short (nothing left), the deadline passes
or a stop is asked. It always runs at least one batch, so a phase that is
given no time left still makes progress. Why lanes: bench/ showed one
connection taking turns with itself (the statement, then the Python of its
report, then the next statement); with lanes PostgreSQL works on more than one
core while a committed batch is reported. Lanes claim disjoint rows (the
statements use ``FOR UPDATE SKIP LOCKED``, oldest first). The other lanes start
only after a full first batch, so a quiet phase stays one statement. Each lane
opens one ``session()`` (a held connection) for all of its batches: a batch then
costs no pool checkout and no settings of its own.

Each committed batch is handed to ``report`` on one teller thread while the
next batches run; a lane waits for its previous report before handing in the
next (memory stays flat). ``report`` runs on that single thread only, so it may
count without a lock.

The first exception a lane raises stops the others after their batch in flight
and is raised once they have ended; so is a ``BaseException`` (Celery's soft
time limit) that arrives in the calling thread.
"""

from __future__ import annotations

import contextvars
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, TypeVar

from reaper.clock import Monotonic

B = TypeVar("B")  # what a batch returns
S = TypeVar("S")  # what a lane holds for its batches (a database session)


@dataclass
class Drained:
    batches: int = 0
    drained: bool = False  # a batch came back short: nothing was left
    stopped: bool = False  # a stop was asked


class _Lanes(Generic[B]):
    def __init__(self) -> None:
        self.halt = threading.Event()
        self.decided = threading.Event()  # the first batch came back (full or not)
        self.full = False
        self.result = Drained()
        self.error: BaseException | None = None  # the first a lane raised, in time
        self.active = 0  # lanes begun and not yet ended
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)

    def counted(self) -> None:
        with self._lock:
            self.result.batches += 1

    def failed(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
        self.halt.set()  # the other lanes end their batch in flight and stop

    def enter(self) -> bool:
        """A lane begins, unless the drain is halted (then it opens no session)."""
        with self._lock:
            if self.halt.is_set():
                return False
            self.active += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.active -= 1
            self._ended.notify_all()

    def halt_and_wait(self) -> None:
        """Halt, then wait until every lane that began has ended its batch in flight
        and its reports. Counted by the lanes themselves: a soft time limit can
        strike the calling thread inside the executor's submit, after the lane's
        thread started and before its future was returned."""
        with self._lock:
            self.halt.set()
            self._ended.wait_for(lambda: self.active == 0)


def drain(
    batch: Callable[[S], B],
    report: Callable[[B], None],
    *,
    session: Callable[[], AbstractContextManager[S]],
    full: Callable[[B], bool],
    lanes: int,
    deadline: float,
    clock: Monotonic,
    stop: threading.Event,
) -> Drained:
    state: _Lanes[B] = _Lanes()
    with (
        ThreadPoolExecutor(lanes, thread_name_prefix="reaper-lane") as pool,
        ThreadPoolExecutor(1, thread_name_prefix="reaper-tell") as teller,
    ):

        def lane() -> Future[None]:
            context = contextvars.copy_context()
            return pool.submit(
                context.run,
                _lane,
                state,
                session,
                batch,
                report,
                teller,
                full,
                deadline,
                clock,
                stop,
            )

        running = [lane()]
        try:
            state.decided.wait()
            if state.full and not state.halt.is_set():
                running += [lane() for _ in range(lanes - 1)]
            wait(running)
        except BaseException:  # a soft time limit, an interrupt: every lane ends its batch
            state.halt_and_wait()
            raise
        if state.error is not None:  # the cause, not what it led to in the other lanes
            raise state.error
        for finished in running:
            finished.result()  # a lane's last report that raised
    state.result.stopped = stop.is_set()
    return state.result


def _lane(
    state: _Lanes[B],
    session: Callable[[], AbstractContextManager[S]],
    batch: Callable[[S], B],
    report: Callable[[B], None],
    teller: ThreadPoolExecutor,
    full: Callable[[B], bool],
    deadline: float,
    clock: Monotonic,
    stop: threading.Event,
) -> None:
    if not state.enter():
        state.decided.set()
        return
    told: Future[None] | None = None
    try:
        with session() as held:
            while not state.halt.is_set():
                outcome = batch(held)
                state.counted()
                if told is not None:
                    told.result()  # one report per lane in flight
                told = teller.submit(contextvars.copy_context().run, report, outcome)
                if not full(outcome):
                    state.result.drained = True
                    break
                state.full = True
                state.decided.set()
                if clock() >= deadline or stop.is_set():
                    break
    except BaseException as error:
        state.failed(error)
        raise
    finally:
        state.decided.set()
        try:
            if told is not None:
                told.result()
        finally:
            state.leave()


class SkippedLocked:
    """Rows a batch found locked, less those a sibling lane had claimed.

    A row a sibling lane had claimed looks "locked" to this lane's batch; the
    sibling's outcome arrives within a batch or two of it, so recent outcomes
    are enough to tell the two apart (and memory stays bounded). What remains
    is what commands held: ``skipped_locked_count``.
    """

    def __init__(self, lanes: int) -> None:
        self._lock = threading.Lock()
        self._locked: set[str] = set()
        self._recent: deque[frozenset[str]] = deque(maxlen=4 * lanes)

    def add(self, taken: Iterable[str], locked: Iterable[str]) -> None:
        claimed = frozenset(taken)
        with self._lock:
            self._locked -= claimed
            self._recent.append(claimed)
            for key in locked:
                if not any(key in batch for batch in self._recent):
                    self._locked.add(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._locked)
