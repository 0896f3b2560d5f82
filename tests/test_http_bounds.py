"""The worker's ``/metrics`` and ``/healthz`` server is bounded (docs/design.md#metrics):
clients that connect and send nothing, or trickle their request, hold no
thread, are closed after ``REQUEST_TIMEOUT_S``, and never keep a real scrape
or probe from answering; scrapes waiting on the database never keep a probe
waiting."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import text

from reaper.endpoint import HEALTH_THREADS, MAX_GATHERING, METRICS_THREADS, REQUEST_TIMEOUT_S
from tests.support.figures import figure
from tests.support.ports import free_port
from tests.support.processes import Worker, wait_until

pytestmark = pytest.mark.process

IDLE = 40
TRICKLING = 10
# What a real GET may take while the crowd waits (its refresh reads the database).
ANSWER_BOUND_S = 3.0


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:")).split()[1])


def get(port: int, path: str) -> tuple[int, float]:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            resp.read()
            code = resp.status
    except urllib.error.HTTPError as exc:  # a 503 is an answer too
        code = exc.code
    return code, time.monotonic() - started


def closed_by_server(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the server closed ``sock`` (EOF or reset), None if it did not."""
    started = time.monotonic()
    sock.settimeout(timeout)
    try:
        while sock.recv(1024):  # an idle client gets nothing but the close
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


class Trickler(threading.Thread):
    """Sends a request one byte at a time, never finishing it in time."""

    def __init__(self, sock: socket.socket, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.sock, self.stop = sock, stop
        self.sent = 0

    def run(self) -> None:
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" * 4:
            if self.stop.wait(0.3):
                return
            try:
                self.sock.send(bytes([byte]))
            except OSError:  # closed by the server: what the test waits for
                return
            self.sent += 1


def metrics_worker(tmp_path: Path, name: str, interval: int = 1) -> tuple[Worker, int]:
    port = free_port()
    env = {
        "REAPER_POLLING_INTERVAL": str(interval),
        "REAPER_METRICS_PORT": str(port),
        "REAPER_METRICS_ADDRESS": "127.0.0.1",
    }
    return Worker(tmp_path, env, name=name).start(), port


def test_idle_and_trickling_clients_hold_no_thread_and_block_no_scrape(engine, tmp_path):
    assert IDLE + TRICKLING < MAX_GATHERING  # all of them wait for their own timeout
    worker, port = metrics_worker(tmp_path, "http-bounds")
    assert worker.proc is not None
    crowd: list[socket.socket] = []
    stop = threading.Event()
    trickling: list[Trickler] = []
    try:
        wait_until(lambda: get(port, "/healthz")[0] == 200, 30, "healthy")
        get(port, "/metrics")
        baseline = threads_of(worker.proc.pid)

        opened_at = time.monotonic()
        for n in range(IDLE + TRICKLING):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            crowd.append(sock)
            if n >= IDLE:
                trickling.append(Trickler(sock, stop))
                trickling[-1].start()
        time.sleep(0.5)  # every connection accepted and waiting

        metrics_code, metrics_took = get(port, "/metrics")
        health_code, health_took = get(port, "/healthz")
        during = threads_of(worker.proc.pid)
        assert metrics_code == 200 and metrics_took < ANSWER_BOUND_S, metrics_took
        assert health_code == 200 and health_took < ANSWER_BOUND_S, health_took
        # fixed threads: at most /healthz's database read came and went, none per client
        assert during <= baseline + 1, (baseline, during)

        first = closed_by_server(crowd[0], REQUEST_TIMEOUT_S + 10)
        assert first is not None
        first_closed = time.monotonic() - opened_at
        closed_after = [closed_by_server(sock, 5) for sock in crowd[1:]]
        since_open = time.monotonic() - opened_at
        assert all(t is not None for t in closed_after), closed_after.count(None)
        # held for their timeout (not dropped at once), closed soon after it
        assert first_closed > REQUEST_TIMEOUT_S - 0.5, first_closed
        assert since_open < REQUEST_TIMEOUT_S + 5, since_open
        assert all(t.sent > 0 for t in trickling)  # they did trickle, and were closed anyway

        # More idle clients than the server gathers at once: the oldest go at
        # once, and a scrape still answers.
        crowd += [
            socket.create_connection(("127.0.0.1", port), timeout=5)
            for _ in range(MAX_GATHERING + 20)
        ]
        code, flood_took = get(port, "/metrics")
        assert code == 200 and flood_took < ANSWER_BOUND_S, flood_took
        evicted = [closed_by_server(sock, 1) for sock in crowd[-(MAX_GATHERING + 20) :][:20]]
        assert all(t is not None for t in evicted), evicted.count(None)
    finally:
        stop.set()
        for sock in crowd:
            sock.close()
        worker.stop()
    figure(
        f"{IDLE} idle + {TRICKLING} trickling connections: /metrics answered in"
        f" {metrics_took:.2f}s, /healthz in {health_took:.2f}s; worker threads {baseline}"
        f" -> {during} ({METRICS_THREADS} + {HEALTH_THREADS} handlers); all closed by the"
        f" server {first_closed:.1f}-{since_open:.1f}s after they opened (timeout"
        f" {REQUEST_TIMEOUT_S:g}s); {MAX_GATHERING + 20} idle at once: /metrics in"
        f" {flood_took:.2f}s, the 20 oldest closed at once"
    )


def test_healthz_answers_while_scrapes_wait_on_the_database(engine, tmp_path):
    # cycles fail while the table is locked: an interval long enough for
    # /healthz to stay 200 meanwhile, so the answer is checked whole
    worker, port = metrics_worker(tmp_path, "http-stuck-scrapes", interval=5)
    scrapes = METRICS_THREADS + 2  # every /metrics thread busy, and more waiting
    try:
        wait_until(lambda: get(port, "/healthz")[0] == 200, 30, "healthy")
        with engine.connect() as conn, ThreadPoolExecutor(scrapes) as pool:
            # The scrape's refresh counts conferences: it waits on this lock
            # (up to its read budget); /healthz reads no conference.
            conn.execute(text("LOCK TABLE messenger.conference_sessions IN ACCESS EXCLUSIVE MODE"))
            time.sleep(5.5)  # the refresh runs at most every 5 s: the next scrape runs one
            stuck = [pool.submit(get, port, "/metrics") for _ in range(scrapes)]
            time.sleep(1)
            assert not any(f.done() for f in stuck)  # they are waiting on the database
            health_code, health_took = get(port, "/healthz")
            assert health_code == 200 and health_took < ANSWER_BOUND_S, health_took
            conn.rollback()  # the lock goes: the scrapes answer
            answered = [f.result(timeout=30) for f in stuck]
        assert all(code == 200 for code, _ in answered)
    finally:
        worker.stop()
    figure(
        f"{scrapes} scrapes waiting on a locked table: /healthz answered in"
        f" {health_took:.2f}s; the scrapes after {max(t for _, t in answered):.1f}s"
    )
