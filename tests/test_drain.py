"""The drain's machinery (reaper.drain): lanes, the teller, halting, re-raising.

Fake batch and report functions, no database: each test runs in milliseconds.
A batch here returns ``(lane, full)``; the lane is the number its session holds.
"""

from __future__ import annotations

import contextvars
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from reaper import drain as drain_module
from reaper.drain import Drained, SkippedLocked, drain
from tests.support.facts import SteppingClock

WAIT = 5.0  # seconds: a test that waits longer than this for a lane has failed


class Boom(Exception):
    pass


class Abort(BaseException):
    """Not an Exception: what a lane's ``except Exception`` would let through."""


@dataclass
class Lanes:
    """The sessions the drain opens (one per lane, numbered in order) and what
    each lane did, for the assertions."""

    opened: list[int] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)
    batches: dict[int, int] = field(default_factory=dict)  # lane -> batches begun
    reported: list[tuple[int, bool]] = field(default_factory=list)
    report_threads: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def session(self) -> Iterator[int]:
        with self.lock:
            lane = len(self.opened)
            self.opened.append(lane)
        try:
            yield lane
        finally:
            with self.lock:
                self.closed.append(lane)

    def begun(self, lane: int) -> int:
        """Count a batch begun on this lane; its number on the lane, from 1."""
        with self.lock:
            self.batches[lane] = self.batches.get(lane, 0) + 1
            return self.batches[lane]

    def report(self, outcome: tuple[int, bool]) -> None:
        self.report_threads.add(threading.current_thread().name)
        self.reported.append(outcome)  # the teller thread only: no lock


def run(
    lanes: Lanes,
    batch: Callable[[int], tuple[int, bool]],
    *,
    count: int = 1,
    deadline: float = float("inf"),
    clock: Callable[[], float] = lambda: 0.0,
    stop: threading.Event | None = None,
    report: Callable[[tuple[int, bool]], None] | None = None,
) -> Drained:
    return drain(
        batch,
        report or lanes.report,
        session=lanes.session,
        full=lambda outcome: outcome[1],
        lanes=count,
        deadline=deadline,
        clock=clock,
        stop=stop or threading.Event(),
    )


