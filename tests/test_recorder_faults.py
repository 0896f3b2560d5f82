"""The recorder can never break a cycle (docs/design.md#the-recorder-stop-signal).

A fake recorder on a raw socket misbehaves in every way a peer can: garbage
instead of HTTP, a reset, silence, a trickle of one byte at a time, a
redirect, a truncated or a huge body, TLS asked of a plain server. Each time
the cycle completes, the room stays ended, the stop pass gives up within its
deadline, the failure is logged and counted; a signal not taken is retried by
a later pass, with back-off, within the retry window. Any other unexpected
error in a phase is ``phase.failed``, counted, and the cycle still finishes.

The trickling recorder is the one a per-read timeout cannot bound: through the
real CLI and worker, ``reaper reap --once`` ends within its bound beside it and
a worker's cycles keep their pace; and 8 lanes drain 20,000 recorded rooms
beside a recorder that refuses connections, without waiting for a connection.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from sqlalchemy import text

from reaper import budgets, metrics
from reaper import cycle as cycle_module
from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.events import CycleCompleted, PhaseFailed, RecorderPassCompleted
from reaper.phases import reap_batch
from reaper.recorder import StopPass
from tests.support import factory as f
from tests.support.facts import FactRecorder, count_events, log_events, output_events, wired_bus
from tests.support.figures import figure
from tests.support.kafka import create_topic
from tests.support.ports import free_port
from tests.support.processes import Worker, run_cli

pytestmark = pytest.mark.long  # minutes: started first (tests/support/runner.py)

FAILED_METRIC = "messenger_conf_reaper_recorder_stop_failed_total"
# Beyond a call's overall deadline (one recorder timeout), a stop pass claims and
# marks (milliseconds); the rest is a thread woken late on a CPU shared with the
# test beside it. Under the second timeout a call with no overall deadline takes.
PASS_MARGIN_S = 1.5
# `reaper reap --once` beyond its stop pass: the process's start (its imports), its
# cycle and its exit, on a CPU shared with the test beside it. Before the stop
# signals had their own bound, the process had not exited 60 s later.
PROCESS_S = 8.0

OK = b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
# Under the default REAPER_RECORDER_TIMEOUT (2 s): every read gets a byte in time.
TRICKLE_GAP = 1.5
ANSWERS = {
    "garbage": b"GARBAGE\r\n",
    "redirect": (
        b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:1/x\r\nContent-Length: 0\r\n\r\n"
    ),
    "truncated": b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nonly a little",
    "bad-status": b"HTTP/1.1 abc Nope\r\n\r\n",
    "endless-header": b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 200_000 + b"\r\n\r\n",
}


@dataclass
class RawRecorder:
    """Answers each connection as ``mode`` says; counts the requests it saw."""

    mode: str
    port: int = 0
    requests: list[bytes] = field(default_factory=list)
    sock: socket.socket | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.mode == "tls" else "http"
        return f"{scheme}://127.0.0.1:{self.port}/media"

    def serve(self) -> None:
        assert self.sock is not None
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def read_request(self, conn: socket.socket) -> bytes:
        """The whole request: closing a socket with unread bytes sends a reset
        instead of the answer, which would test the kernel, not the client."""
        data = conn.recv(65536)
        if self.mode == "tls":  # a ClientHello, not HTTP
            return data
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                return data
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(body) < length:
            more = conn.recv(65536)
            if not more:
                break
            body += more
        return head + b"\r\n\r\n" + body

    def answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                self.requests.append(self.read_request(conn))
                if self.mode == "reset":  # RST instead of an answer
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif self.mode == "silent":
                    time.sleep(3)
                elif self.mode == "huge":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 104857600\r\n\r\n")
                    chunk = b"x" * 65536
                    for _ in range(1600):  # 100 MiB, if anyone read it all
                        conn.sendall(chunk)
                elif self.mode == "ok":
                    conn.sendall(OK)
                elif self.mode == "trickle":  # a valid answer, one byte at a time
                    for byte in OK:
                        conn.sendall(bytes([byte]))
                        time.sleep(TRICKLE_GAP)
                elif self.mode != "tls":  # tls: the plain bytes the client sent are garbage
                    conn.sendall(ANSWERS[self.mode])
            except OSError:
                pass


@pytest.fixture
def raw_recorder(request) -> Iterator[RawRecorder]:
    recorder = RawRecorder(request.param)
    recorder.sock = socket.socket()
    recorder.sock.bind(("127.0.0.1", 0))
    recorder.sock.listen(64)
    recorder.port = recorder.sock.getsockname()[1]
    threading.Thread(target=recorder.serve, daemon=True).start()
    yield recorder
    recorder.sock.close()


def seed_recorded_room(engine, as_of=None):
    with engine.begin() as conn:
        room = f.conference(conn, as_of=as_of or f.T0, idle=timedelta(minutes=5))
        recording = f.recording(conn, room["id"], status="Recording")
    return room, recording


MODES = [
    "garbage",
    "reset",
    "silent",
    "trickle",
    "redirect",
    "truncated",
    "bad-status",
    "endless-header",
    "tls",
    "huge",
]


@pytest.mark.parametrize("raw_recorder", MODES, indirect=True)
def test_nothing_the_recorder_does_escapes_the_stop_signal(settings, engine, raw_recorder, caplog):
    caplog.set_level("INFO", "reaper")
    # 2 s, the default: a trickle's reads each get their byte in time
    settings = settings.model_copy(
        update={"recorder_url": raw_recorder.url, "recorder_timeout": timedelta(seconds=2)}
    )
    room, recording = seed_recorded_room(engine, as_of=f.db_now(engine))
    bus = wired_bus(settings, engine)
    facts = FactRecorder(bus, CycleCompleted, PhaseFailed, RecorderPassCompleted)
    before = metrics.sample(FAILED_METRIC)
    result = Reaper(settings, engine=engine, bus=bus).run_cycle()
    assert raw_recorder.requests == []  # the cycle sends nothing itself
    started = time.monotonic()
    StopPass(settings, engine=engine, bus=bus).run()
    took = time.monotonic() - started
    assert result["empty_timeout_count"] == 1 and result["skipped"] is False
    assert not facts.of(PhaseFailed)
    [end] = facts.of(CycleCompleted)
    assert end.errors == 0
    [sent] = facts.of(RecorderPassCompleted)
    assert sent.requested == 1 and sent.unsent == 0
    with engine.connect() as conn:
        assert f.session_row(conn, room["id"])["status"] == "Ended"
    if raw_recorder.mode in ("huge", "truncated"):
        # a 200 is a signal taken; the body is not read (nor waited for)
        assert metrics.sample(FAILED_METRIC) == before
        assert sent.taken == 1
        # not waited for: a call that read on would end at its deadline, one timeout
        assert took < settings.recorder_timeout.total_seconds(), took
        return
    assert metrics.sample(FAILED_METRIC) == before + 1
    [failed] = log_events(caplog, "recorder.stop_failed")
    assert failed["recording_id"] == recording["id"]
    # one call's overall deadline: one recorder timeout
    assert took < settings.recorder_timeout.total_seconds() + PASS_MARGIN_S, took


@pytest.mark.process
@pytest.mark.parametrize("raw_recorder", ["garbage"], indirect=True)
def test_reap_once_completes_whatever_the_recorder_answers(engine, raw_recorder):
    """Measured before: GARBAGE made stop_all raise BadStatusLine; the phase ended
    after its first batch and `reaper reap --once` exited with a traceback."""
    now = f.db_now(engine)
    with engine.begin() as conn:
        rooms = [f.conference(conn, as_of=now, idle=timedelta(minutes=5)) for _ in range(3)]
        for room in rooms:
            f.recording(conn, room["id"], status="Recording")
        stuck = f.conference(conn, as_of=now, status="Provisioning", age=timedelta(minutes=5))
    done = run_cli(
        "reap",
        "--once",
        "--json",
        env={"REAPER_RECORDER_URL": raw_recorder.url, "REAPER_BATCH_SIZE": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    result = json.loads(done.stdout)
    assert (result["empty_timeout_count"], result["provision_failed_count"]) == (3, 1)
    assert count_events(done.stderr, "recorder.stop_failed") == 3
    assert count_events(done.stderr, "cycle.completed") == 1
    with engine.connect() as conn:
        assert f.session_row(conn, stuck["id"])["status"] == "Failed"


def test_an_unexpected_error_in_a_phase_is_counted_and_the_cycle_goes_on(
    settings, engine, facts, monkeypatch
):
    now = f.db_now(engine)
    with engine.begin() as conn:
        empty = f.conference(conn, as_of=now, idle=timedelta(minutes=5))
        stuck = f.conference(conn, as_of=now, status="Provisioning", age=timedelta(minutes=5))
        stale = f.conference(conn, as_of=now, idle=timedelta(hours=5), participants=1)
    real = reap_batch  # the cycle calls it by the name it imported

    def broken(queries, phase, *args, **kwargs):
        if phase.name == "provision_timeout":
            raise KeyError("a bug, not the database")
        return real(queries, phase, *args, **kwargs)

    monkeypatch.setattr(cycle_module, "reap_batch", broken)
    before = metrics.sample("messenger_conf_reaper_errors_total")
    result = Reaper(settings, engine=engine).run_cycle()
    assert (result["empty_timeout_count"], result["stale_timeout_count"]) == (1, 1)
    assert result["provision_failed_count"] == 0
    [failed] = facts.of(PhaseFailed)
    assert failed.phase == "provision_timeout" and failed.error.startswith("KeyError")
    [end] = facts.of(CycleCompleted)
    assert end.errors == 1
    assert metrics.sample("messenger_conf_reaper_errors_total") == before + 1
    assert metrics.sample("messenger_conf_reaper_run_total", {"result": "failed"}) >= 1
    with engine.connect() as conn:
        assert f.statuses(conn)[stuck["id"]] == ("Provisioning", None)
        assert f.statuses(conn)[empty["id"]][0] == f.statuses(conn)[stale["id"]][0] == "Ended"


class FlakyRecorder:
    """An HTTP recorder that fails the first ``failures`` calls with 500."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[float] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/media"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                self.calls.append(time.monotonic())
                if len(self.calls) <= self.failures:
                    conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n")
                else:
                    conn.sendall(OK)


