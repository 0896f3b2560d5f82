"""The best-effort stop signal to the media stack's recorder.

See docs/design.md#the-recorder-stop-signal.

:class:`RecorderClient` sends ``POST {REAPER_RECORDER_URL}/recordings/{id}/stop``
and never raises: whatever the recorder does (refuses, times out, answers
garbage, resets, redirects, sends a huge body, fails TLS) is a stop signal not
taken, logged and counted. It bounds its own time: each call has the recorder
timeout, the calls of a batch run side by side, and the whole batch's signals
get at most two timeouts (a black-holed recorder must not hold the phase for
batch/parallelism x timeout).

:class:`StopSignal` is the subscriber that sends them once a batch has
committed; a signal never undoes or holds a transition.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import quote

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from reaper.budgets import Budget
from reaper.db import transaction
from reaper.errors import describe
from reaper.events import BatchCommitted, Bus, CycleFinished, StopSignalsSent
from reaper.logs import get_logger, log

logger = get_logger("recorder")

DONE_STATUSES = frozenset({404, 409})
PARALLEL_CALLS = 64
# A reply to a stop call is a status line and a small body; more is not read.
MAX_BODY = 64 * 1024


@dataclass(frozen=True)
class StopRequest:
    recording_id: str
    conference_id: str
    reason: str


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A stop call is a POST to one endpoint: a redirect is an answer, not a hop."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


_opener = urllib.request.build_opener(_NoRedirects)


class RecorderClient:
    def __init__(self, base_url: str, timeout: timedelta) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout.total_seconds()

    def stop(self, request: StopRequest) -> bool:
        """True when the recorder took the signal (2xx, 404 or 409); never raises."""
        url = f"{self.base_url}/recordings/{quote(request.recording_id)}/stop"
        body = json.dumps({"conferenceId": request.conference_id, "reason": request.reason})
        http_request = urllib.request.Request(
            url,
            data=body.encode(),
            method="POST",
            headers={
                "Content-Type": "application/json",
                "Idempotency-Key": request.recording_id,
            },
        )
        try:
            with _opener.open(http_request, timeout=self.timeout) as response:
                status = response.status
                response.read(MAX_BODY)
        except urllib.error.HTTPError as exc:  # a status, with or without a body
            status = exc.code
        # The boundary of a "never raises" client: http.client's errors
        # (BadStatusLine, IncompleteRead, LineTooLong...) are not OSError, and
        # TLS, proxies and codecs add their own. Nothing gets past this line.
        except Exception as exc:
            self._failed(request, error=describe(exc))
            return False
        if 200 <= status < 300 or status in DONE_STATUSES:
            log(
                logger,
                "recorder.stop_requested",
                recording_id=request.recording_id,
                conference_id=request.conference_id,
                status=status,
            )
            return True
        self._failed(request, status=status)
        return False

    def _failed(self, request: StopRequest, **why: object) -> None:
        log(
            logger,
            "recorder.stop_failed",
            level=logging.WARNING,
            recording_id=request.recording_id,
            conference_id=request.conference_id,
            **why,
        )

    def stop_all(self, requests: list[StopRequest]) -> list[StopRequest]:
        """Send every signal; return those the recorder took within the budget."""
        if not requests:
            return []
        pool = ThreadPoolExecutor(
            max_workers=min(PARALLEL_CALLS, len(requests)), thread_name_prefix="recorder"
        )
        try:
            futures = {pool.submit(self.stop, request): request for request in requests}
            done, late = wait(futures, timeout=2 * self.timeout + 0.5)
        finally:
            # Calls in flight end at their own timeout; queued ones are dropped.
            pool.shutdown(wait=False, cancel_futures=True)
        for future in late:
            self._failed(futures[future], error="not sent within the batch's time budget")
        return [futures[future] for future in done if future.result()]


class StopSignal:
    """Subscriber: after a batch commits, each reaped room's running recording gets
    one stop signal; ``stop_requested_at`` records those the recorder took, so no
    later cycle sends them again. A signal not taken is retried by the sweep after
    every cycle, with back-off, for REAPER_RECORDER_RETRY_WINDOW after the close:
    an orphaned recording is what the media stack pays for."""

    # The first retry waits this many recorder timeouts, each next one twice as
    # long, up to the cap.
    BACKOFF_TIMEOUTS = 5
    BACKOFF_MAX = timedelta(minutes=2)
    SWEEP_LIMIT = 500

    def __init__(
        self,
        client: RecorderClient,
        engine: Engine,
        bus: Bus,
        budget: Budget,
        retry_window: timedelta = timedelta(minutes=15),
    ) -> None:
        self.client = client
        self.engine = engine
        self.bus = bus
        self.budget = budget  # of its own transactions (budgets.quick)
        self.retry_window = retry_window
        self.backoff_initial = max(1.0, self.BACKOFF_TIMEOUTS * client.timeout)

    def subscribe(self) -> None:
        self.bus.subscribe(BatchCommitted, self.on_batch)
        self.bus.subscribe(CycleFinished, self.on_cycle)

    def on_batch(self, fact: BatchCommitted) -> None:
        if fact.stops:
            self.send(list(fact.stops))

    def on_cycle(self, fact: CycleFinished) -> None:
        if fact.result.get("skipped"):
            return
        self.sweep()

    def sweep(self) -> list[StopRequest]:
        """Send again what is due; the signals the recorder took."""
        try:
            with transaction(self.engine, self.budget) as queries:
                due = queries.stops_due(
                    window_s=self.retry_window.total_seconds(),
                    first_after_s=self.backoff_initial,
                    limit=self.SWEEP_LIMIT,
                )
        except SQLAlchemyError as exc:
            log(logger, "recorder.sweep_failed", level=logging.WARNING, error=describe(exc))
            return []
        if not due:
            return []
        requests = [StopRequest(r.recording_id, r.conference_id, r.end_reason) for r in due]
        taken = self.send(requests)
        log(logger, "recorder.retried", due=len(requests), taken=len(taken))
        return taken

    def send(self, requests: list[StopRequest]) -> list[StopRequest]:
        taken = self.client.stop_all(requests)
        self.bus.emit(StopSignalsSent(requested=len(requests), taken=len(taken)))
        refused = [r.recording_id for r in requests if r not in taken]
        try:
            with transaction(self.engine, self.budget) as queries:
                if taken:
                    queries.mark_stop_requested([stop.recording_id for stop in taken])
                if refused:
                    queries.mark_stop_failed(
                        refused,
                        backoff_initial_s=self.backoff_initial,
                        backoff_max_s=self.BACKOFF_MAX.total_seconds(),
                    )
        except SQLAlchemyError as exc:  # best effort: the signals themselves went out
            log(logger, "recorder.mark_failed", level=logging.WARNING, error=describe(exc))
        return taken
