"""The recorder stop signal (docs/design.md#the-recorder-stop-signal) against a real HTTP server.

A cycle closes the rooms; the stop pass (the ``reaper.stop_recordings`` task's
code, run here after the cycle as ``reaper reap --once`` runs it) sends the
signals that are due in the database.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sqlalchemy import Engine, text

from reaper import budgets, metrics
from reaper.config import Settings
from reaper.cycle import Reaper
from reaper.events import CycleResult
from reaper.recorder import StopPass
from tests.conftest import BIN, ROOT
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.facts import log_events, wired_bus
from tests.support.ports import free_port

FAILED_METRIC = "messenger_conf_reaper_recorder_stop_failed_total"
# Past budgets.stop_pass, a stop pass only marks what it sent (milliseconds); the
# rest is a thread woken late on a CPU shared with the test beside it. Kept short
# of the hanging recorder's answer (6 s, twice the pass's 3 s) that it must not wait for.
STOP_PASS_MARGIN_S = 2.0


@dataclass
class Call:
    path: str
    headers: dict[str, str]
    body: dict


@dataclass
class Recorder:
    """A fake media-stack recorder: answers ``status`` after ``delay`` seconds."""

    status: int = 202
    delay: float = 0.0
    calls: list[Call] = field(default_factory=list)
    url: str = ""

    def paths(self) -> list[str]:
        return sorted(c.path for c in self.calls)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    state = Recorder()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length) or b"{}")
            state.calls.append(Call(self.path, dict(self.headers.items()), body))
            if state.delay:
                time.sleep(state.delay)
            try:
                self.send_response(state.status)
                self.send_header("Content-Length", "0")
                self.end_headers()
            except OSError:  # the client gave up (timeout test)
                pass

        def log_message(self, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # a whole batch connects at once
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}/media/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def reap(settings: Settings, engine: Engine, as_of=T0) -> CycleResult:
    """A cycle, then a stop pass, in a process configured by ``settings`` (its
    recorder URL above all), as ``reaper reap --once`` runs them."""
    bus = wired_bus(settings, engine)
    result = Reaper(settings, engine=engine, bus=bus).run_cycle(as_of)
    StopPass(settings, engine=engine, bus=bus).run()
    return result


def stop_requested(engine: Engine) -> dict[str, object]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, stop_requested_at FROM messenger.call_recordings"))
        return {str(r.id): r.stop_requested_at for r in rows}


def with_recorder(settings: Settings, url: str, timeout: float = 2.0) -> Settings:
    # The rooms here close at T0, a fixed moment in the past: the retry window
    # reaches back to it (tests/test_recorder_faults.py holds the real window).
    return settings.model_copy(
        update={
            "recorder_url": url,
            "recorder_timeout": timedelta(seconds=timeout),
            "recorder_retry_window": timedelta(days=36500),
        }
    )


def test_active_recordings_get_one_stop_call_each(settings, engine, recorder, caplog):
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5))
        live = f.recording(conn, room["id"], status="Recording")
        stuck = f.conference(conn, status="Provisioning", age=timedelta(minutes=5))
        pending = f.recording(conn, stuck["id"], status="Pending")
        stale = f.conference(conn, idle=timedelta(hours=5), age=timedelta(hours=6), participants=1)
        uploading = f.recording(conn, stale["id"], status="Uploading")
        done = f.conference(conn, idle=timedelta(minutes=5))
        available = f.recording(conn, done["id"], status="Available")
        broken = f.recording(conn, done["id"], status="Failed")
        alive = f.conference(conn, idle=timedelta(seconds=10))
        untouched = f.recording(conn, alive["id"], status="Recording")
    settings = with_recorder(settings, recorder.url)
    result = reap(settings, engine)
    assert result["empty_timeout_count"] == 2 and result["provision_failed_count"] == 1

    by_path = {c.path: c for c in recorder.calls}
    assert len(recorder.calls) == 3 == len(by_path)
    expected = {
        live["id"]: (room["id"], "EmptyTimeout"),
        pending["id"]: (stuck["id"], "Error"),
        uploading["id"]: (stale["id"], "Timeout"),
    }
    for recording_id, (conference_id, reason) in expected.items():
        call = by_path[f"/media/v1/recordings/{recording_id}/stop"]
        assert call.body == {"conferenceId": conference_id, "reason": reason}
        assert call.headers["Idempotency-Key"] == recording_id
        assert call.headers["Content-Type"] == "application/json"
    marks = stop_requested(engine)
    assert all(marks[r] is not None for r in expected)
    assert marks[available["id"]] is None and marks[broken["id"]] is None
    assert marks[untouched["id"]] is None
    assert len(log_events(caplog, "recorder.stop_requested")) == 3

    # Later cycles never call again, even once the room with the live recording ends.
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE messenger.conference_sessions SET last_activity_at = :t WHERE id = :id"),
            {"t": T0 - timedelta(minutes=10), "id": alive["id"]},
        )
    reap(settings, engine, T0 + timedelta(minutes=1))
    assert len(recorder.calls) == 4
    assert recorder.calls[-1].path == f"/media/v1/recordings/{untouched['id']}/stop"
    reap(settings, engine, T0 + timedelta(minutes=2))
    assert len(recorder.calls) == 4


@pytest.mark.parametrize("status", [404, 409])
def test_not_found_and_conflict_count_as_done(settings, engine, recorder, status):
    recorder.status = status
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5))
        rec = f.recording(conn, room["id"])
    failures_before = metrics.sample(FAILED_METRIC)
    reap(with_recorder(settings, recorder.url), engine)
    assert len(recorder.calls) == 1
    assert stop_requested(engine)[rec["id"]] is not None
    assert metrics.sample(FAILED_METRIC) == failures_before


def _failing_recorder_case(settings, engine, url, timeout, caplog) -> tuple[dict, str, float]:
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5))
        rec = f.recording(conn, room["id"])
        other = f.conference(conn, idle=timedelta(minutes=4))
    failures_before = metrics.sample(FAILED_METRIC)
    started = time.monotonic()
    result = reap(with_recorder(settings, url, timeout), engine)
    elapsed = time.monotonic() - started
    assert metrics.sample(FAILED_METRIC) - failures_before == 1  # counted, not only logged
    assert result["empty_timeout_count"] == 2 and result["failed_count"] == 0
    with engine.connect() as conn:
        statuses = f.statuses(conn)
        assert len(f.outbox(conn)) == 2
    assert statuses == {
        room["id"]: ("Ended", "EmptyTimeout"),
        other["id"]: ("Ended", "EmptyTimeout"),
    }
    assert stop_requested(engine)[rec["id"]] is None  # not taken: not marked
    [failed] = log_events(caplog, "recorder.stop_failed")
    assert failed["recording_id"] == rec["id"] and failed["conference_id"] == room["id"]
    return failed, rec["id"], elapsed


def test_server_error_leaves_the_conference_ended(settings, engine, recorder, caplog):
    recorder.status = 500
    failed, _, _ = _failing_recorder_case(settings, engine, recorder.url, 2.0, caplog)
    assert failed["status"] == 500
    assert len(recorder.calls) == 1


def test_timeout_leaves_the_conference_ended(settings, engine, recorder, caplog):
    recorder.delay = 3.0
    failed, _, elapsed = _failing_recorder_case(settings, engine, recorder.url, 0.5, caplog)
    assert failed["error"].split(":")[0] in ("TimeoutError", "URLError", "timeout")
    # gave up at its own timeout: waiting for the answer would take its delay
    assert elapsed < recorder.delay, elapsed


def test_refused_connection_leaves_the_conference_ended(settings, engine, caplog):
    url = f"http://127.0.0.1:{free_port()}"
    failed, _, _ = _failing_recorder_case(settings, engine, url, 2.0, caplog)
    assert failed["error"].split(":")[0] in ("ConnectionRefusedError", "URLError")


def test_a_hanging_recorder_never_holds_the_cycle_and_its_pass_ends_within_its_bound(
    settings, engine, recorder
):
    """A black-holed recorder: the cycle's phases never wait for it (they send
    nothing); the stop pass gives up at its own deadline, threads included."""
    recorder.delay = 6.0
    with engine.begin() as conn:
        for _ in range(settings.batch_size):
            room = f.conference(conn, idle=timedelta(minutes=5))
            f.recording(conn, room["id"])
    settings = with_recorder(settings, recorder.url, 1.0)
    bus = wired_bus(settings, engine)
    started = time.monotonic()
    result = Reaper(settings, engine=engine, bus=bus).run_cycle(T0)
    cycle_took = time.monotonic() - started
    assert result["empty_timeout_count"] == settings.batch_size
    assert recorder.calls == []  # the cycle itself sends nothing
    started = time.monotonic()
    sent = StopPass(settings, engine=engine, bus=bus).run()
    pass_took = time.monotonic() - started
    assert len(recorder.calls) == settings.batch_size == sent.requested  # every one tried
    assert sent.taken == 0 and sent.unsent == 0
    # The pass sends for budgets.stop_pass (three recorder timeouts), then claims
    # and marks nothing more: a margin short of the answer a call would wait for.
    assert pass_took < budgets.stop_pass(settings).total_seconds() + STOP_PASS_MARGIN_S, pass_took
    # no call outlives its pass (the fake recorder's own threads sleep on)
    assert not [t for t in threading.enumerate() if t.name.startswith("recorder")]
    assert cycle_took < recorder.delay, cycle_took  # it never waited for an answer
    assert all(v is None for v in stop_requested(engine).values())


@pytest.mark.process
def test_no_recorder_url_means_no_calls_and_one_warning(settings, engine, database_url):
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5))
        rec = f.recording(conn, room["id"])
    env = {k: v for k, v in os.environ.items() if k != "REAPER_RECORDER_URL"}
    proc = subprocess.run(
        [str(BIN / "reaper"), "reap", "--once", "--as-of", T0.isoformat()],
        cwd=ROOT,
        env={**env, "REAPER_DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if '"recorder.disabled"' in line]
    assert len(warnings) == 1
    with engine.connect() as conn:
        assert f.statuses(conn)[room["id"]] == ("Ended", "EmptyTimeout")
    assert stop_requested(engine)[rec["id"]] is None


def test_recorder_url_with_a_path_and_trailing_slash(settings, engine, recorder):
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5))
        rec = f.recording(conn, room["id"])
    reap(with_recorder(settings, recorder.url + "/"), engine)
    assert recorder.paths() == [f"/media/v1/recordings/{rec['id']}/stop"]


def test_one_pass_at_a_time_another_is_skipped(settings, engine, recorder, caplog):
    """A worker's pass while another holds the stop lock sends nothing and says
    so; the pass of `reaper reap --once` (not exclusive: it holds no worker
    slot) sends beside it."""
    caplog.set_level(logging.INFO, "reaper")
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5))
        rec = f.recording(conn, room["id"])
    settings = with_recorder(settings, recorder.url)
    bus = wired_bus(settings, engine)
    Reaper(settings, engine=engine, bus=bus).run_cycle(T0)
    stop_pass = StopPass(settings, engine=engine, bus=bus)
    with engine.begin() as conn:  # a running pass's lock
        held = conn.execute(
            text(
                "SELECT pg_try_advisory_xact_lock(hashtextextended("
                "'messenger.conference-room-reaper.recorder', 0))"
            )
        ).scalar()
        assert held
        assert stop_pass.running()
        sent = stop_pass.run()
        assert sent.skipped and sent.requested == 0 and recorder.calls == []
        assert len(log_events(caplog, "recorder.pass_skipped")) == 1
        beside = StopPass(settings, engine=engine, bus=bus, exclusive=False).run()
        assert (beside.skipped, beside.taken) == (False, 1)
    assert not stop_pass.running()
    assert stop_requested(engine)[rec["id"]] is not None
    assert stop_pass.run().requested == 0  # taken: never sent again
    assert len(recorder.calls) == 1


def test_a_pass_whose_database_fails_logs_it_and_raises_nothing(settings, recorder, caplog):
    caplog.set_level(logging.INFO, "reaper")
    settings = with_recorder(settings, recorder.url).model_copy(
        update={"database_url": f"postgresql+psycopg2://postgres@127.0.0.1:{free_port()}/none"}
    )
    sent = StopPass(settings).run()
    assert (sent.requested, sent.skipped) == (0, False) and recorder.calls == []
    [failed] = log_events(caplog, "recorder.db_failed")
    assert failed["error"].startswith("OperationalError")
