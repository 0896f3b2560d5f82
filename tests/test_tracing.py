"""OpenTelemetry spans: cycle, phase, conference; OTLP only when an endpoint is set."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from reaper import tracing
from reaper.cycle import Reaper
from reaper.phases import EMPTY_ROOM, ORDER, STALE_LIVE
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.processes import ROOT

REAPER = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "reaper")


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert tracing.configure(exporter, batch=False)
    yield exporter
    tracing.shutdown()


@pytest.mark.process
def test_cycle_phase_and_conference_spans_share_the_run_as_trace(
    settings, refusing_database, spans
):
    engine = refusing_database
    now = f.db_now(engine)
    with engine.begin() as conn:
        empty = f.conference(conn, as_of=now, idle=timedelta(seconds=100))
        stale = f.conference(conn, as_of=now, idle=timedelta(hours=5), participants=1)
        poison = f.conference(conn, as_of=now, idle=timedelta(seconds=100))
        f.refuse(conn, poison["id"])
    result = Reaper(settings, engine=engine).run_cycle()
    run_id = result["run_id"]
    finished = spans.get_finished_spans()
    by_name: dict[str, list] = {}
    for span in finished:
        by_name.setdefault(span.name, []).append(span)

    (cycle,) = by_name["reaper.cycle"]
    assert cycle.context.trace_id == uuid.UUID(run_id).int
    assert cycle.parent is None
    assert cycle.attributes["correlationId"] == run_id
    assert cycle.attributes["reaper.empty_timeout_count"] == 1
    assert cycle.attributes["reaper.failed_count"] == 1

    phases = by_name["reaper.phase"]
    assert [p.attributes["reaper.phase"] for p in phases] == list(ORDER)
    for phase in phases:
        assert phase.parent.span_id == cycle.context.span_id
        assert phase.context.trace_id == cycle.context.trace_id
        assert phase.attributes["correlationId"] == run_id

    conferences = {s.attributes["conference_id"]: s for s in by_name["reaper.conference"]}
    assert set(conferences) == {empty["id"], stale["id"], poison["id"]}
    reaped = conferences[empty["id"]]
    assert reaped.attributes["reaper.phase"] == "empty_room"
    assert reaped.attributes["deal_id"] == empty["deal_id"]
    assert reaped.attributes["tenant_id"] == empty["tenant_id"]
    assert reaped.attributes["correlationId"] == run_id
    # eligible 10 s before the cycle's as_of, closed a little later
    assert reaped.attributes["reaper.lateness_seconds"] == pytest.approx(10.0, abs=1.0)
    span_of = {p.attributes["reaper.phase"]: p for p in phases}
    assert reaped.parent.span_id == span_of[EMPTY_ROOM.name].context.span_id
    assert conferences[stale["id"]].parent.span_id == span_of[STALE_LIVE.name].context.span_id
    assert conferences[poison["id"]].status.status_code is StatusCode.ERROR


def test_phases_run_elsewhere_join_the_cycle_trace(settings, engine, spans):
    """As in Celery: each phase by its run id alone, in a Reaper of its own, the end too."""
    cycle = Reaper(settings, engine=engine).start(T0)
    for name in ORDER:
        Reaper(settings, engine=engine).run_phase(name, cycle.run_id)
    Reaper(settings, engine=engine).finish(cycle.run_id)
    finished = spans.get_finished_spans()
    (cycle_span,) = [s for s in finished if s.name == "reaper.cycle"]
    phases = [s for s in finished if s.name == "reaper.phase"]
    assert len(phases) == len(ORDER)
    assert {p.parent.span_id for p in phases} == {cycle_span.context.span_id}


def test_tracing_is_off_without_an_endpoint(monkeypatch):
    for name in tracing.ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert tracing.configure() is False
    assert not tracing.enabled()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.configure() is False


class _Collector(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.mark.process
def test_reap_once_exports_over_otlp_when_an_endpoint_is_set(engine):
    with engine.begin() as conn:
        room = f.conference(conn, as_of=T0, idle=timedelta(seconds=100))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
        }
        done = subprocess.run(
            [REAPER, "reap", "--once", "--json", "--as-of", T0.isoformat()],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    run_id = json.loads(done.stdout)["run_id"]
    paths = {path for path, _ in _Collector.received}
    assert paths == {"/v1/traces"}
    body = b"".join(b for _, b in _Collector.received)
    assert run_id.encode() in body  # correlationId
    assert room["id"].encode() in body  # the conference span
    assert b"reaper.cycle" in body and b"reaper.phase" in body
