"""Prometheus metrics (docs/design.md#metrics), correct under Celery's prefork pool.

A subscriber of the engine's facts (:func:`subscribe`). Every metric lives in a
private registry, so no other process that happens to load the app (``celery
flower`` serves its own default registry) ever shows or serves them.

Prefork: the worker's children each count in their own memory-mapped file
under ``PROMETHEUS_MULTIPROC_DIR`` (one directory per worker, wiped when the
worker starts); the worker's main process serves ``/metrics`` on
``REAPER_METRICS_PORT`` from a fresh registry with a ``MultiProcessCollector``,
which sums the files of every child, live or replaced, so a counter neither
resets nor double-counts when a child is recycled. Gauges are measured from the
database (the most recent measurement wins, whoever took it).

The documented way: ``PROMETHEUS_MULTIPROC_DIR`` in the worker's environment
when it starts (the Procfile, the compose file and the Dockerfile set it), so
prometheus_client picks its multiprocess values when it is imported. Without
it, ``celery`` has imported prometheus_client before the app could set the
variable (Flower registers a ``celery`` sub-command), and the value class
prometheus_client chose at import is switched (see :func:`_use_values`).
"""

from __future__ import annotations

import atexit
import glob
import io
import os
import queue
import re
import selectors
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, get_args
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_wsgi_app,
    multiprocess,
    values,
)

from reaper.events import (
    BatchSelected,
    Bus,
    CycleCompleted,
    CycleStarted,
    GaugesMeasured,
    LockLost,
    PassLockLost,
    PhaseCompleted,
    PhaseFailed,
    PhaseMassClosure,
    RelayBatchCommitted,
    RelayKafkaUnavailable,
    RelayPassCompleted,
    StopSignalsSent,
)
from reaper.kafka import UnavailableCause
from reaper.logs import get_logger, log
from reaper.phases import ORDER, PHASES

