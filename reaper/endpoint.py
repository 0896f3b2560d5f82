"""The worker's HTTP endpoint: ``/metrics`` and ``/healthz`` on
``REAPER_METRICS_ADDRESS:REAPER_METRICS_PORT`` (docs/design.md#metrics),
served by the worker's main process, bounded whatever its clients do.
"""

from __future__ import annotations

import io
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import make_wsgi_app

from reaper import metrics, multiproc
from reaper.logs import get_logger, log

# Its lines (metrics.serving) have always been the metrics logger's.
logger = get_logger("metrics")


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
    metrics.registry()  # the main process's own series (zeros) exist before the first scrape
    metrics_app = make_wsgi_app(multiproc.serving_registry(refresh))

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
        multiprocess=bool(multiproc.multiprocess_dir()),
    )
    return Server(server.port, server.close)
