"""An incident: every eligible room at once under a real ``celery -A reaper worker -B``
with Kafka, the deployment's defaults but a 2 s polling interval.

Measured by the database's clock, from the rows themselves: the first closing
(the earliest outbox row), the last closing (the latest realtime row: every
closed room writes one) and the last event on Kafka (the latest
``published_at``, set after the record's own acknowledgement). Every event is
then read back from the topic.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bench.relay import timestamps
from bench.seed import connect, one_row
from bench.worker import Worker, worker_env
from tests.support.kafka import Tansu, create_topic

PROGRESS = """
SELECT (SELECT count(*) FROM messenger.realtime_outbox),
       (SELECT count(*) FROM messenger.integration_outbox),
       (SELECT count(*) FROM messenger.integration_outbox WHERE published_at IS NULL)
"""

TIMES = """
SELECT extract(epoch FROM (SELECT max(created_at) FROM messenger.realtime_outbox)
                          - (SELECT min(created_at) FROM messenger.integration_outbox)),
       extract(epoch FROM (SELECT max(published_at) FROM messenger.integration_outbox)
                          - (SELECT min(created_at) FROM messenger.integration_outbox))
"""


def progress(url: str) -> tuple[int, int, int]:
    conn = connect(url)
    with conn, conn.cursor() as cur:
        cur.execute(PROGRESS)
        closed, events, pending = one_row(cur)
    conn.close()
    return closed, events, pending


def run(url: str, workdir: Path, rooms: int, prepare: Callable[[], None]) -> dict:
    """``prepare`` makes ``rooms`` rooms eligible at once (the worker is warm by then)."""
    broker = Tansu().start()
    topic = f"bench.incident.{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, topic)
    env = worker_env(
        url,
        REAPER_POLLING_INTERVAL="2",
        REAPER_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
        REAPER_CONFERENCE_ENDED_TOPIC=topic,
    )
    worker = Worker(env, workdir / "worker-incident.log", beat=True, concurrency=2)
    try:
        worker.start()
        worker.wait_for('"cycle.completed"', 60)  # beat ticks, imports are warm
        prepare()
        deadline = time.monotonic() + 900
        while True:
            closed, events, pending = progress(url)
            if closed >= rooms and pending == 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"incident: {closed} of {rooms} closed, {pending} pending")
            time.sleep(0.5)
        published = len(timestamps(broker.bootstrap, topic, expect=events, timeout=120))
    finally:
        worker.stop()
        broker.stop()
    if published != events:
        raise RuntimeError(f"incident: {published} conferences on Kafka for {events} events")
    conn = connect(url)
    with conn, conn.cursor() as cur:
        cur.execute(TIMES)
        to_closed, to_kafka = (float(v) for v in one_row(cur))
    conn.close()
    return {
        "rooms": rooms,
        "events": events,
        "to_closed_s": to_closed,
        "to_kafka_s": to_kafka,
        "ratio": to_kafka / to_closed,
    }