def recording_row(engine, recording_id: str) -> dict:
    with engine.connect() as conn:
        return dict(
            conn.execute(
                text("SELECT * FROM messenger.call_recordings WHERE id = :id"), {"id": recording_id}
            )
            .mappings()
            .one()
        )


@pytest.mark.process
def test_a_signal_not_taken_is_retried_with_backoff_within_the_window(engine):
    recorder = FlakyRecorder(failures=2)
    # back-off: 5 recorder timeouts (2.5 s), doubling
    env = {"REAPER_RECORDER_URL": recorder.url, "REAPER_RECORDER_TIMEOUT": "0.5"}
    now = f.db_now(engine)
    _, recording = seed_recorded_room(engine, as_of=now)
    with engine.begin() as conn:  # closed 20 min ago: outside the 15 min window
        old, old_recording = f.conference(conn, as_of=now - timedelta(minutes=20)), None
        conn.execute(
            text(
                "UPDATE messenger.conference_sessions SET status = 'Ended',"
                " end_reason = 'EmptyTimeout', ended_at = :t WHERE id = :id"
            ),
            {"t": now - timedelta(minutes=20), "id": old["id"]},
        )
        old_recording = f.recording(conn, old["id"], status="Recording")

    first = run_cli("reap", "--once", env=env)  # the signal after the commit: refused
    assert first.returncode == 0, first.stderr
    row = recording_row(engine, recording["id"])
    assert row["stop_requested_at"] is None and row["stop_attempts"] == 1
    assert len(recorder.calls) == 1

    # Not due yet: a stop pass now calls no one. In this process, not another
    # `reap --once`: a process's start alone (2-3 s under load) could outlast the
    # back-off, and the retry would then be due.
    settings = Settings(recorder_url=recorder.url, recorder_timeout=timedelta(seconds=0.5))
    early = StopPass(settings, engine=engine).run()
    assert time.monotonic() - recorder.calls[0] < 5 * 0.5  # within the back-off
    assert early.requested == 0 and len(recorder.calls) == 1
    deadline = time.monotonic() + 20
    while recording_row(engine, recording["id"])["stop_requested_at"] is None:
        assert time.monotonic() < deadline, "never retried"
        time.sleep(0.3)
        retried = run_cli("reap", "--once", env=env)
        assert retried.returncode == 0, retried.stderr
    row = recording_row(engine, recording["id"])
    assert row["stop_attempts"] == 2 and len(recorder.calls) == 3  # 500, 500, then taken
    gaps = [b - a for a, b in zip(recorder.calls, recorder.calls[1:], strict=False)]
    assert gaps[0] >= 2.5 and gaps[1] >= 5.0, gaps  # 2.5 s, then 5 s: exponential
    # outside the window: never tried
    assert recording_row(engine, old_recording["id"])["stop_attempts"] == 0
    figure(
        f"stop signal refused twice, retried after {gaps[0]:.1f}s and "
        f"{gaps[1]:.1f}s (back-off 2.5 s doubling), taken on the third call"
    )


