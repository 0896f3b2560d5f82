"""Two ``worker -B`` replicas on the same Redis key prefix and database, short
intervals, rooms continually becoming eligible: every eligible room is reaped
exactly once, with exactly one integration event (in the outbox and on Kafka).

Default run: 20 s of load; ``REAPER_SOAK=1``: 5 minutes."""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, text

from tests.support import factory as f
from tests.support.facts import output_events
from tests.support.figures import figure
from tests.support.kafka import create_topic, read_topic
from tests.support.ledger import books, tally
from tests.support.processes import Worker, wait_until

SOAK = os.environ.get("REAPER_SOAK") == "1"
LOAD_SECONDS = 300 if SOAK else 20


def now() -> datetime:
    return datetime.now(UTC)


class Seeder(threading.Thread):
    """Rooms that become eligible a second or three after they are written."""

    def __init__(self, engine: Engine, seconds: float) -> None:
        super().__init__(daemon=True)
        self.engine, self.seconds = engine, seconds
        self.rooms: dict[str, str] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(11)
        end = time.monotonic() + self.seconds
        try:
            while time.monotonic() < end:
                with self.engine.begin() as conn:
                    kind = rng.choice(["empty", "empty", "provisioning", "stale"])
                    t = now()
                    if kind == "empty":
                        row = f.conference(conn, as_of=t, idle=timedelta(0))
                    elif kind == "provisioning":
                        row = f.conference(conn, status="Provisioning", as_of=t, age=timedelta(0))
                    else:
                        row = f.conference(conn, as_of=t, idle=timedelta(0), participants=1)
                        f.participant(conn, row["id"], joined_at=t - timedelta(seconds=1))
                self.rooms[row["id"]] = kind
                time.sleep(rng.uniform(0.02, 0.15))
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.mark.soak
def test_two_worker_replicas_reap_each_room_exactly_once(engine, kafka_broker, tmp_path):
    topic = f"replicas.conference-ended.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    env = {
        "REAPER_POLLING_INTERVAL": "1",
        "REAPER_EMPTY_ROOM_GRACE": "1",
        "REAPER_PROVISION_TIMEOUT": "1",
        "REAPER_STALE_LIVE_TIMEOUT": "3",
        "REAPER_BATCH_SIZE": "7",
        "REAPER_RELAY_INTERVAL": "1",
        "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker,
        "REAPER_CONFERENCE_ENDED_TOPIC": topic,
        "REAPER_KAFKA_TIMEOUT": "4",
    }
    workers = [Worker(tmp_path, env, name=f"replica-{x}") for x in "ab"]
    seeder = Seeder(engine, LOAD_SECONDS)
    try:
        for worker in workers:
            worker.start()
        seeder.start()
        seeder.join()
        assert seeder.error is None, seeder.error
        wait_until(lambda: tally(engine).live == 0, 60, "every room reaped")
        ended = tally(engine).ended
        records = read_topic(kafka_broker, topic, expect=ended, timeout=60, settle=2)
    finally:
        logs = [w.output() for w in workers]
        for worker in workers:
            worker.stop()

    # one event each (on Kafka or pending), one push row each, nothing unexpected
    found = books(engine, bootstrap=kafka_broker, topic=topic)
    verdict = found.assert_clean()
    assert found.tally.ended + found.tally.failed == len(seeder.rooms)
    reaped = [
        Counter(e["conference_id"] for e in output_events(log, "conference.reaped")) for log in logs
    ]
    both = reaped[0] + reaped[1]
    assert set(both) == set(seeder.rooms)
    assert max(both.values()) == 1, "a room reaped twice"
    assert all(reaped), "one replica never reaped anything: the test would prove nothing"
    on_kafka = Counter(r.value["payload"]["conferenceId"] for r in records)
    ended_ids = {c for c, kind in seeder.rooms.items() if kind != "provisioning"}
    assert set(on_kafka) == ended_ids
    duplicates = sum(n - 1 for n in on_kafka.values())
    assert duplicates == 0
    with engine.connect() as conn:
        unpublished = conn.execute(
            text("SELECT count(*) FROM messenger.integration_outbox WHERE published_at IS NULL")
        ).scalar_one()
    assert unpublished == 0
    cycles = [len(output_events(log, "cycle.completed")) for log in logs]
    skipped = [len(output_events(log, "cycle.skipped")) for log in logs]
    kinds = Counter(seeder.rooms.values())
    figure(
        f"two worker -B replicas, {LOAD_SECONDS}s of load: {len(seeder.rooms)} "
        f"rooms ({dict(kinds)}), reaped by a/b {len(reaped[0])}/{len(reaped[1])}, "
        f"twice 0; cycles a/b {cycles[0]}/{cycles[1]}, lock-skips a/b "
        f"{skipped[0]}/{skipped[1]}; {len(records)} Kafka records for {len(ended_ids)} "
        f"ended rooms, duplicates {duplicates}, lost {len(verdict.lost)} (the ledger)"
    )
