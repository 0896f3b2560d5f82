"""A relay pass's pipeline (:func:`run`): its batches claimed, sent and settled on
three threads, as reaper/drain.py is a phase's lanes.

While one batch is sent, a thread of its own claims the next, and another
settles (awaits, marks, commits) each batch once it is sent, so neither a
claim nor a settle holds up the sends; a claim waits for the settle of the
batch before the one being sent, so at most two batches' transactions are open
at once. The first claim is an eighth of a batch and each one after it twice
the one before, up to ``REAPER_RELAY_BATCH_SIZE``: the first sends do not wait
for a whole batch's claim. What a batch does is reaper/relay_batches.py; when
the pass may go on is the pass's to say (``more``, reaper/relay.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy.exc import SQLAlchemyError

from reaper.errors import describe
from reaper.events import Bus, RelayCloseFailed, RelayResult
from reaper.relay_batches import BatchReport, InFlight, RelayBatches


def run(
    batches: RelayBatches,
    result: RelayResult,
    *,
    batch_size: int,
    more: Callable[[], bool],
    bus: Bus,
) -> None:
    """Batches until a claim with none in flight finds nothing, a settled batch
    found Kafka gone or the relay lock lost, or ``more`` says no more; each settled
    batch added to ``result``. Celery's soft time limit ends it as
    ``result.timed_out``; a database error is raised once every thread has
    stopped."""

    def claim_after(settle: Future[BatchReport] | None, size: int) -> InFlight | None:
        """The next batch, claimed once ``settle`` (of the batch sent before the
        one being sent) is done: two batches' transactions at most; none when
        the pass is to end."""
        if settle is not None and (settle.exception() is not None or _ends(settle.result())):
            return None
        return batches.claim(size) if more() else None

    # Three threads: this one sends each batch's first round; the settler
    # awaits, marks and commits each batch once it is sent; the claimer claims
    # the next batch meanwhile. The sends need the GIL; psycopg2 and the
    # acknowledgement waits release it. No claim waits for this thread: with
    # room for one batch's transaction only (a small pool behind PgBouncer),
    # the next claim waits for the commit of the batch before, no longer.
    settler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-settle")
    claimer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-claim")
    sending: InFlight | None = None  # claimed; this thread sends it
    claiming: Future[InFlight | None] | None = None
    settles: deque[Future[BatchReport]] = deque()  # sent, not yet counted
    size = first_claim(batch_size)
    try:
        sending = batches.claim(size)
        while sending is not None:
            size = min(2 * size, batch_size)
            claiming = claimer.submit(claim_after, settles[-1] if settles else None, size)
            batches.send(sending)
            ended = sending.report.unavailable is not None
            # the settler's from here: a time limit while this thread waits
            # for the claim must not roll back what it is committing
            sent, sending = sending, None
            settles.append(settler.submit(batches.settle, sent))
            sending, claiming = claiming.result(), None
            while len(settles) > 1:  # done: the claim waited for them
                report = _settled(settles)
                report.add_to(result)
                ended = ended or _ends(report)
            if ended:
                break
            if sending is None:
                # A short batch is not the end (while a drain writes events the
                # pass follows it a batch behind), nor is a claim beside a batch
                # in flight that found nothing: it left out the keys behind that
                # batch. Only a claim with nothing in flight ends the pass.
                report = _settled(settles)
                report.add_to(result)
                if not _ends(report) and more():
                    sending = batches.claim(size, may_end=True)
        while settles:
            _settled(settles).add_to(result)
    except SoftTimeLimitExceeded:
        # The batch being sent and the one claimed roll back (their rows go
        # again next pass); a batch being settled is committed (finally).
        result.timed_out = True
    finally:
        # A claim not started is cancelled, and every batch not sent is rolled
        # back; a batch being settled finishes on its own (bounded by the Kafka
        # timeout) and is counted.
        if sending is not None:
            sending.abandon()
        claimer.shutdown(wait=True, cancel_futures=True)
        claimed = _claimed(claiming)
        if claimed is not None:
            claimed.abandon()
        settler.shutdown(wait=True)
        for settle in settles:
            failure = settle.exception()
            if failure is None:
                settle.result().add_to(result)
            elif not isinstance(failure, SQLAlchemyError | SoftTimeLimitExceeded):
                bus.emit(RelayCloseFailed(error=describe(failure)))


def first_claim(batch_size: int) -> int:
    """A pass's first claim: an eighth of a batch. Nothing is sent until it returns
    and a claim takes time in proportion to its rows, so the pass starts small;
    each claim after it is twice the one before, up to the batch size, as a claim
    of 2n rows takes about as long as sending n
    (docs/history/performance-notes.md#the-claims-ramp)."""
    return max(1, batch_size // 8)


def _settled(settles: deque[Future[BatchReport]]) -> BatchReport:
    """The oldest settle's report, once it is done; a settle that failed stays in
    ``settles`` for the pass's end to report (RelayCloseFailed)."""
    report = settles[0].result()
    settles.popleft()
    return report


def _claimed(claiming: Future[InFlight | None] | None) -> InFlight | None:
    """What a claim left behind once the claimer has stopped."""
    if claiming is None or claiming.cancelled() or claiming.exception() is not None:
        return None
    return claiming.result()


def _ends(report: BatchReport) -> bool:
    """After this settled batch no other is claimed: Kafka is gone, or the relay
    lock is (its marks were fenced)."""
    return report.unavailable is not None or report.fenced