@pytest.mark.process
@pytest.mark.parametrize("raw_recorder", ["trickle"], indirect=True)
def test_reap_once_beside_a_trickling_recorder_ends_within_its_bound(engine, raw_recorder):
    """Measured before: the stop signals ran on the drain's reporting thread with a
    per-read timeout; `reaper reap --once` printed its result after 4.6 s and had
    not exited 60 s later (its threads read the trickle on)."""
    now = f.db_now(engine)
    with engine.begin() as conn:
        for _ in range(3):
            room = f.conference(conn, as_of=now, idle=timedelta(minutes=5))
            f.recording(conn, room["id"], status="Recording")
    timeout = 2.0  # REAPER_RECORDER_TIMEOUT's default; the trickle sends a byte every 1.5 s
    started = time.monotonic()
    env = {"REAPER_RECORDER_URL": raw_recorder.url, "REAPER_RECORDER_TIMEOUT": str(timeout)}
    done = run_cli("reap", "--once", "--json", env=env)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["empty_timeout_count"] == 3
    assert len(raw_recorder.requests) == 3
    assert count_events(done.stderr, "recorder.stop_failed") == 3
    [sent] = output_events(done.stderr, "recorder.pass_completed")
    assert (sent["requested"], sent["taken"], sent["failed"]) == (3, 0, 3)
    # each call's overall deadline is one recorder timeout; the pass's bound
    # (budgets.stop_pass) three. The rest: the process's start and its cycle.
    assert sent["duration_ms"] < (timeout + PASS_MARGIN_S) * 1000, sent
    stop_pass = budgets.stop_pass(Settings(recorder_timeout=timedelta(seconds=timeout)))
    assert took < stop_pass.total_seconds() + PROCESS_S, took
    figure(
        f"reap --once beside a trickling recorder: exited after {took:.1f}s "
        f"(stop pass {sent['duration_ms']} ms)"
    )


