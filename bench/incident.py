"""An incident: every eligible room at once under a real ``celery -A reaper worker -B``
with Kafka, the deployment's defaults but a 2 s polling interval.

Measured from the rows themselves, by the database's clock: the first closing
(the earliest realtime row: every closed room writes one, and an ended room's
Kafka event in the same statement) and the last closing (the latest one); and
the last event on Kafka, by the latest record's timestamp (set by the producer
at its send, on the same host: the relay deletes an outbox row at its
acknowledgement, so no row keeps that time). Every event is read back from the
topic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from bench.relay import timestamps
from bench.seed import connect, one
from bench.worker import relaying

# closed rooms, their Kafka events (an ended room's realtime ConferenceEnded row
# is written with its event), events still to send
PROGRESS = """
SELECT (SELECT count(*) FROM messenger.realtime_outbox),
       (SELECT count(*) FROM messenger.realtime_outbox WHERE kind = 'ConferenceEnded'),
       (SELECT count(*) FROM messenger.integration_outbox WHERE published_at IS NULL)
"""

# every closing's time (a batch's rows share their transaction's)
CLOSINGS = "SELECT extract(epoch FROM created_at) FROM messenger.realtime_outbox"


def progress(url: str) -> tuple[int, int, int]:
    closed, events, pending = one(url, PROGRESS)
    return closed, events, pending


def run(url: str, workdir: Path, rooms: int, prepare: Callable[[], None]) -> dict:
    """``prepare`` makes ``rooms`` rooms eligible at once (the worker is warm by then)."""
    log = workdir / "worker-incident.log"
    with relaying(url, log, REAPER_POLLING_INTERVAL="2") as (bootstrap, topic):
        prepare()
        deadline = time.monotonic() + 900
        while True:
            closed, events, pending = progress(url)
            if closed >= rooms and pending == 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"incident: {closed} of {rooms} closed, {pending} pending")
            time.sleep(0.5)
        sent = timestamps(bootstrap, topic, expect=events, timeout=120)
        published = len(sent)
    if published != events:
        raise RuntimeError(f"incident: {published} conferences on Kafka for {events} events")
    conn = connect(url)
    with conn, conn.cursor() as cur:
        cur.execute(CLOSINGS)
        closings = [float(t) for (t,) in cur.fetchall()]
    conn.close()
    first, last = min(closings), max(closings)
    on_kafka = sorted(ms / 1000 for ms in sent.values())
    to_closed, to_kafka = last - first, on_kafka[-1] - first
    return {
        "rooms": rooms,
        "events": events,
        "to_closed_s": to_closed,
        "to_kafka_s": to_kafka,
        "ratio": to_kafka / to_closed,
        # for the chart (bench/charts.py): epoch seconds of every closing and event
        "closings": sorted(closings),
        "on_kafka": on_kafka,
    }
