"""Dependencies failing under a running ``worker -B``: PostgreSQL restarted in the
middle of a cycle, Redis restarted under the worker, the Kafka broker down.
Each time the service recovers by itself (same worker process, no restart by
hand) and nothing is lost or doubled; the test records what /metrics showed.

PostgreSQL and Redis are private instances on free ports (tests/support/services.py);
Kafka is a private Tansu. Outages are short by default; ``REAPER_SOAK=1``
keeps the Kafka broker down for a full minute.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, create_engine, text

from reaper.db import migrate
from tests.support import factory as f
from tests.support.facts import count_events
from tests.support.figures import figure
from tests.support.kafka import Tansu, create_topic, read_topic
from tests.support.ledger import assert_clean, books, tally
from tests.support.ports import free_port
from tests.support.processes import Worker
from tests.support.services import PrivatePostgres, PrivateRedis, scrape, wait_until

SOAK = os.environ.get("REAPER_SOAK") == "1"
KAFKA_DOWN = 60.0 if SOAK else 12.0
BACKLOG = 100_000 if SOAK else 20_000

RUN_FAILED = 'messenger_conf_reaper_run_total{result="failed"}'
RUN_DONE = 'messenger_conf_reaper_run_total{result="completed"}'
ERRORS = "messenger_conf_reaper_errors_total"
PENDING = "messenger_outbox_pending"
OLDEST = "messenger_outbox_oldest_pending_age_seconds"
PUBLISHED = "messenger_outbox_relay_published_total"


def now() -> datetime:
    return datetime.now(UTC)


def seed_rooms(engine: Engine, count: int) -> list[str]:
    with engine.begin() as conn:
        return [
            f.conference(conn, as_of=now(), idle=timedelta(minutes=5))["id"] for _ in range(count)
        ]


def ended(engine: Engine, ids: list[str]) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM messenger.conference_sessions"
                " WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'Ended'"
            ),
            {"ids": ids},
        ).scalar_one()


def pick(metrics: dict[str, float], *names: str) -> dict[str, float]:
    return {n: metrics.get(n, float("nan")) for n in names}


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres().init()
    try:
        yield pg
    finally:
        pg.destroy()


@pytest.mark.process
def test_postgres_restarted_during_a_cycle(private_pg, tmp_path):
    url = private_pg.url()
    migrate(url)
    engine = create_engine(url, connect_args={"application_name": "fault-test"})
    with engine.begin() as conn:
        f.bulk_conferences(conn, BACKLOG, as_of=now())
    metrics_port = free_port()
    worker = Worker(
        tmp_path,
        {
            "REAPER_DATABASE_URL": url,
            "REAPER_POLLING_INTERVAL": "1",
            "REAPER_BATCH_SIZE": "50",
            "REAPER_METRICS_PORT": str(metrics_port),
            "REAPER_METRICS_ADDRESS": "127.0.0.1",
            # the cycle the crash hit cannot end: its run is taken over one
            # REAPER_RUN_LEASE (10 s, the default) after its last phase
            "REAPER_MAX_RUN_DURATION": "10",
        },
        name="pg-fault",
    ).start()
    try:
        worker.wait_for(lambda out: '"batch.selected"' in out, 30, "a cycle under way")
        live_before = tally(engine).live
        engine.dispose()
        down_at = time.monotonic()
        private_pg.stop("immediate")  # a crash, mid-cycle: no clean goodbye
        during = []
        for _ in range(4):
            time.sleep(1)
            during.append(scrape(metrics_port))
        private_pg.start()
        down = time.monotonic() - down_at
        recovered = wait_until(
            lambda: tally(engine).live == 0, 90, "backlog drained after the restart", 0.5
        )
        out = worker.output()
        after = scrape(metrics_port)
        assert worker.proc is not None and worker.proc.poll() is None  # never restarted
    finally:
        worker.stop()
    final = books(engine)
    verdict = final.assert_clean()
    assert final.tally.ended == final.tally.integration == final.tally.realtime == BACKLOG
    assert live_before > 0  # the crash did hit a cycle with work left
    failed_phases = count_events(out, "phase.failed")
    assert failed_phases >= 1
    seen = during[-1]
    engine.dispose()
    figure(
        f"PostgreSQL crashed (immediate stop) mid-cycle with {live_before} of "
        f"{BACKLOG} rooms left, down {down:.1f}s; worker kept "
        f"running, {failed_phases} phase.failed, drained {recovered:.1f}s after the restart; "
        f"lost {len(verdict.lost)}, duplicated {len(verdict.duplicated)} (the ledger); "
        f"/metrics while down: {pick(seen, RUN_FAILED, ERRORS)}; "
        f"after: {pick(after, RUN_DONE, RUN_FAILED, ERRORS)}"
    )


@pytest.mark.process
def test_redis_restarted_under_the_worker(engine, tmp_path):
    redis = PrivateRedis().start()
    metrics_port = free_port()
    worker = Worker(
        tmp_path,
        {
            "REAPER_BROKER_URL": redis.url,
            "REAPER_POLLING_INTERVAL": "1",
            # Redis keeps nothing on disk: a cycle whose next phase was queued
            # when it stopped has lost its chain, and owns the run until its
            # lease runs out; then the next tick takes it over. 3 s, not the
            # default 10 s: the takeover is the same, the wait shorter.
            "REAPER_MAX_RUN_DURATION": "5",
            "REAPER_RUN_LEASE": "3",
            "REAPER_METRICS_PORT": str(metrics_port),
            "REAPER_METRICS_ADDRESS": "127.0.0.1",
        },
        name="redis-fault",
    ).start()
    try:
        first = seed_rooms(engine, 3)
        wait_until(lambda: ended(engine, first) == 3, 20, "reaped before the fault")
        redis.stop()
        down_at = time.monotonic()
        during = seed_rooms(engine, 5)
        time.sleep(1)
        down_runs = scrape(metrics_port).get(RUN_DONE, 0)
        time.sleep(3)  # three more intervals without a tick
        still = scrape(metrics_port)  # /metrics is served by the worker, not the broker
        assert ended(engine, during) == 0  # no broker, no ticks: nothing moves
        assert still.get(RUN_DONE) == down_runs
        redis.start()
        back = time.monotonic()
        wait_until(lambda: ended(engine, during) == 5, 60, "reaped after Redis came back")
        recovery = time.monotonic() - back
        after = seed_rooms(engine, 3)
        wait_until(lambda: ended(engine, after) == 3, 30, "still reaping afterwards")
        assert worker.proc is not None and worker.proc.poll() is None
        out = worker.output()
        after_runs = scrape(metrics_port).get(RUN_DONE, 0)
    finally:
        worker.stop()
        redis.stop()
    verdict = assert_clean(engine)
    reconnects = out.count("Connection to broker lost")
    left = out.count('"broker.unacked_left_for_redelivery"')
    assert "Unrecoverable error" not in out
    figure(
        f"Redis killed under worker -B for {back - down_at:.1f}s: 5 rooms that "
        f"became eligible meanwhile reaped {recovery:.1f}s after it came back, by the same "
        f"worker process ({reconnects} connection-lost lines, {left} channels closed without "
        f"the unacked restore that crashed Celery 5.7); lost {len(verdict.lost)}, "
        f"duplicated {len(verdict.duplicated)} (the ledger); /metrics: "
        f"{RUN_DONE} flat at {down_runs:.0f} while down (no ticks: the alert "
        f"ConferenceReaperNotRunning fires after two intervals), {after_runs:.0f} after"
    )


@pytest.mark.soak
def test_kafka_broker_down(engine, tmp_path):
    tansu = Tansu().start()
    topic = f"fault.conference-ended.{uuid.uuid4().hex[:8]}"
    create_topic(tansu.bootstrap, topic)
    metrics_port = free_port()
    worker = Worker(
        tmp_path,
        {
            "REAPER_POLLING_INTERVAL": "1",
            "REAPER_RELAY_INTERVAL": "1",
            "REAPER_KAFKA_BOOTSTRAP_SERVERS": tansu.bootstrap,
            "REAPER_CONFERENCE_ENDED_TOPIC": topic,
            "REAPER_KAFKA_TIMEOUT": "2",
            "REAPER_RELAY_BACKOFF_MAX": "4",
            "REAPER_METRICS_PORT": str(metrics_port),
            "REAPER_METRICS_ADDRESS": "127.0.0.1",
        },
        name="kafka-fault",
    ).start()
    try:
        before = seed_rooms(engine, 3)
        wait_until(lambda: unpublished(engine) == 0 and ended(engine, before) == 3, 30, "on Kafka")
        tansu.stop()
        down_at = time.monotonic()
        during: list[str] = []
        samples = []
        while time.monotonic() - down_at < KAFKA_DOWN:
            during += seed_rooms(engine, 2)
            time.sleep(1)
            samples.append(scrape(metrics_port))
        # reaping went on without Kafka: all but the last second's rooms are closed
        wait_until(lambda: ended(engine, during) == len(during), 15, "reaped while Kafka down")
        pending_down = unpublished(engine)
        assert pending_down >= len(during)
        tansu.start()  # same port; memory storage: the topic is created again
        create_topic(tansu.bootstrap, topic)
        back = time.monotonic()
        wait_until(lambda: unpublished(engine) == 0, 90, "outbox drained to Kafka", 0.5)
        drained = time.monotonic() - back
        records = read_topic(tansu.bootstrap, topic, expect=len(during), timeout=30, settle=2)
        # The ledger, from the restarted broker: the rooms sent before the outage
        # went with the first broker's memory, so they are left out.
        verdict = assert_clean(engine, bootstrap=tansu.bootstrap, topic=topic, exclude=before)
        final_metrics = scrape(metrics_port)
        assert worker.proc is not None and worker.proc.poll() is None
    finally:
        worker.stop()
        tansu.stop()
    assert verdict.on_kafka == len(during), verdict.summary()
    on_kafka = [r.value["payload"]["conferenceId"] for r in records]
    lost = sorted(set(during) - set(on_kafka))
    duplicates = len(on_kafka) - len(set(on_kafka))
    # Nothing reached the broker while it was down, so nothing was sent twice.
    assert (lost, duplicates) == ([], 0), (lost, duplicates)
    peak_pending = max(s.get(PENDING, 0) for s in samples)
    peak_age = max(s.get(OLDEST, 0) for s in samples)
    figure(
        f"Kafka broker down {KAFKA_DOWN:.0f}s: {len(during)} rooms reaped "
        f"meanwhile (reaping never waited on Kafka), outbox pending peaked at "
        f"{peak_pending:.0f} (/metrics {PENDING}), oldest pending age up to "
        f"{peak_age:.0f}s; all published {drained:.1f}s after the broker came back, "
        f"duplicates on the topic {duplicates}, lost {len(lost)}; after: "
        f"{pick(final_metrics, PENDING, PUBLISHED)}"
    )


def unpublished(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT count(*) FROM messenger.integration_outbox WHERE published_at IS NULL")
        ).scalar_one()