def seed_rooms_closing_one_per_second(engine, seconds: int) -> None:
    """Rooms with a running recording, one becoming eligible each second from now
    (REAPER_EMPTY_ROOM_GRACE, 90 s, after its last activity)."""
    now = f.db_now(engine)
    with engine.begin() as conn:
        for k in range(seconds):
            room = f.conference(conn, as_of=now + timedelta(seconds=k), idle=timedelta(seconds=90))
            f.recording(conn, room["id"], status="Recording")


def cycles_completed(worker: Worker, window: float) -> int:
    """cycle.completed lines the worker logs over ``window`` seconds of its run."""
    worker.wait_for(lambda out: '"cycle.completed"' in out, 30, "a first cycle")
    before = worker.output().count('"cycle.completed"')
    time.sleep(window)
    return worker.output().count('"cycle.completed"') - before


@pytest.mark.process
def test_a_workers_cycles_keep_their_pace_beside_a_trickling_recorder(
    tmp_path, engine, kafka_broker
):
    """Measured before (30 s, REAPER_POLLING_INTERVAL=1s, Kafka unreachable): 28
    cycles without a recorder, 11 beside the trickling one (each batch with a
    recording held every lane for two recorder timeouts). Kafka answers here: a
    relay waiting on an unreachable one takes a worker slot of its own, which is
    the relay's pace, not the recorder's (docs/design.md#the-recorder-stop-signal)."""
    # 12 cycles a window at the interval's pace: the stalled pace measured before
    # (11 of 28) falls far under the bound below, a kept pace (20 of 20) well in it
    window = 12.0
    interval = 1.0
    topic = f"pace.conference-ended.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    env = {
        "REAPER_POLLING_INTERVAL": str(interval),
        "REAPER_RECORDER_TIMEOUT": "2",
        "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker,
        "REAPER_CONFERENCE_ENDED_TOPIC": topic,
    }
    paces: dict[str, int] = {}
    for mode in ("ok", "trickle"):
        recorder = RawRecorder(mode)
        recorder.sock = socket.socket()
        recorder.sock.bind(("127.0.0.1", 0))
        recorder.sock.listen(64)
        recorder.port = recorder.sock.getsockname()[1]
        threading.Thread(target=recorder.serve, daemon=True).start()
        with engine.begin() as conn:
            conn.execute(
                text(
                    "TRUNCATE messenger.call_recordings, messenger.reaper_runs,"
                    " messenger.conference_sessions CASCADE"
                )
            )
        seed_rooms_closing_one_per_second(engine, int(window) + 40)
        worker = Worker(tmp_path, {**env, "REAPER_RECORDER_URL": recorder.url}, name=mode)
        try:
            worker.start()
            paces[mode] = cycles_completed(worker, window)
            output = worker.output()
        finally:
            worker.stop()
            recorder.sock.close()
        # the signals went out, from the worker's reaper.stop_recordings task
        assert '"recorder.pass_completed"' in output
        with engine.connect() as conn:
            taken = conn.execute(
                text(
                    "SELECT count(*) FROM messenger.call_recordings"
                    " WHERE stop_requested_at IS NOT NULL"
                )
            ).scalar()
        if mode == "ok":
            assert taken > 0
        else:
            assert taken == 0 and '"recorder.stop_failed"' in output
    figure(
        f"cycles completed in {window:.0f}s at REAPER_POLLING_INTERVAL=1s: "
        f"{paces['ok']} beside a recorder that answers, {paces['trickle']} beside a "
        f"trickling one"
    )
    # the interval's pace, give or take a shared CPU
    assert paces["ok"] >= window / interval / 2, paces
    assert paces["trickle"] >= 0.75 * paces["ok"], paces