@pytest.fixture
def halted(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once the drain halts its lanes (after a lane's error or a BaseException
    in the calling thread), so a test can hold a batch in flight until then."""
    signal_halt = threading.Event()

    class Halt(threading.Event):
        def set(self) -> None:
            super().set()
            signal_halt.set()

    class WatchedLanes(drain_module._Lanes):
        def __init__(self) -> None:
            super().__init__()
            self.halt = Halt()

    monkeypatch.setattr(drain_module, "_Lanes", WatchedLanes)
    return signal_halt


def test_a_quiet_phase_is_one_batch_on_one_lane() -> None:
    lanes = Lanes()
    done = run(lanes, lambda lane: (lanes.begun(lane) and lane, False), count=4)
    assert done == Drained(batches=1, drained=True, stopped=False)
    assert lanes.opened == lanes.closed == [0]
    assert len(lanes.reported) == 1


def test_each_lane_holds_one_session_for_all_of_its_batches() -> None:
    lanes = Lanes()
    left = iter(range(10))  # ten full batches, then short ones

    def batch(lane: int) -> tuple[int, bool]:
        lanes.begun(lane)
        with lanes.lock:
            return lane, next(left, None) is not None

    done = run(lanes, batch, count=2)
    assert done.drained and not done.stopped
    assert done.batches == sum(lanes.batches.values()) == len(lanes.reported) >= 11
    assert sorted(lanes.opened) == sorted(lanes.closed) == [0, 1]  # two lanes, one session each
    assert {lane for lane, _ in lanes.reported} == {0, 1}


def test_the_other_lanes_start_only_after_a_full_first_batch() -> None:
    lanes = Lanes()
    started = threading.Barrier(3, timeout=WAIT)  # three lanes in flight at once

    def batch(lane: int) -> tuple[int, bool]:
        number = lanes.begun(lane)
        if number == 1 and lane == 0:
            assert lanes.opened == [0]  # alone until its batch came back full
            return lane, True
        if number == 1:
            started.wait()
            return lane, False
        started.wait()  # lane 0's second batch
        return lane, False

    done = run(lanes, batch, count=3)
    assert done.drained and done.batches == 4
    assert sorted(lanes.opened) == [0, 1, 2]


def test_reports_run_on_one_teller_thread_one_per_lane_in_flight() -> None:
    """A lane hands in a batch's report only once its previous one is told, so
    at most one report per lane waits (memory stays flat)."""
    lanes = Lanes()
    told = 0
    slow = threading.Event()

    def report(outcome: tuple[int, bool]) -> None:
        nonlocal told
        slow.wait(0.005)  # a report slower than a batch
        lanes.report(outcome)
        told += 1

    def batch(lane: int) -> tuple[int, bool]:
        number = lanes.begun(lane)
        assert told >= number - 2  # batch k+2 begins after report k was told
        return lane, number < 20

    done = run(lanes, batch, report=report)
    assert done.batches == told == 20
    assert len(lanes.report_threads) == 1
    assert next(iter(lanes.report_threads)).startswith("reaper-tell")


def test_batches_and_reports_see_the_callers_context() -> None:
    """The cycle's trace context reaches every lane and the teller."""
    current: contextvars.ContextVar[str] = contextvars.ContextVar("current", default="none")
    current.set("cycle-1")
    seen: set[str] = set()
    lanes = Lanes()

    def batch(lane: int) -> tuple[int, bool]:
        seen.add(current.get())
        return lane, lanes.begun(lane) < 3

    run(lanes, batch, count=2, report=lambda outcome: seen.add(current.get()))
    assert seen == {"cycle-1"}


def test_a_lane_that_raises_halts_the_others_after_their_batch_in_flight(
    halted: threading.Event,
) -> None:
    """Lane 0 fails while lanes 1 and 2 are in a batch: they finish that batch
    (committed, so reported), begin no other, and the error is raised once every
    lane has ended."""
    lanes = Lanes()
    in_flight = threading.Barrier(3, timeout=WAIT)  # lanes 1, 2 in a batch, and lane 0

    def batch(lane: int) -> tuple[int, bool]:
        number = lanes.begun(lane)
        if lane == 0 and number == 1:
            return lane, True
        if lane == 0:
            in_flight.wait()
            raise Boom("lane 0")
        if number == 1:
            in_flight.wait()
            assert halted.wait(WAIT)
            return lane, True
        raise AssertionError(f"lane {lane} began a batch after the halt")

    with pytest.raises(Boom, match="lane 0"):
        run(lanes, batch, count=3)
    assert lanes.batches == {0: 2, 1: 1, 2: 1}
    assert sorted(lanes.reported) == [(0, True), (1, True), (2, True)]
    assert sorted(lanes.closed) == [0, 1, 2]  # every session given back


def test_the_first_error_is_raised_when_two_lanes_fail(halted: threading.Event) -> None:
    """Lane 1 fails first; lane 0's batch in flight then fails too (the database
    is gone for both): the error raised is the first one."""
    lanes = Lanes()
    in_flight = threading.Barrier(2, timeout=WAIT)

    def batch(lane: int) -> tuple[int, bool]:
        number = lanes.begun(lane)
        if lane == 0 and number == 1:
            return lane, True
        in_flight.wait()
        if lane == 1:
            raise Boom("first")
        assert halted.wait(WAIT)
        raise Boom("second")

    with pytest.raises(Boom, match="first"):
        run(lanes, batch, count=2)


def test_a_base_exception_in_a_lane_halts_and_is_raised(halted: threading.Event) -> None:
    lanes = Lanes()
    in_flight = threading.Barrier(2, timeout=WAIT)

    def batch(lane: int) -> tuple[int, bool]:
        number = lanes.begun(lane)
        if lane == 0 and number == 1:
            return lane, True
        if lane == 0:
            in_flight.wait()
            raise Abort()
        if number == 1:
            in_flight.wait()
            assert halted.wait(WAIT)
            return lane, True
        raise AssertionError("a batch began after the halt")

    with pytest.raises(Abort):
        run(lanes, batch, count=2)
    assert lanes.batches == {0: 2, 1: 1}
    assert sorted(lanes.reported) == [(0, True), (1, True)]


def test_a_report_that_raises_ends_the_drain_with_its_error() -> None:
    lanes = Lanes()

    def report(outcome: tuple[int, bool]) -> None:
        raise Boom("report")

    with pytest.raises(Boom, match="report"):
        run(lanes, lambda lane: (lane, lanes.begun(lane) < 100), report=report)
    assert lanes.batches[0] <= 2  # the lane learns of it at its next hand-in
    assert lanes.closed == [0]


def test_a_last_report_that_raises_ends_the_drain_with_its_error() -> None:
    lanes = Lanes()

    def report(outcome: tuple[int, bool]) -> None:
        raise Boom("last report")

    with pytest.raises(Boom, match="last report"):
        run(lanes, lambda lane: (lanes.begun(lane) and lane, False), report=report)


def test_a_soft_time_limit_in_the_calling_thread_lets_the_lanes_end_their_batch(
    halted: threading.Event,
) -> None:
    """Celery's soft time limit is a signal whose handler raises in the task's
    thread, here the one waiting for its lanes: the lanes end their batch in
    flight (it is reported), begin no other, and the limit is raised."""
    lanes = Lanes()
    struck = threading.Event()

    def soft_limit(signum: int, frame: FrameType | None) -> None:
        if not struck.is_set():  # once, as billiard's timer fires once
            struck.set()
            raise SoftTimeLimitExceeded()

    in_flight = threading.Barrier(2, timeout=WAIT)

    def batch(lane: int) -> tuple[int, bool]:
        number = lanes.begun(lane)
        if number == 1 and lane == 0:
            return lane, True
        if number == 2 or lane == 1:
            if in_flight.wait() == 0:
                # billiard's timer signals the process; here the calling thread gets
                # it, again until it acts: a signal that lands just before the
                # thread blocks on a lock is handled only once the lock is free.
                while not halted.wait(0.01):
                    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
            assert halted.wait(WAIT)
            return lane, True
        raise AssertionError("a batch began after the soft time limit")

    previous = signal.signal(signal.SIGUSR1, soft_limit)
    try:
        with pytest.raises(SoftTimeLimitExceeded):
            run(lanes, batch, count=2)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert lanes.batches == {0: 2, 1: 1}
    assert sorted(lanes.reported) == [(0, True), (0, True), (1, True)]
    assert sorted(lanes.closed) == [0, 1]


def test_a_stop_ends_every_lane_after_its_batch_in_flight() -> None:
    lanes = Lanes()
    stop = threading.Event()

    def batch(lane: int) -> tuple[int, bool]:
        if lanes.begun(lane) == 5:
            stop.set()  # a warm shutdown, asked during a batch
        return lane, True  # never short: only the stop ends the drain

    done = run(lanes, batch, count=1, stop=stop)
    assert done == Drained(batches=5, drained=False, stopped=True)
    assert len(lanes.reported) == 5


def test_a_stop_asked_before_the_start_still_runs_one_batch() -> None:
    stop = threading.Event()
    stop.set()
    lanes = Lanes()
    done = run(lanes, lambda lane: (lanes.begun(lane) and lane, True), stop=stop)
    assert done == Drained(batches=1, drained=False, stopped=True)


def test_the_deadline_ends_a_lane_after_the_batch_that_reaches_it() -> None:
    lanes = Lanes()
    clock = SteppingClock(1.0)  # one second per reading: one reading per full batch
    done = run(
        lanes, lambda lane: (lanes.begun(lane) and lane, True), deadline=clock() + 3, clock=clock
    )
    assert done == Drained(batches=3, drained=False, stopped=False)


def test_a_phase_given_no_time_left_still_makes_progress() -> None:
    """Past the deadline each lane runs the one batch it began, then ends."""
    lanes = Lanes()
    done = run(
        lanes,
        lambda lane: (lanes.begun(lane) and lane, True),
        count=3,
        deadline=0.0,
        clock=lambda: 1.0,
    )
    assert 1 <= done.batches <= 3 and not done.drained
    assert all(number == 1 for number in lanes.batches.values())


# -- SkippedLocked ---------------------------------------------------------------


def test_a_row_a_sibling_lane_claimed_is_not_counted_as_locked() -> None:
    locked = SkippedLocked(lanes=2)
    locked.add(taken=["a", "b"], locked=[])
    locked.add(taken=["c"], locked=["a", "d"])  # "a" was lane 1's, "d" a command's
    assert len(locked) == 1


def test_a_row_found_locked_before_its_sibling_reports_it_is_taken_back() -> None:
    locked = SkippedLocked(lanes=2)
    locked.add(taken=["c"], locked=["a"])  # lane 2 reports first
    locked.add(taken=["a", "b"], locked=[])  # lane 1 had claimed "a"
    assert len(locked) == 0


def test_a_row_locked_in_several_batches_is_counted_once() -> None:
    locked = SkippedLocked(lanes=1)
    for _ in range(3):
        locked.add(taken=[], locked=["held"])
    assert len(locked) == 1
