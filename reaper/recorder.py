"""The best-effort stop signal to the media stack's recorder, on its own task.

See docs/design.md#the-recorder-stop-signal.

A room the reaper closes with a recording still running leaves durable state,
written by the phase's own statement: the room ``Ended``/``Failed`` with the
reaper's ``end_reason``, the recording ``Pending``/``Recording``/``Uploading``
and ``stop_requested_at`` null. That state is the queue. :class:`StopPass`
(the ``reaper.stop_recordings`` task, and ``reaper reap --once`` after its
cycle) claims the due signals, sends them and marks what the recorder took.
Nothing of it runs on a drain lane or on the drain's reporting thread.

:class:`RecorderClient` sends ``POST {REAPER_RECORDER_URL}/recordings/{id}/stop``
and never raises: whatever the recorder does (refuses, times out, trickles,
answers garbage, resets, redirects, sends a huge body, fails TLS) is a stop
signal not taken, logged and counted. Each call has an overall deadline, not a
per-read timeout: every socket operation is given only what is left of it, so
a recorder that sends one byte at a time cannot stretch a call.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Literal
from urllib.parse import quote, urlsplit

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from reaper import budgets
from reaper.config import Settings
from reaper.db import engine_of, transaction
from reaper.errors import describe
from reaper.events import (
    Bus,
    PassLockLost,
    RecorderPassCompleted,
    StopRequest,
    StopSignalsSent,
    process_bus,
)
from reaper.lease import PassLock, pass_lock
from reaper.logs import get_logger, log
from reaper.phases import IN_ORDER
from reaper.queries import Queries

logger = get_logger("recorder")

DONE_STATUSES = frozenset({404, 409})
PARALLEL_CALLS = 64
# A reply to a stop call is a status line and a few headers; a head longer than
# this is not an answer we trust (and is not read further).
MAX_HEAD = 64 * 1024
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9])(?: [^\r\n]*)?")

# What became of one stop signal sent to the recorder.
Delivery = Literal["taken", "failed", "unsent"]


class BadAnswer(Exception):
    """The recorder answered something that is not an HTTP/1.x response head."""


class RecorderClient:
    def __init__(
        self, base_url: str, timeout: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        parts = urlsplit(base_url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self.base_path = parts.path.rstrip("/")
        self.host_header = parts.netloc.rpartition("@")[2]
        self.timeout = timeout
        self.clock = clock
        self._tls_context = ssl.create_default_context() if self.tls else None

    def stop(self, request: StopRequest, not_after: float) -> Delivery:
        """One signal, within REAPER_RECORDER_TIMEOUT and never past ``not_after``
        (the pass's deadline, on ``clock``): ``unsent`` when the pass has no time
        left to start it; never raises."""
        now = self.clock()
        if now >= not_after:
            return "unsent"
        deadline = min(now + self.timeout, not_after)
        try:
            status = self._post(request, deadline)
        # The boundary of a "never raises" client: sockets, TLS and the answer's
        # parsing fail in their own ways. Nothing gets past this line.
        except Exception as exc:
            self._failed(request, error=describe(exc))
            return "failed"
        if 200 <= status < 300 or status in DONE_STATUSES:
            log(
                logger,
                "recorder.stop_requested",
                recording_id=request.recording_id,
                conference_id=request.conference_id,
                status=status,
            )
            return "taken"
        self._failed(request, status=status)
        return "failed"

    def _post(self, request: StopRequest, deadline: float) -> int:
        """The call's status code. Every blocking step waits at most what is left
        until ``deadline``; Python's socket and TLS calls bound their whole
        operation by the socket's timeout (sendall, the handshake), so no step
        can outlive it."""

        def left() -> float:
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise TimeoutError(f"no whole answer within {self.timeout:g}s")
            return remaining

        path = f"{self.base_path}/recordings/{quote(request.recording_id, safe='')}/stop"
        body = json.dumps({"conferenceId": request.conference_id, "reason": request.reason})
        head = (
            f"POST {path} HTTP/1.1\r\n"
            f"Host: {self.host_header}\r\n"
            "Content-Type: application/json\r\n"
            f"Idempotency-Key: {request.recording_id}\r\n"
            f"Content-Length: {len(body.encode())}\r\n"
            "Connection: close\r\n\r\n"
        )
        with self._connect(left) as sock:
            sock.settimeout(left())
            sock.sendall(head.encode() + body.encode())
            answer = b""
            while b"\r\n\r\n" not in answer:
                if len(answer) > MAX_HEAD:
                    raise BadAnswer(f"no end of the answer's head within {MAX_HEAD} bytes")
                sock.settimeout(left())
                chunk = sock.recv(16384)
                if not chunk:
                    raise BadAnswer("connection closed before the answer's head ended")
                answer += chunk
        status_line = answer.split(b"\r\n", 1)[0]
        match = _STATUS_LINE.fullmatch(status_line)
        if match is None:
            raise BadAnswer(f"not an HTTP status line: {status_line[:80]!r}")
        return int(match.group(1))

    @contextmanager
    def _connect(self, left: Callable[[], float]) -> Iterator[socket.socket]:
        # Name resolution is bounded by the system resolver's own timeouts (see
        # the design): give REAPER_RECORDER_URL an address or a local name.
        addresses = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        error: OSError | None = None
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(left())
                sock.connect(address)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            try:
                if self._tls_context is not None:
                    sock.settimeout(left())
                    sock = self._tls_context.wrap_socket(sock, server_hostname=self.host)
                yield sock
            finally:
                sock.close()
            return
        raise error or OSError(f"{self.host} resolved to no address")

    def _failed(self, request: StopRequest, **why: object) -> None:
        log(
            logger,
            "recorder.stop_failed",
            level=logging.WARNING,
            recording_id=request.recording_id,
            conference_id=request.conference_id,
            **why,
        )


@dataclass
class StopPassResult:
    requested: int = 0  # signals sent
    taken: int = 0  # of which the recorder took (2xx, 404, 409)
    unsent: int = 0  # claimed but not started before the pass's deadline: due again now
    retried: int = 0  # signals sent that had been sent before
    retried_taken: int = 0
    skipped: bool = False  # another pass was running
    lock_lost: bool = False  # the stop lock was lost midway: its marks were fenced off
    duration_ms: int = 0

    @property
    def failed(self) -> int:
        return self.requested - self.taken

    def to_json(self) -> dict[str, int | bool]:
        return {**asdict(self), "failed": self.failed}


class StopPass:
    """One pass over the due stop signals, bounded by budgets.stop_pass.

    Claims up to CLAIM_LIMIT due recordings at a time (a lease: their next
    attempt moves past the pass's end, so a concurrent or a later pass leaves
    them alone, and a pass that dies frees them when the lease ends), sends
    them side by side, then marks them in one transaction: taken, not taken
    (exponential back-off), or not started (due again at once). Claims again
    while a whole recorder timeout is left. The threads end with the pass:
    every call ends by its own deadline, which never passes the pass's.

    The stop lock is held as the relay's is (reaper/lease.py): a lock session
    its heartbeat keeps alive, ended by the server one REAPER_RUN_LEASE after
    the pass froze or was cut off; its claims and marks are fenced on it, so a
    pass woken after another took over changes nothing (the claims' lease
    makes its signals due again).
    """

    CLAIM_LIMIT = 500
    # The first retry waits this many recorder timeouts, each next one twice as
    # long, up to the cap.
    BACKOFF_TIMEOUTS = 5
    BACKOFF_MAX_S = 120.0

    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine | None = None,
        bus: Bus | None = None,
        clock: Callable[[], float] = time.monotonic,
        stop_event: threading.Event | None = None,
        exclusive: bool = True,
    ) -> None:
        self.settings = settings
        self.engine = engine or engine_of(settings)
        self.bus = bus or process_bus
        self.clock = clock
        self.stop_event = stop_event or threading.Event()
        # One pass at a time across the workers (try_stop_lock), so passes never
        # fill every worker slot. `reaper reap --once` takes no worker slot: its
        # pass runs beside a worker's (the claims' lease keeps them apart).
        self.exclusive = exclusive
        self.timeout = settings.recorder_timeout.total_seconds()
        self.duration = budgets.stop_pass(settings).total_seconds()
        self.backoff_initial_s = max(1.0, self.BACKOFF_TIMEOUTS * self.timeout)
        self.client = (
            RecorderClient(settings.recorder_url, self.timeout, clock)
            if settings.recorder_url
            else None
        )

    def run(self) -> StopPassResult:
        """One pass, unless another is running (then nothing: it sends the due ones)."""
        started = self.clock()
        result = StopPassResult()
        if self.client is None:
            return result
        lock: PassLock | None = None
        try:
            with self._pass_lock() as lock:
                if lock is not None:
                    self._pass(result, lock, deadline=started + self.duration)
                else:
                    result.skipped = True
        except SQLAlchemyError as exc:  # best effort: the signals are due again later
            log(logger, "recorder.db_failed", level=logging.WARNING, error=describe(exc))
        if lock is not None and (lock.error is not None or result.lock_lost):
            result.lock_lost = True
            error = lock.error or "the pass found the stop lock gone at its marks"
            self.bus.emit(PassLockLost(lock="stop", error=error))
        result.duration_ms = round((self.clock() - started) * 1000)
        self.bus.emit(RecorderPassCompleted(**asdict(result)))
        return result

    def running(self) -> bool:
        """Whether a pass is running somewhere now (it holds the stop lock); False
        when the database cannot tell (another pass is harmless)."""
        try:
            with transaction(self.engine, budgets.quick(self.settings)) as queries:
                # a lock taken here ends with the probe
                return queries.try_stop_lock() is None
        except SQLAlchemyError:
            return False

    @contextmanager
    def _pass_lock(self) -> Iterator[PassLock | None]:
        """One pass at a time across all workers, so passes never fill every
        worker slot: the stop lock for one pass (lease.pass_lock), or None when
        another pass holds it. A pass without the lock (``exclusive`` off, the
        pass of `reaper reap --once`) fences nothing: its lock is a stand-in."""
        if not self.exclusive:
            yield PassLock.unlocked()
            return
        with pass_lock(
            self.engine,
            self.settings,
            take=Queries.try_stop_lock,
            wait_for_marks=Queries.wait_stop_marks,
            give_up_s=budgets.stop_pass_give_up(self.settings).total_seconds(),
        ) as lock:
            yield lock

    def _pass(self, result: StopPassResult, lock: PassLock, deadline: float) -> None:
        assert self.client is not None
        client = self.client
        with ThreadPoolExecutor(PARALLEL_CALLS, thread_name_prefix="recorder") as pool:
            while (
                self.clock() + self.timeout <= deadline
                and not self.stop_event.is_set()
                and not lock.lost
            ):
                requests = self._claim(lock, lease_s=deadline - self.clock() + self.timeout)
                if not requests:
                    return
                deliveries = list(pool.map(lambda r: client.stop(r, deadline), requests))
                if not self._settle(result, lock, requests, deliveries):
                    result.lock_lost = True
                    return
                if len(requests) < self.CLAIM_LIMIT:
                    return

    def _claim(self, lock: PassLock, lease_s: float) -> list[StopRequest]:
        with transaction(self.engine, budgets.quick(self.settings)) as queries:
            rows = queries.claim_stops_due(
                phases=IN_ORDER,
                window_s=self.settings.recorder_retry_window.total_seconds(),
                lease_s=lease_s,
                limit=self.CLAIM_LIMIT,
                holder_pid=lock.holder_pid,
            )
        return [
            StopRequest(r.recording_id, r.conference_id, r.end_reason, r.stop_attempts)
            for r in rows
        ]

    def _settle(
        self,
        result: StopPassResult,
        lock: PassLock,
        requests: list[StopRequest],
        deliveries: list[Delivery],
    ) -> bool:
        """Count what was sent and mark it; False when the stop lock was gone at the
        marks (fenced: nothing marked, the claims' lease makes them due again).
        The calls themselves are counted either way: they were made."""
        taken = [r for r, o in zip(requests, deliveries, strict=True) if o == "taken"]
        failed = [r for r, o in zip(requests, deliveries, strict=True) if o == "failed"]
        unsent = [r for r, o in zip(requests, deliveries, strict=True) if o == "unsent"]
        sent = taken + failed
        result.requested += len(sent)
        result.taken += len(taken)
        result.unsent += len(unsent)
        result.retried += sum(1 for r in sent if r.attempts > 0)
        result.retried_taken += sum(1 for r in taken if r.attempts > 0)
        self.bus.emit(StopSignalsSent(requested=len(sent), taken=len(taken)))
        with transaction(self.engine, budgets.quick(self.settings)) as queries:
            if lock.holder_pid is not None and not queries.stop_marks_fence(lock.holder_pid):
                return False
            if taken:
                queries.mark_stop_requested([r.recording_id for r in taken])
            if failed:
                queries.mark_stop_failed(
                    [r.recording_id for r in failed],
                    backoff_initial_s=self.backoff_initial_s,
                    backoff_max_s=self.BACKOFF_MAX_S,
                )
            if unsent:
                queries.release_stops([r.recording_id for r in unsent])
        return True