logger = get_logger("metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
RUN_RESULTS = ("completed", "skipped", "failed")
# docs/design.md#metrics: closed conferences only. A run the mass-closure guard stopped
# closed nothing: it has its own counter (mass_closure_blocked_total).
ITEM_OUTCOMES = tuple(phase.outcome for phase in PHASES.values())
PHASE_NAMES = ORDER
KAFKA_UNAVAILABLE_CAUSES = get_args(UnavailableCause)

# The names a dashboard or alert may use (the test of ops/ checks against it).
EXPORTED = (
    "messenger_conf_reaper_run_total",
    "messenger_conf_reaper_cycle_duration_seconds",
    "messenger_conf_reaper_items_total",
    "messenger_conf_reaper_active_backlog",
    "messenger_conf_reaper_activity_ahead",
    "messenger_conf_reaper_skip_locked_total",
    "messenger_conf_reaper_errors_total",
    "messenger_conf_reaper_closing_lateness_seconds",
    "messenger_conf_reaper_mass_closure_blocked_total",
    "messenger_conf_reaper_recorder_stop_failed_total",
    "messenger_outbox_relay_published_total",
    "messenger_outbox_relay_kafka_unavailable_total",
    "messenger_outbox_pending",
    "messenger_outbox_oldest_pending_age_seconds",
    "messenger_outbox_parked",
    "messenger_conf_reaper_paused",
    "messenger_conf_reaper_clock_skew_seconds",
    "messenger_conf_reaper_last_cycle_timestamp_seconds",
    "messenger_outbox_last_relay_timestamp_seconds",
    "messenger_conf_reaper_last_run_completed_timestamp_seconds",
)

# A cycle's target is < 5 s, its budget REAPER_MAX_RUN_DURATION (30 s).
CYCLE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
# The SLO: closed within one polling interval (30 s) of becoming eligible.
LATENESS_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600, 1800, 3600)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.run_total = Counter(
            "messenger_conf_reaper_run_total",
            "Reap cycles by result (completed, skipped: lock held elsewhere, failed).",
            ["result"],
            registry=r,
        )
        self.cycle_duration = Histogram(
            "messenger_conf_reaper_cycle_duration_seconds",
            "Wall time of a reap cycle that ran (skipped cycles are not observed).",
            buckets=CYCLE_BUCKETS,
            registry=r,
        )
        self.items = Counter(
            "messenger_conf_reaper_items_total",
            "Conferences closed, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.backlog = Gauge(
            "messenger_conf_reaper_active_backlog",
            "Active or Provisioning conferences already past their phase's window.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.activity_ahead = Gauge(
            "messenger_conf_reaper_activity_ahead",
            "Active conferences whose last_activity_at is later than the database's clock"
            " (infinity included): held, never closed until an operator decides.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.skip_locked = Counter(
            "messenger_conf_reaper_skip_locked_total",
            "Eligible conferences left for the next cycle because a command held their row.",
            registry=r,
        )
        self.errors = Counter(
            "messenger_conf_reaper_errors_total",
            "Failed phases (database errors), poison conferences the database refused,"
            " and run locks lost mid-phase.",
            registry=r,
        )
        self.lateness = Histogram(
            "messenger_conf_reaper_closing_lateness_seconds",
            "ended_at minus the moment the conference became eligible, per phase.",
            ["phase"],
            buckets=LATENESS_BUCKETS,
            registry=r,
        )
        self.mass_closure_blocked = Counter(
            "messenger_conf_reaper_mass_closure_blocked_total",
            "stale_live runs the mass-closure guard stopped (they closed nothing).",
            registry=r,
        )
        self.recorder_stop_failed = Counter(
            "messenger_conf_reaper_recorder_stop_failed_total",
            "Recording stop signals the recorder did not take (error, timeout, refused).",
            registry=r,
        )
        self.relay_published = Counter(
            "messenger_outbox_relay_published_total",
            "integration_outbox rows published to Kafka.",
            registry=r,
        )
        self.relay_kafka_unavailable = Counter(
            "messenger_outbox_relay_kafka_unavailable_total",
            "Relay batches that found no Kafka broker to take them, by cause: "
            "unreachable, tls (a certificate refused), authentication (a SASL login refused).",
            ["cause"],
            registry=r,
        )
        self.outbox_pending = Gauge(
            "messenger_outbox_pending",
            "integration_outbox rows not yet published.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.outbox_oldest = Gauge(
            "messenger_outbox_oldest_pending_age_seconds",
            "Age of the oldest unpublished integration_outbox row (0 when none).",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.outbox_parked = Gauge(
            "messenger_outbox_parked",
            "integration_outbox rows parked: refused by Kafka for good, or out of attempts.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.paused = Gauge(
            "messenger_conf_reaper_paused",
            "1 while an operator's pause keeps the phase from changing anything.",
            ["phase"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.clock_skew = Gauge(
            "messenger_conf_reaper_clock_skew_seconds",
            "The worker's clock minus the database's, measured at the start of each cycle.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        # The health check reads these two (/healthz): when this worker last saw
        # a cycle end (completed, or skipped for another runner) and a relay pass.
        self.last_cycle = Gauge(
            "messenger_conf_reaper_last_cycle_timestamp_seconds",
            "Unix time a reap cycle of this worker last completed or was skipped.",
            multiprocess_mode="max",
            registry=r,
        )
        self.last_relay = Gauge(
            "messenger_outbox_last_relay_timestamp_seconds",
            "Unix time a relay pass of this worker last ran.",
            multiprocess_mode="max",
            registry=r,
        )
        # Closings, whoever runs them: the alert ConferenceReaperNotClosing reads
        # it, so a lock held by a session that is not the reaper shows although
        # every tick of every worker is skipped.
        self.last_run_completed = Gauge(
            "messenger_conf_reaper_last_run_completed_timestamp_seconds",
            "Unix time (the database's clock) a reap run last completed, by any worker;"
            " 0 until one has.",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        # Series exist (at 0) from the start: an alert on increase() needs them.
        for result in RUN_RESULTS:
            self.run_total.labels(result=result)
        for outcome in ITEM_OUTCOMES:
            self.items.labels(outcome=outcome)
        for phase in PHASE_NAMES:
            self.lateness.labels(phase=phase)
            self.paused.labels(phase=phase)
        for cause in KAFKA_UNAVAILABLE_CAUSES:
            self.relay_kafka_unavailable.labels(cause=cause)


_lock = threading.Lock()
_metrics: _Metrics | None = None
_multiproc_dir: str | None = None


def _m() -> _Metrics:
    global _metrics
    if _metrics is None:
        with _lock:
            if _metrics is None:
                _metrics = _Metrics()
    return _metrics


# -- process set-up ----------------------------------------------------------

# What prometheus_client saw when it was imported (imported above, so now).
_ENV_AT_IMPORT = os.environ.get(MULTIPROC_ENV)


def enable_multiprocess(directory: str | None = None) -> str:
    """The worker's main process, before its pool forks and before any metric exists."""
    global _multiproc_dir
    if _metrics is not None:
        raise RuntimeError("metrics already created in this process: multiprocess mode too late")
    if directory is None:
        directory = tempfile.mkdtemp(prefix="reaper-metrics-")
        atexit.register(_remove_private_dir, directory, os.getpid())
    os.makedirs(directory, exist_ok=True)
    for stale in glob.glob(os.path.join(directory, "*.db")):
        os.remove(stale)  # a previous worker's counts are not ours
    os.environ[MULTIPROC_ENV] = directory
    if directory != _ENV_AT_IMPORT:
        _use_values(values.MultiProcessValue())
    _multiproc_dir = directory
    return directory


def keep_out_of_multiprocess() -> None:
    """A process that is not the worker (Flower) and inherited the worker's
    directory: its metrics stay in its own memory, never in that directory."""
    global _multiproc_dir
    os.environ.pop(MULTIPROC_ENV, None)
    os.environ.pop(MULTIPROC_ENV.lower(), None)
    if _ENV_AT_IMPORT:
        _use_values(values.MutexValue)
    _multiproc_dir = None


def _use_values(value_class: Any) -> None:
    """Switch the value class prometheus_client chose from the environment at import.

    prometheus_client (0.20 to 0.26, tested in tests/test_metrics.py) reads
    ``values.ValueClass`` each time a metric is created; the variable is only
    read at import. A release without that attribute fails here, loudly,
    rather than counting into the wrong place.
    """
    if not hasattr(values, "ValueClass"):
        raise RuntimeError("prometheus_client has no values.ValueClass: check reaper/metrics.py")
    values.ValueClass = value_class


def multiprocess_dir() -> str | None:
    return _multiproc_dir


def _remove_private_dir(directory: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that exits first
        shutil.rmtree(directory, ignore_errors=True)


def child_exited(pid: int) -> None:
    """A pool child is gone: drop its live gauges (its counters must stay)."""
    if _multiproc_dir:
        multiprocess.mark_process_dead(pid, _multiproc_dir)


_DB_FILE = re.compile(r"_(\d+)\.db$")


def _sweep_dead_children() -> None:
    """mark_process_dead for children that died without saying so (SIGKILL)."""
    if not _multiproc_dir:
        return
    for path in glob.glob(os.path.join(_multiproc_dir, "gauge_live*.db")):
        match = _DB_FILE.search(path)
        if match and not _alive(int(match[1])):
            child_exited(int(match[1]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the subscriber: facts to series ------------------------------------------


def subscribe(bus: Bus) -> None:
    """Count what the engine tells (reaper.wiring connects it at process set-up)."""
    bus.subscribe(CycleStarted, _cycle_started)
    bus.subscribe(CycleCompleted, _cycle_finished)
    bus.subscribe(BatchSelected, _batch_selected)
    bus.subscribe(PhaseCompleted, _phase_completed)
    bus.subscribe(PhaseFailed, _phase_failed)
    bus.subscribe(LockLost, _lock_lost)
    bus.subscribe(PassLockLost, _pass_lock_lost)
    bus.subscribe(PhaseMassClosure, _mass_closure)
    bus.subscribe(StopSignalsSent, _stop_signals)
    bus.subscribe(GaugesMeasured, _gauges)
    bus.subscribe(RelayBatchCommitted, _relay_batch)
    bus.subscribe(RelayPassCompleted, _relay_pass)
    bus.subscribe(RelayKafkaUnavailable, _relay_kafka_unavailable)


def _cycle_started(fact: CycleStarted) -> None:
    _m().clock_skew.set(fact.clock_skew_seconds)


def _cycle_finished(fact: CycleCompleted) -> None:
    m = _m()
    skipped = bool(fact.result.get("skipped"))
    result = "skipped" if skipped else "failed" if fact.errors > 0 else "completed"
    m.run_total.labels(result=result).inc()
    if fact.error is not None:
        m.errors.inc()
    if not skipped:
        m.cycle_duration.observe(fact.result.get("duration_ms", 0) / 1000)
    if result != "failed":
        m.last_cycle.set(time.time())


def _batch_selected(fact: BatchSelected) -> None:
    m = _m()
    if fact.reaped:
        histogram = m.lateness.labels(phase=fact.phase)  # once per batch, not per room
        for item in fact.reaped:
            if item.lateness_seconds is not None:
                histogram.observe(max(0.0, item.lateness_seconds))
        m.items.labels(outcome=fact.outcome).inc(len(fact.reaped))
    if fact.poison:
        m.errors.inc(len(fact.poison))


def _phase_completed(fact: PhaseCompleted) -> None:
    if fact.skipped_locked > 0:
        _m().skip_locked.inc(fact.skipped_locked)


def _phase_failed(fact: PhaseFailed) -> None:
    _m().errors.inc()


def _lock_lost(fact: LockLost) -> None:
    # Its own error, also when it made the phase fail (counted there too): a lock
    # lost after the phase's last batch fails nothing and would go uncounted.
    _m().errors.inc()


def _pass_lock_lost(fact: PassLockLost) -> None:
    # A relay or stop pass that lost its lock midway: a frozen or cut-off worker.
    _m().errors.inc()


def _mass_closure(fact: PhaseMassClosure) -> None:
    if not fact.allowed:
        _m().mass_closure_blocked.inc()


def _stop_signals(fact: StopSignalsSent) -> None:
    if fact.failed > 0:
        _m().recorder_stop_failed.inc(fact.failed)


def _gauges(fact: GaugesMeasured) -> None:
    m = _m()
    m.backlog.set(fact.active_backlog)
    m.activity_ahead.set(fact.activity_ahead)
    for phase in PHASE_NAMES:
        m.paused.labels(phase=phase).set(1 if phase in fact.paused else 0)
    _set_outbox(m, fact.outbox_pending, fact.outbox_oldest_pending_age_seconds, fact.outbox_parked)
    if fact.last_run_completed_at is not None:
        m.last_run_completed.set(fact.last_run_completed_at.timestamp())


def _relay_batch(fact: RelayBatchCommitted) -> None:
    if fact.published > 0:
        _m().relay_published.inc(fact.published)


def _relay_kafka_unavailable(fact: RelayKafkaUnavailable) -> None:
    _m().relay_kafka_unavailable.labels(cause=fact.cause).inc()


def _relay_pass(fact: RelayPassCompleted) -> None:
    result = fact.result
    _set_outbox(_m(), result.pending, result.oldest_pending_age_seconds, result.outbox_parked)
    if not result.skipped:
        _m().last_relay.set(time.time())


def _set_outbox(m: _Metrics, pending: int, oldest_age_seconds: float, parked: int) -> None:
    m.outbox_pending.set(pending)
    m.outbox_oldest.set(max(0.0, oldest_age_seconds))
    m.outbox_parked.set(parked)


# -- reading and serving -----------------------------------------------------


def registry() -> CollectorRegistry:
    """This process's own registry (in-process use and tests)."""
    return _m().registry


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of this process's registry (0 when absent)."""
    return _m().registry.get_sample_value(name, labels or {}) or 0.0


def exposition() -> bytes:
    """What ``/metrics`` serves: every process's files in multiprocess mode."""
    return generate_latest(_serving_registry())


class _Refresh:
    """Collected first: brings the database gauges up to date before a scrape."""

    def __init__(self, refresh: Callable[[], None], min_interval: float) -> None:
        self.refresh = refresh
        self.min_interval = min_interval
        self.last = 0.0
        self.lock = threading.Lock()

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        with self.lock:
            now = time.monotonic()
            if now - self.last >= self.min_interval:
                self.last = now
                self.refresh()
        _sweep_dead_children()
        return []


def _serving_registry(refresh: Callable[[], None] | None = None) -> CollectorRegistry:
    if not _multiproc_dir:
        if refresh is not None:
            refresh()
        return _m().registry
    served = CollectorRegistry()
    if refresh is not None:
        served.register(_Refresh(refresh, min_interval=5.0))
    multiprocess.MultiProcessCollector(served, path=_multiproc_dir)
    return served


def read(name: str) -> float | None:
    """The value ``/metrics`` would serve for an unlabelled series (all processes)."""
    for family in _serving_registry().collect():
        for sample_ in family.samples:
            if sample_.name == name and not sample_.labels:
                return sample_.value
    return None


@dataclass
class Server:
    port: int
    close: Callable[[], None]


# -- the HTTP server of /metrics and /healthz -----------------------------------
#
# Bounded on every side: a fixed number of threads whatever the clients do, a
# fixed number of sockets, and no client can hold any of them past a timeout.
# One thread accepts connections and gathers their requests without blocking
# (a selector); only a request that has fully arrived goes to a handler thread.

# A client has this long to send its whole request: Prometheus and probes send
# it at once; one that sends nothing, or trickles, is closed when it is up.
REQUEST_TIMEOUT_S = 5.0
# Writing an answer to a client that stopped reading gives up after this.
WRITE_TIMEOUT_S = 5.0
# Requests answered side by side, per kind. /healthz has threads of its own: a
# scrape's refresh waits on the database (up to budgets.READ, longer on a dead
# connection), and scrapes stuck there must never keep a probe waiting past
# its own budget (budgets.HEALTH).
METRICS_THREADS = 2
HEALTH_THREADS = 2
# Connections still sending their request. At the limit the oldest is closed:
# a crowd of idle clients never keeps a new scrape out.
MAX_GATHERING = 64
# Requests that have arrived and wait for a handler, per kind; beyond that a
# new one is closed unanswered rather than queued without end.
MAX_WAITING = 8
# The longest request head (request line and headers) accepted.
MAX_REQUEST_BYTES = 16384
# How often the accepting thread closes expired connections and looks for close().
TICK_S = 0.25


class _QuietHandler(WSGIRequestHandler):
    """Answers one request whose head the server has already read (``head``)."""

    timeout = WRITE_TIMEOUT_S  # the socket's, for writing the answer

    def __init__(self, sock: socket.socket, address: Any, server: WSGIServer, head: bytes) -> None:
        self.head = head
        super().__init__(sock, address, server)

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.rfile = io.BytesIO(self.head)  # a GET has no body: the head is all there is

    def log_message(self, *_: Any) -> None:  # a scrape every few seconds is not news
        pass


class _Listener(WSGIServer):
    # The kernel's queue of connections not yet accepted: socketserver's 5
    # made a crowd of clients wait for SYN retries (seconds) before even that.
    request_queue_size = MAX_GATHERING


@dataclass
class _Gathering:
    """A connection whose request has not fully arrived yet."""

    address: Any
    deadline: float  # time.monotonic()
    head: bytes = b""


_Waiting = queue.Queue[tuple[socket.socket, _Gathering]]


def _path(head: bytes) -> bytes:
    """The path of a request's first line (``GET /healthz?x HTTP/1.1``), without its query."""
    parts = head.split(b" ", 2)
    return parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""


class _BoundedServer:
    def __init__(self, address: str, port: int, app: Callable[..., Any]) -> None:
        # wsgiref's server binds and listens, and gives the handlers their WSGI
        # environment and app; its own loop (a thread per request) is not used.
        # _QuietHandler is built per request below, so the class the server is
        # given is never instantiated.
        self.wsgi = _Listener((address, port), WSGIRequestHandler)
        self.wsgi.set_app(app)
        self.listener = self.wsgi.socket
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.gathering: dict[socket.socket, _Gathering] = {}  # oldest first
        self.metrics_waiting: _Waiting = queue.Queue(MAX_WAITING)
        self.health_waiting: _Waiting = queue.Queue(MAX_WAITING)
        self.closing = threading.Event()
        self.threads = [threading.Thread(target=self._accept_loop, name="reaper-http", daemon=True)]
        self.threads += self._handlers("metrics", self.metrics_waiting, METRICS_THREADS)
        self.threads += self._handlers("healthz", self.health_waiting, HEALTH_THREADS)
        for thread in self.threads:
            thread.start()

    @property
    def port(self) -> int:
        return int(self.wsgi.server_address[1])

    def _accept_loop(self) -> None:
        while not self.closing.is_set():
            for key, _ in self.selector.select(TICK_S):
                if key.fileobj is self.listener:
                    self._accept()
                elif isinstance(key.fileobj, socket.socket):
                    self._receive(key.fileobj)
            now = time.monotonic()
            for sock in [s for s, g in self.gathering.items() if g.deadline <= now]:
                self._drop(sock)

    def _accept(self) -> None:
        """Every connection waiting in the kernel's queue."""
        while True:
            try:
                sock, address = self.listener.accept()
            except OSError:  # none left (BlockingIOError), or gone before it was accepted
                return
            if len(self.gathering) >= MAX_GATHERING:
                self._drop(next(iter(self.gathering)))
            sock.setblocking(False)
            self.gathering[sock] = _Gathering(address, time.monotonic() + REQUEST_TIMEOUT_S)
            self.selector.register(sock, selectors.EVENT_READ)

    def _receive(self, sock: socket.socket) -> None:
        gathering = self.gathering.get(sock)
        if gathering is None:  # dropped for a newer one since select() returned
            return
        try:
            chunk = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client went away
            self._drop(sock)
            return
        gathering.head += chunk
        if b"\r\n\r\n" in gathering.head:
            self._forget(sock)
            sock.setblocking(True)
            healthz = _path(gathering.head) == b"/healthz"
            waiting = self.health_waiting if healthz else self.metrics_waiting
            try:
                waiting.put_nowait((sock, gathering))
            except queue.Full:
                sock.close()
        elif len(gathering.head) > MAX_REQUEST_BYTES:
            self._drop(sock)

    def _forget(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        del self.gathering[sock]

    def _drop(self, sock: socket.socket) -> None:
        self._forget(sock)
        sock.close()

    def _handlers(self, kind: str, waiting: _Waiting, count: int) -> list[threading.Thread]:
        return [
            threading.Thread(
                target=self._handler_loop,
                args=(waiting,),
                daemon=True,
                name=f"reaper-http-{kind}-{n}",
            )
            for n in range(count)
        ]

    def _handler_loop(self, waiting: _Waiting) -> None:
        while not self.closing.is_set():
            try:
                sock, gathering = waiting.get(timeout=TICK_S)
            except queue.Empty:
                continue
            try:
                _QuietHandler(sock, gathering.address, self.wsgi, gathering.head)
            except OSError:  # the client went away or stopped reading (WRITE_TIMEOUT_S)
                pass
            finally:
                self.wsgi.shutdown_request(sock)

    def close(self) -> None:
        self.closing.set()
        for thread in self.threads:
            thread.join(timeout=TICK_S * 4)
        for sock in list(self.gathering):
            self._drop(sock)
        for waiting in (self.metrics_waiting, self.health_waiting):
            while not waiting.empty():
                waiting.get_nowait()[0].close()
        self.selector.close()
        self.wsgi.server_close()


Health = Callable[[], tuple[int, bytes]]


def serve(
    port: int,
    address: str,
    *,
    refresh: Callable[[], None] | None = None,
    health: Health | None = None,
) -> Server:
    """Serve ``/metrics`` (and ``/healthz``) from this process (the worker's main one)."""
    _m()  # the main process's own series (zeros) exist before the first scrape
    metrics_app = make_wsgi_app(_serving_registry(refresh))

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if health is not None and environ.get("PATH_INFO") == "/healthz":
            status, body = health()
            start_response(
                f"{status} {HTTPStatus(status).phrase}",
                [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
            )
            return [body]
        answer: list[bytes] = metrics_app(environ, start_response)
        return answer

    server = _BoundedServer(address, port, app)
    log(
        logger,
        "metrics.serving",
        port=server.port,
        address=address,
        multiprocess=bool(_multiproc_dir),
    )
    return Server(server.port, server.close)
