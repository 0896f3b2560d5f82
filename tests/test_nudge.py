"""The relay request after a batch that wrote events (reaper/nudge.py): one
request for a burst of batches, never the drain's thread waiting on the broker,
a thread of its own in each forked process, and only for batches that wrote
conference-ended events."""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from typing import Any

import pytest

from reaper.events import BatchSelected, ConferenceReaped
from reaper.nudge import Nudge, RelayOnEvents
from tests.support.facts import fields, log_records

pytestmark = pytest.mark.fast


# How long a held send hangs (a broker that never answers): a poke that waited
# on the send would wait this long.
HANG_S = 10.0
# The pause between two requests in the burst test: long beside the test's own
# steps (microseconds), even on a CPU shared with the test beside it.
PAUSE_S = 1.0


class Sends:
    """A ``send`` that counts its calls and can be held."""

    def __init__(self) -> None:
        self.count = 0
        self.sent = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self) -> None:
        self.release.wait(HANG_S)
        self.count += 1
        self.sent.set()


def wait_for(predicate: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_a_burst_of_pokes_sends_one_request_then_one_more_after_the_pause() -> None:
    sends = Sends()
    nudge = Nudge(sends, every=PAUSE_S)
    for _ in range(50):
        nudge.poke()
    assert wait_for(lambda: sends.count == 1)
    for _ in range(50):  # inside the pause: gathered into the next request
        nudge.poke()
    time.sleep(PAUSE_S / 10)
    assert sends.count == 1
    assert wait_for(lambda: sends.count == 2)
    time.sleep(PAUSE_S * 1.5)  # nothing poked since: nothing sent, even after a pause
    assert sends.count == 2


def test_a_poke_never_waits_for_a_send_that_hangs() -> None:
    sends = Sends()
    sends.release.clear()  # the broker never answers
    nudge = Nudge(sends, every=0.01)
    nudge.poke()
    started = time.monotonic()
    for _ in range(1000):
        nudge.poke()
    assert time.monotonic() - started < HANG_S / 2  # none waited for the hanging send
    assert sends.count == 0
    sends.release.set()
    assert wait_for(lambda: sends.count >= 1)


def test_a_refused_request_is_logged_and_the_next_poke_asks_again(caplog) -> None:
    calls: list[int] = []

    def send() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("broker away")

    nudge = Nudge(send, every=0.01)
    with caplog.at_level(logging.WARNING):
        nudge.poke()
        assert wait_for(lambda: len(calls) == 1)
        assert wait_for(lambda: bool(log_records(caplog, "relay.request_failed")))
        nudge.poke()
        assert wait_for(lambda: len(calls) == 2)
    (failed,) = log_records(caplog, "relay.request_failed")
    assert failed.levelno == logging.WARNING and "broker away" in fields(failed)["error"]


def _poke_in_child(nudge: Nudge, sent: Any) -> None:
    nudge.send = lambda: sent.put_nowait("child")
    nudge.poke()
    time.sleep(1)  # the child's own thread sends meanwhile


def test_a_forked_process_sends_from_a_thread_of_its_own() -> None:
    sends = Sends()
    nudge = Nudge(sends, every=0.01)
    nudge.poke()  # the parent's thread exists before the fork
    assert wait_for(lambda: sends.count == 1)
    context = multiprocessing.get_context("fork")
    sent = context.Queue()
    child = context.Process(target=_poke_in_child, args=(nudge, sent))
    child.start()
    try:
        assert sent.get(timeout=5) == "child"
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()


class Pokes:
    def __init__(self) -> None:
        self.count = 0

    def poke(self) -> None:
        self.count += 1


def batch(phase: str, reaped: int) -> BatchSelected:
    rooms = tuple(
        ConferenceReaped(
            run_id="r",
            phase=phase,
            conference_id=f"c{i}",
            chat_id="chat",
            deal_id="deal",
            tenant_id=None,
            status="Ended",
            end_reason="EmptyTimeout",
        )
        for i in range(reaped)
    )
    return BatchSelected(run_id="r", phase=phase, label="x", reaped=rooms, started_ns=0, ended_ns=0)


@pytest.mark.parametrize(
    ("phase", "reaped", "asks"),
    [
        ("empty_room", 3, True),
        ("stale_live", 1, True),
        ("provision_timeout", 3, False),  # fails rooms: no conference-ended event
        ("empty_room", 0, False),  # a batch that closed nothing
    ],
)
def test_only_a_batch_that_wrote_conference_ended_events_asks(
    phase: str, reaped: int, asks: bool
) -> None:
    pokes = Pokes()
    RelayOnEvents(pokes)(batch(phase, reaped))  # type: ignore[arg-type]
    assert pokes.count == (1 if asks else 0)
