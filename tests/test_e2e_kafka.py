"""End to end: `celery -A reaper worker -B` reaps a seeded room and the relay puts it
on Kafka without any manual call; and the development broker helper."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, text

from tests.conftest import BIN, ROOT
from tests.support import factory as f
from tests.support.facts import output_events
from tests.support.figures import figure
from tests.support.kafka import create_topic, read_topic
from tests.support.ports import free_port
from tests.support.processes import Worker, wait_until


def now() -> datetime:
    return datetime.now(UTC)


def published(engine: Engine, rooms: list[dict]) -> bool:
    """Every room ended and the outbox empty: each room's row, written in the
    transaction that ended it, was deleted at its own Kafka acknowledgement (the
    caller reads the events on Kafka)."""
    with engine.connect() as conn:
        ended = all(f.statuses(conn)[room["id"]][0] == "Ended" for room in rooms)
        return ended and f.outbox(conn) == []


def outbox_rows(engine: Engine) -> list[dict]:
    with engine.connect() as conn:
        return f.outbox(conn)


def written_at(engine: Engine) -> dict[str, datetime]:
    """When each conference's events were written (the realtime row is written
    with the Kafka one, at the same now(), and stays)."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT conference_id::text, created_at FROM messenger.realtime_outbox")
        )
        return {conference: created for conference, created in rows}


def worker_env(kafka_broker: str, topic: str, relay_interval: str) -> dict[str, str]:
    return {
        "REAPER_POLLING_INTERVAL": "1",
        "REAPER_EMPTY_ROOM_GRACE": "2",
        "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker,
        "REAPER_CONFERENCE_ENDED_TOPIC": topic,
        "REAPER_KAFKA_TIMEOUT": "4",
        "REAPER_RELAY_INTERVAL": relay_interval,
    }


def test_seeded_empty_room_reaches_kafka_right_after_its_cycle(engine, kafka_broker, tmp_path):
    """The relay's beat interval is a minute here: only the relay enqueued by the
    cycle itself can bring the event to Kafka within seconds."""
    topic = f"e2e.conference-ended.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    worker = Worker(tmp_path, worker_env(kafka_broker, topic, "60")).start()
    rooms = []
    try:
        for _ in range(5):  # one at a time: each is reaped by its own cycle
            with engine.begin() as conn:
                rooms.append(f.conference(conn, as_of=now(), idle=timedelta(seconds=10)))
            wait_until(lambda: published(engine, rooms), 20, "published")
        records = read_topic(kafka_broker, topic, expect=len(rooms))
    finally:
        worker.stop()
    assert sorted(r.value["payload"]["conferenceId"] for r in records) == sorted(
        room["id"] for room in rooms
    )
    for record in records:
        assert record.key == record.value["aggregateId"] == record.value["payload"]["dealId"]
        assert record.value["payload"]["endReason"] == "EmptyTimeout"
        assert set(record.headers) == {"event-id", "event-type", "correlation-id", "traceparent"}
        # the cycle's trace goes on in the consumer: its trace id is the run id
        version, trace_id, span_id, flags = record.headers["traceparent"].split("-")
        assert (version, flags, len(span_id)) == ("00", "01", 16)
        assert trace_id == uuid.UUID(record.headers["correlation-id"]).hex
    out = worker.output()
    assert "reaper.relay_outbox" in out and '"relay.published"' in out
    assert '"kafka.producer_closed"' in out  # flushed and closed on shutdown

    written = written_at(engine)
    to_record = [
        r.timestamp_ms / 1000 - written[r.value["payload"]["conferenceId"]].timestamp()
        for r in records
    ]
    figure(
        "reap commit -> record on Kafka (worker -B, relay enqueued by the cycle): "
        f"sent after median {statistics.median(to_record) * 1000:.0f} ms "
        f"(max {max(to_record) * 1000:.0f} ms), n={len(records)}"
    )


