"""Best-effort stop signal to the media stack's recorder (CONTRACT §8).

Called after a batch commits; it never raises, never undoes a transition, and
bounds its own time: each call has the recorder timeout, the calls of a batch
run side by side, and the whole batch's signals get at most two timeouts (a
black-holed recorder must not hold the phase for batch/parallelism x timeout).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import quote

from reaper import metrics
from reaper.logs import get_logger, log

logger = get_logger("recorder")

DONE_STATUSES = frozenset({404, 409})
PARALLEL_CALLS = 64


@dataclass(frozen=True)
class StopRequest:
    recording_id: str
    conference_id: str
    reason: str


class RecorderClient:
    def __init__(self, base_url: str, timeout: timedelta) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout.total_seconds()

    def stop(self, request: StopRequest) -> bool:
        """True when the recorder took the signal (2xx, 404 or 409)."""
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
            with urllib.request.urlopen(http_request, timeout=self.timeout) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except (OSError, ValueError) as exc:  # refused, timed out, reset, bad URL
            log(
                logger,
                "recorder.stop_failed",
                level=30,
                recording_id=request.recording_id,
                conference_id=request.conference_id,
                error=type(exc).__name__,
            )
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
        log(
            logger,
            "recorder.stop_failed",
            level=30,
            recording_id=request.recording_id,
            conference_id=request.conference_id,
            status=status,
        )
        return False

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
            request = futures[future]
            log(
                logger,
                "recorder.stop_failed",
                level=30,
                recording_id=request.recording_id,
                conference_id=request.conference_id,
                error="not sent within the batch's time budget",
            )
        taken = [futures[future] for future in done if future.result()]
        metrics.recorder_stop_failed(len(requests) - len(taken))
        return taken
