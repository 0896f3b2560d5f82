"""The campaign's private world, set up as the suite's fault tests set theirs
up (tests/support): its own PostgreSQL (commit timestamps on, for the
one-runner check), Redis and Tansu broker, each behind a proxy whose open
connections a fault can cut with iptables; a recorder whose answers a fault
can spoil; two ``celery -A reaper worker -B`` replicas with short intervals.

Everything it starts it stops in :meth:`World.close`, whatever happened.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine, create_engine

from reaper.db import migrate
from tests.support.kafka import Tansu, create_topic
from tests.support.netfault import Proxy
from tests.support.processes import Worker
from tests.support.services import PrivatePostgres, PrivateRedis

# Short intervals: a fault and its recovery fit in seconds (bounds.py reads these).
ENV = {
    "REAPER_POLLING_INTERVAL": "1",
    "REAPER_RELAY_INTERVAL": "1",
    "REAPER_EMPTY_ROOM_GRACE": "3",
    "REAPER_PROVISION_TIMEOUT": "3",
    "REAPER_STALE_LIVE_TIMEOUT": "30",
    "REAPER_BATCH_SIZE": "5",
    "REAPER_RUN_LEASE": "3",
    "REAPER_LOCK_TTL": "8",
    "REAPER_MAX_RUN_DURATION": "5",
    "REAPER_DATABASE_CONNECT_TIMEOUT": "2",
    "REAPER_DATABASE_TCP_TIMEOUT": "4",
    "REAPER_BROKER_TCP_TIMEOUT": "4",
    "REAPER_BROKER_CONNECT_TIMEOUT": "2",
    "REAPER_KAFKA_TIMEOUT": "3",
    "REAPER_RELAY_BACKOFF_INITIAL": "0.5",
    "REAPER_RELAY_BACKOFF_MAX": "2",
    "REAPER_RECORDER_TIMEOUT": "1",
    "REAPER_RECORDER_RETRY_WINDOW": "600",
    # the campaign's rooms are few; the guard would read a burst of stale rooms
    # as a presence outage, which is not what it tests
    "REAPER_MASS_CLOSURE_SHARE": "1",
    "REAPER_METRICS_PORT": "0",
}
POLLING_INTERVAL_S = 1.0
RUN_LEASE_S = 3.0
GRACE_S = 3.0
PROVISION_S = 3.0
STALE_S = 30.0


class CommitTimestampPostgres(PrivatePostgres):
    """A private PostgreSQL that records each transaction's commit time, so the
    campaign can tell when each run's transitions committed."""

    def _options(self) -> str:
        return super()._options() + " -c track_commit_timestamp=on -c max_connections=200"


class Recorder:
    """The media stack's recorder, as the campaign drives it: it accepts stop
    signals (202), refuses them (``refuse``: 503), or trickles its answer one
    byte at a time slower than the worker's recorder timeout (``trickle``)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/media"
        self.taken: list[str] = []  # request lines answered 202
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="recorder", daemon=True)

    def start(self) -> Recorder:
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(5)
            request = conn.recv(65536).decode(errors="replace")
            mode = self.mode
            if mode == "refuse":
                conn.sendall(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            elif mode == "trickle":
                for byte in b"HTTP/1.1 202 Accepted\r\n":
                    if self._stop.wait(1.5):
                        return
                    conn.sendall(bytes([byte]))
            else:
                conn.sendall(
                    b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
                self.taken.append(request.split("\r\n", 1)[0])

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


class World:
    """The private services, their proxies, the recorder and the two workers."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.topic = f"campaign.conference-ended.{uuid.uuid4().hex[:8]}"
        self.pg: CommitTimestampPostgres | None = None
        self.redis: PrivateRedis | None = None
        self.tansu: Tansu | None = None
        self.proxies: dict[str, Proxy] = {}
        self.recorder: Recorder | None = None
        self.workers: dict[str, Worker] = {}
        self.engine: Engine | None = None
        self.started_workers = 0

    # -- setting up ----------------------------------------------------------------

    def start(self) -> World:
        self.pg = CommitTimestampPostgres()
        self.pg.init()
        self.admin_url = self.pg.url()
        migrate(self.pg.url())
        # The campaign's own statements go straight to the server, never through
        # the proxy the faults cut: what it writes and reads is not the subject.
        self.engine = create_engine(
            self.pg.url(), pool_pre_ping=True, connect_args={"application_name": "campaign"}
        )
        self.redis = PrivateRedis().start()
        self.proxies["postgres"] = Proxy("127.0.0.1", self.pg.port, name="c-pg").start()
        self.proxies["redis"] = Proxy("127.0.0.1", self.redis.port, name="c-redis").start()
        kafka_port = _free_port()
        self.proxies["kafka"] = Proxy("127.0.0.1", kafka_port, name="c-kafka")
        self.tansu = Tansu(kafka_port, advertised_port=self.proxies["kafka"].port).start()
        self.proxies["kafka"].start()
        self.bootstrap = f"127.0.0.1:{self.proxies['kafka'].port}"
        create_topic(self.bootstrap, self.topic)
        self.recorder = Recorder().start()
        self.env = {
            **ENV,
            "REAPER_DATABASE_URL": self.pg.url().replace(
                f":{self.pg.port}/", f":{self.proxies['postgres'].port}/"
            ),
            "REAPER_BROKER_URL": f"redis://127.0.0.1:{self.proxies['redis'].port}/0",
            "REAPER_BROKER_KEY_PREFIX": f"campaign-{uuid.uuid4().hex[:6]}:",
            "REAPER_KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "REAPER_CONFERENCE_ENDED_TOPIC": self.topic,
            "REAPER_RECORDER_URL": self.recorder.url,
        }
        for name in ("a", "b"):
            self.workers[name] = Worker(self.workdir, self.env, name=f"replica-{name}")
            self.start_worker(name)
        return self

    def start_worker(self, name: str, *, wait_ready: bool = True) -> None:
        """(Re)start one replica unless it runs; its log file goes on (appended).
        A heal does not wait for it to be ready (its broker may be down then):
        the probe of the episode's recovery shows when the system works again."""
        if self.workers[name].alive():
            return
        self.workers[name] = Worker(self.workdir, self.env, name=f"replica-{name}")
        self.workers[name].start(ready_timeout=60, wait_ready=wait_ready)
        self.started_workers += 1

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace") for p in sorted(self.workdir.glob("replica-*.log"))
        )

    # -- tearing down --------------------------------------------------------------

    def close(self) -> None:
        """Every process and rule gone, each step whatever the one before did."""
        steps: list[Callable[[], object]] = [
            *(w.stop for w in self.workers.values()),
            *(p.close for p in self.proxies.values()),
            *([self.recorder.close] if self.recorder else []),
            *([self.tansu.stop] if self.tansu else []),
            *([self.redis.stop] if self.redis else []),
            *([self.engine.dispose] if self.engine else []),
            *([self.pg.destroy] if self.pg else []),
        ]
        errors: list[BaseException] = []
        for step in steps:
            try:
                step()
            except BaseException as exc:  # the next step must run too
                errors.append(exc)
        if errors:
            raise errors[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait(seconds: float) -> None:
    time.sleep(max(0.0, seconds))