def test_a_drains_events_reach_kafka_while_it_still_closes_rooms(engine, kafka_broker, tmp_path):
    """The relay's beat interval is an hour and the drain is one long cycle (a
    batch of 10, one lane): only the relay passes its batches ask for can put
    events on Kafka before its last closing; at its end alone they would all
    come after it."""
    rooms = 6000
    topic = f"e2e.drain.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    env = {
        **worker_env(kafka_broker, topic, "3600"),
        "REAPER_BATCH_SIZE": "10",
        "REAPER_DRAIN_LANES": "1",
    }
    worker = Worker(tmp_path, env).start()
    try:
        # warm: a cycle ran, so the drain below is one cycle of its own
        wait_until(lambda: output_events(worker.output(), "cycle.completed"), 30, "a cycle")
        with engine.begin() as conn:
            f.bulk_conferences(conn, rooms, as_of=now())
        records = read_topic(kafka_broker, topic, expect=rooms, timeout=90)
        wait_until(lambda: not outbox_rows(engine), 30, "the outbox empty")
    finally:
        worker.stop()
    closings = sorted(t.timestamp() for t in written_at(engine).values())
    on_kafka = sorted(r.timestamp_ms / 1000 for r in records)
    assert len(closings) == rooms and len({r.event_id for r in records}) == rooms
    # the drain lasted long enough to tell (else the figure proves nothing)
    assert closings[-1] - closings[0] > 2.0, closings[-1] - closings[0]
    before_last = sum(1 for t in on_kafka if t < closings[-1])
    assert on_kafka[0] < closings[-1] and before_last > 0
    figure(
        f"drain of {rooms} rooms in {closings[-1] - closings[0]:.1f}s (relay"
        f" tick an hour): first event on Kafka {on_kafka[0] - closings[0]:.1f}s after the"
        f" first closing, {before_last} of {rooms} on Kafka before the last closing, the"
        f" last {on_kafka[-1] - closings[-1]:.1f}s after it"
    )


def test_beat_relays_rows_without_a_cycle(engine, kafka_broker, tmp_path):
    topic = f"e2e.beat.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    env = {**worker_env(kafka_broker, topic, "1"), "REAPER_POLLING_INTERVAL": "3600"}
    worker = Worker(tmp_path, env).start()
    try:
        event_id = str(uuid.uuid4())
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO messenger.integration_outbox (event_id, topic, message_key,"
                    " payload) VALUES (:e, :t, 'deal-1', CAST(:p AS jsonb))"
                ),
                {"e": event_id, "t": topic, "p": json.dumps({"eventId": event_id})},
            )
        # gone from the outbox: deleted at its acknowledgement; on Kafka, read below
        wait_until(lambda: not outbox_rows(engine), 20, "published by the beat's relay")
        [record] = read_topic(kafka_broker, topic, expect=1)
    finally:
        worker.stop()
    assert (record.event_id, record.key, record.headers["event-id"]) == (
        event_id,
        "deal-1",
        event_id,
    )


def test_celery_call_relay_outbox_by_hand(engine, kafka_broker, tmp_path):
    topic = f"e2e.call.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    env = {**worker_env(kafka_broker, topic, "3600"), "REAPER_POLLING_INTERVAL": "3600"}
    worker = Worker(tmp_path, env).start()
    try:
        with engine.begin() as conn:
            for key in ("deal-1", "deal-2"):
                event_id = str(uuid.uuid4())
                conn.execute(
                    text(
                        "INSERT INTO messenger.integration_outbox (event_id, topic, message_key,"
                        " payload) VALUES (:e, :t, :k, CAST(:p AS jsonb))"
                    ),
                    {"e": event_id, "t": topic, "k": key, "p": json.dumps({"eventId": event_id})},
                )
        called = subprocess.run(
            [str(BIN / "celery"), "-A", "reaper", "call", "reaper.relay_outbox", "--expires", "60"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        task_id = called.stdout.strip()
        worker.wait_for(
            lambda out: f"reaper.relay_outbox[{task_id}] succeeded" in out, 30, "the relay task"
        )
        assert len(read_topic(kafka_broker, topic, expect=2)) == 2
    finally:
        worker.stop()
    line = next(
        ln
        for ln in worker.output().splitlines()
        if f"reaper.relay_outbox[{task_id}] succeeded" in ln
    )
    assert "{'published': 2, 'failed': 0, 'parked': 0, 'pending': 0}" in line


@pytest.mark.process
def test_dev_kafka_script_starts_creates_the_topic_and_stops(tmp_path):
    port = free_port()
    pidfile = tmp_path / "kafka.pid"
    script = [sys.executable, str(ROOT / "scripts" / "dev_kafka.py")]
    topic = "pin.messenger.conference-ended.v1"
    args = ["start", "--port", str(port), "--topic", topic, "--pidfile", str(pidfile)]
    try:
        subprocess.run([*script, *args], check=True, timeout=60, capture_output=True)
        pid = int(pidfile.read_text())
        again = subprocess.run([*script, *args], timeout=60, capture_output=True, text=True)
        assert again.returncode == 0 and "already listens" in again.stderr
        assert int(pidfile.read_text()) == pid  # the second start started nothing
        from kafka.admin import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=f"127.0.0.1:{port}")
        try:
            assert topic in admin.list_topics()
        finally:
            admin.close()
    finally:
        subprocess.run(
            [*script, "stop", "--pidfile", str(pidfile)],
            check=True,
            timeout=30,
            capture_output=True,
        )
    assert not pidfile.exists()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # the broker is gone