@pytest.mark.process
def test_eight_lanes_drain_20000_recorded_rooms_beside_a_refusing_recorder(engine):
    """REAPER_DRAIN_LANES at its maximum, every room with a running recording, a
    recorder that refuses connections: the cycle never waits for a connection of
    its pool (no `QueuePool limit ... timed out`), and the stop pass after it
    ends within its bound."""
    now = f.db_now(engine)
    with engine.begin() as conn:
        f.bulk_conferences(conn, 20_000, as_of=now)
        conn.execute(
            text(
                """
                INSERT INTO messenger.call_recordings (id, conference_id, status, created_at)
                SELECT gen_random_uuid(), s.id, 'Recording', s.created_at
                FROM messenger.conference_sessions s;
                ANALYZE messenger.conference_sessions, messenger.call_recordings
                """
            )
        )
    refusing = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    env = {"REAPER_RECORDER_URL": refusing, "REAPER_DRAIN_LANES": "8"}
    done = run_cli("reap", "--once", "--json", env=env, timeout=300)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert "QueuePool limit" not in done.stderr and "Traceback" not in done.stderr
    result = json.loads(done.stdout)
    assert result["empty_timeout_count"] == 20_000 and result["failed_count"] == 0
    with engine.connect() as conn:
        open_rooms = conn.execute(
            text("SELECT count(*) FROM messenger.conference_sessions WHERE status <> 'Ended'")
        ).scalar()
    assert open_rooms == 0
    [sent] = output_events(done.stderr, "recorder.pass_completed")
    assert sent["requested"] > 0 and sent["taken"] == 0
    assert count_events(done.stderr, "recorder.stop_failed") == sent["failed"] == sent["requested"]
    assert sent["duration_ms"] < (3 * 2 + 5) * 1000, sent  # budgets.stop_pass, its marks
    figure(
        f"20,000 recorded rooms at 8 lanes, recorder refusing: reap --once "
        f"{took:.1f}s (cycle {result['duration_ms']} ms, stop pass {sent['duration_ms']} ms: "
        f"{sent['requested']} signals sent, {sent['unsent']} left due)"
    )


@pytest.mark.process
@pytest.mark.parametrize("raw_recorder", ["ok"], indirect=True)
def test_a_cycle_that_closes_a_recorded_room_sends_its_stop_right_after(
    tmp_path, engine, raw_recorder
):
    """The cycle's last link enqueues reaper.stop_recordings: the signal goes out
    within about a second of the close, long before the task's next beat tick
    (every 5 recorder timeouts: 10 s here)."""
    env = {
        "REAPER_POLLING_INTERVAL": "1",
        "REAPER_RECORDER_TIMEOUT": "2",
        "REAPER_RECORDER_URL": raw_recorder.url,
    }
    worker = Worker(tmp_path, env, name="stops").start()
    try:
        worker.wait_for(
            lambda out: '"recorder.pass_completed"' in out or "reaper.stop_recordings" in out,
            30,
            "the first stop pass",
        )
        time.sleep(1.0)  # past the beat's first tick of stop-recordings
        now = f.db_now(engine)
        with engine.begin() as conn:
            room = f.conference(conn, as_of=now, idle=timedelta(minutes=5))
            recording = f.recording(conn, room["id"], status="Recording")
        deadline = time.monotonic() + 15
        while recording_row(engine, recording["id"])["stop_requested_at"] is None:
            assert time.monotonic() < deadline, worker.output()[-3000:]
            time.sleep(0.1)
        with engine.connect() as conn:
            ended_at = f.session_row(conn, room["id"])["ended_at"]
        lag = recording_row(engine, recording["id"])["stop_requested_at"] - ended_at
        output = worker.output()
    finally:
        worker.stop()
    assert len(raw_recorder.requests) == 1
    assert "reaper.stop_recordings" in output and '"recorder.stop_requested"' in output
    figure(f"stop signal taken {lag.total_seconds():.2f}s after its room's close")
    assert lag.total_seconds() < 4.0, lag  # the next beat tick would be up to 10 s away
