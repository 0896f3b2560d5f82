"""Every connection encrypted and verified, against real TLS servers made here.

A private CA signs the certificates of a TLS-only Redis (Debian's redis-server
7.0, with a password) and of stunnel in front of Tansu (tests/support/tls.py
says why Tansu cannot serve TLS itself). The real ``celery -A reaper worker -B``
closes a room over them and its event is read back over TLS by kafka-python and
librdkafka; ``celery call`` and Flower go through the same verified TLS. Each
misconfiguration (another CA, an expired certificate, another host name, a SASL
login refused) is said in one line, and no output of these tests holds any of
the secrets they used.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer
from confluent_kafka import TopicPartition as RdTopicPartition
from sqlalchemy import Engine, text

from tests.support import factory as f
from tests.support.kafka import Tansu, create_topic, read_topic
from tests.support.ports import free_port, wait_for_port
from tests.support.processes import CELERY, REAPER, ROOT, Worker, wait_until
from tests.support.tls import SERVER_HOST, WRONG_HOST, Pki, Stunnel, TlsRedis, secret_free

pytestmark = pytest.mark.process

REDIS_PASSWORD = "redis-Secret-7f3a"
SASL_PASSWORD = "sasl-Secret-91bc"
FLOWER_AUTH = "ops:flower-Secret-5d2e"
SECRETS = [REDIS_PASSWORD, SASL_PASSWORD, FLOWER_AUTH.split(":")[1]]


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    made = Pki.create()
    try:
        yield made
    finally:
        made.destroy()


@pytest.fixture(scope="module")
def tls_redis(pki: Pki) -> Iterator[TlsRedis]:
    server = TlsRedis(pki, password=REDIS_PASSWORD)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def expired_redis(pki: Pki) -> Iterator[TlsRedis]:
    server = TlsRedis(pki, expired=True, password=REDIS_PASSWORD)
    try:
        yield server.start()
    finally:
        server.stop()


def tls_kafka(pki: Pki, *, authentication: bool) -> Iterator[str]:
    """Tansu behind stunnel; yields the TLS bootstrap address (stunnel's)."""
    tls_port = free_port()
    broker = Tansu(advertised_port=tls_port, authentication=authentication)
    terminator = Stunnel(pki, broker.port, tls_port)
    try:
        broker.start()
        terminator.start()
        yield f"{SERVER_HOST}:{tls_port}"
    finally:
        terminator.stop()
        broker.stop()


@pytest.fixture(scope="module")
def kafka_tls(pki: Pki) -> Iterator[str]:
    yield from tls_kafka(pki, authentication=False)


@pytest.fixture(scope="module")
def kafka_sasl(pki: Pki) -> Iterator[str]:
    """Tansu requiring SASL (SCRAM-SHA-256/512 are all it offers) behind stunnel."""
    yield from tls_kafka(pki, authentication=True)


def broker_env(url: str, cafile: Path) -> dict[str, str]:
    return {"REAPER_BROKER_URL": url, "REAPER_BROKER_SSL_CAFILE": str(cafile)}


def kafka_env(bootstrap: str, cafile: Path, topic: str) -> dict[str, str]:
    return {
        "REAPER_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "REAPER_KAFKA_SECURITY_PROTOCOL": "SSL",
        "REAPER_KAFKA_SSL_CAFILE": str(cafile),
        "REAPER_CONFERENCE_ENDED_TOPIC": topic,
        "REAPER_KAFKA_TIMEOUT": "4",
    }


def call(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CELERY, "-A", "reaper", "call", *args, "--expires", "60"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,  # a publish gives up after Celery's retry policy, seconds
    )


def get(url: str, auth: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def json_events(output: str, event: str) -> list[dict]:
    found = []
    for line in output.splitlines():
        if line.startswith("{") and f'"event":"{event}"' in line:
            found.append(json.loads(line))
    return found


def read_with_librdkafka(bootstrap: str, cafile: Path, topic: str, expect: int) -> list[dict]:
    """The topic as librdkafka reads it over TLS (the CA and the host name checked)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "security.protocol": "ssl",
            "ssl.ca.location": str(cafile),
            "ssl.endpoint.identification.algorithm": "https",
            "group.id": f"test-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "socket.timeout.ms": 10_000,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([RdTopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        found: list[dict] = []

        def more() -> bool:
            message = consumer.poll(0.5)
            if message is not None:
                assert message.error() is None, message.error()
                found.append(json.loads(message.value() or b"null"))
            return len(found) >= expect

        wait_until(more, 20, "librdkafka reads the events", interval=0)
        return found
    finally:
        consumer.close()


def published(engine: Engine, room: dict) -> bool:
    """The room ended and its event's row gone: deleted at its own acknowledgement
    (the row is written in the transaction that ends the room)."""
    with engine.connect() as conn:
        return f.statuses(conn)[room["id"]][0] == "Ended" and f.outbox(conn) == []


def test_worker_beat_senders_celery_call_and_flower_over_verified_tls(
    engine, pki, tls_redis, kafka_tls, tmp_path
):
    """One worker run proves the whole chain: beat's ticks and the cycle's sends
    over rediss:// (verified), the relay's producer over TLS, `celery call` and
    Flower through the same TLS; nothing says kombu fell back to no checks, and
    no output holds a secret."""
    topic = f"tls.conference-ended.{uuid.uuid4().hex[:8]}"
    security: dict[str, Any] = {"security_protocol": "SSL", "ssl_cafile": str(pki.ca)}
    create_topic(kafka_tls, topic, **security)
    metrics_port, flower_port = free_port(), free_port()
    env = {
        **broker_env(tls_redis.url(), pki.ca),
        **kafka_env(kafka_tls, pki.ca, topic),
        "REAPER_POLLING_INTERVAL": "1",
        "REAPER_EMPTY_ROOM_GRACE": "2",
        "REAPER_RELAY_INTERVAL": "60",  # the cycle's own send brings the relay
        "REAPER_METRICS_PORT": str(metrics_port),
        "REAPER_METRICS_ADDRESS": "127.0.0.1",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"),
    }
    worker = Worker(tmp_path, env).start()
    flower_log = tmp_path / "flower.log"
    flower: subprocess.Popen[bytes] | None = None
    outputs: list[str] = []
    try:
        with engine.begin() as conn:
            room = f.conference(conn, as_of=datetime.now(UTC), idle=timedelta(seconds=10))
        wait_until(lambda: published(engine, room), 30, "the room's event published over TLS")
        by_kafka_python = read_topic(kafka_tls, topic, expect=1, **security)
        by_librdkafka = read_with_librdkafka(kafka_tls, pki.ca, topic, expect=1)

        by_hand = call(env, "reaper.relay_outbox")  # a sender outside the worker
        assert by_hand.returncode == 0, by_hand.stderr
        outputs += [by_hand.stdout, by_hand.stderr]

        # Celery answers Flower's inspection (its `conf`) by masking the URL
        # through a kombu Connection made for that alone (celery.app.utils),
        # never connected, which logs kombu's rediss warning: read before it.
        before_flower = worker.output()
        with open(flower_log, "wb") as log:
            flower = subprocess.Popen(
                [CELERY, "-A", "reaper", "flower", "--address=127.0.0.1", f"--port={flower_port}"],
                cwd=ROOT,
                env={**os.environ, **env, "FLOWER_BASIC_AUTH": FLOWER_AUTH},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for_port(flower_port, timeout=30)
        base = f"http://127.0.0.1:{flower_port}"
        workers = wait_until(
            lambda: [
                name
                for name in json.loads(get(f"{base}/api/workers", FLOWER_AUTH)[1] or "{}")
                if name.startswith("reaper@")
            ],
            30,
            "Flower sees the worker through rediss://",
        )
        pages = {
            "broker": get(f"{base}/broker", FLOWER_AUTH),  # Flower's own Redis client
            "worker": get(f"{base}/worker/{workers[0]}", FLOWER_AUTH),  # its configuration
            "workers": get(f"{base}/api/workers", FLOWER_AUTH),
        }
        health = get(f"http://127.0.0.1:{metrics_port}/healthz")
    finally:
        if flower is not None:
            flower.terminate()
            flower.wait(timeout=20)
        worker.stop()

    assert [r.value["payload"]["conferenceId"] for r in by_kafka_python] == [room["id"]]
    assert [v["payload"]["conferenceId"] for v in by_librdkafka] == [room["id"]]
    assert pages["broker"][0] == 200 and "reaper.relay" in pages["broker"][1]
    assert pages["worker"][0] == 200 and "broker_use_ssl" in pages["worker"][1]
    assert health[0] == 200
    out = worker.output()
    flower_out = flower_log.read_text(errors="replace")
    # the room's cycle, beat's ticks and the relay went through; kombu never
    # fell back to its unchecked TLS
    assert json_events(out, "relay.published")
    for text_ in (before_flower, flower_out):
        assert "Secure redis scheme specified" not in text_
    assert "broker.tls_refused" not in out + flower_out
    outputs += [out, flower_out, health[1], *(body for _, body in pages.values())]
    assert secret_free("\n".join(outputs), SECRETS) == []


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("another CA", "self-signed certificate in certificate chain"),
        ("expired", "certificate has expired"),
        ("another host", "Hostname mismatch, certificate is not valid for 'localhost'."),
    ],
)
def test_celery_call_refuses_a_broker_certificate_in_one_line(
    case, reason, pki, tls_redis, expired_redis
):
    url, cafile = {
        "another CA": (tls_redis.url(), pki.other_ca),
        "expired": (expired_redis.url(), pki.ca),
        "another host": (tls_redis.url(host=WRONG_HOST), pki.ca),
    }[case]
    refused = call(broker_env(url, cafile), "reaper.reap")
    assert refused.returncode == 1
    assert refused.stdout == ""  # no task id: nothing was sent, in plain text or else
    port = url.rsplit(":", 1)[1].split("/")[0]
    host = WRONG_HOST if case == "another host" else SERVER_HOST
    assert refused.stderr.splitlines() == [
        f"broker.tls_refused host={host} port={port} reason={reason}"
    ]
    assert secret_free(refused.stderr, SECRETS) == []


def test_worker_and_beat_say_an_expired_broker_certificate_and_close_nothing(
    engine, pki, expired_redis, tmp_path
):
    """What an operator sees when Redis's certificate expires under the worker
    (docs/runbooks): one broker.tls_refused line per process (the consumer, the
    beat), Celery's retries, and nothing closed."""
    with engine.begin() as conn:
        room = f.conference(conn, as_of=datetime.now(UTC), idle=timedelta(minutes=10))
    env = {**broker_env(expired_redis.url(), pki.ca), "REAPER_POLLING_INTERVAL": "1"}
    worker = Worker(tmp_path, env).start(wait_ready=False)  # it never gets a broker
    try:
        worker.wait_for(
            lambda out: len(json_events(out, "broker.tls_refused")) >= 2,
            30,
            "the consumer and the beat say the refusal",
        )
    finally:
        worker.stop()
    refusals = json_events(worker.output(), "broker.tls_refused")
    assert {(r["host"], r["port"], r["reason"]) for r in refusals} == {
        (SERVER_HOST, expired_redis.port, "certificate has expired")
    }
    assert len(refusals) == 2  # once per process while it lasts, not per retry
    with engine.connect() as conn:
        assert f.session_row(conn, room["id"])["status"] == "Active"
    assert secret_free(worker.output(), SECRETS) == []


def pending_row(engine: Engine, topic: str) -> str:
    event_id = str(uuid.uuid4())
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messenger.integration_outbox (event_id, topic, message_key,"
                " payload) VALUES (:e, :t, 'deal-tls', CAST(:p AS jsonb))"
            ),
            {"e": event_id, "t": topic, "p": json.dumps({"eventId": event_id})},
        )
    return event_id


def run_relay_once(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [REAPER, "relay", "--once", "--json"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,  # bootstrap and the diagnosis: within REAPER_KAFKA_TIMEOUT each
    )


def test_kafka_refusals_are_said_in_one_line_and_cost_the_rows_nothing(
    engine, pki, kafka_tls, kafka_sasl
):
    """A certificate signed by another CA, and a SASL login the broker refuses:
    each is one relay.kafka_unavailable line naming its cause, counted by cause
    (messenger_outbox_relay_kafka_unavailable_total, ConferenceEndedRelayKafkaRefused);
    the row is backed off, never charged an attempt, never parked."""
    topic = f"tls.refused.{uuid.uuid4().hex[:8]}"
    event_id = pending_row(engine, topic)
    base = {**kafka_env(kafka_tls, pki.other_ca, topic), "REAPER_KAFKA_TIMEOUT": "2"}
    sasl = {
        **kafka_env(kafka_sasl, pki.ca, topic),
        "REAPER_KAFKA_TIMEOUT": "2",
        "REAPER_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "REAPER_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "REAPER_KAFKA_SASL_USERNAME": "reaper",
        "REAPER_KAFKA_SASL_PASSWORD": SASL_PASSWORD,
    }
    # one after the other: one relay pass runs at a time (the relay lock)
    wrong_ca, refused_login = run_relay_once(base), run_relay_once(sasl)

    for run, cause, says in (
        (wrong_ca, "tls", f"the TLS certificate of {kafka_tls} was refused: "),
        (refused_login, "authentication", "not the SASL login (SCRAM-SHA-512 as 'reaper')"),
    ):
        assert run.returncode == 1, run.stderr
        [line] = json_events(run.stderr, "relay.kafka_unavailable")
        assert line["cause"] == cause and says in line["error"], line
        assert secret_free(run.stdout + run.stderr, SECRETS) == []
    assert "unable to get local issuer certificate" in wrong_ca.stderr
    with engine.connect() as conn:
        [row] = [r for r in f.outbox(conn) if str(r["event_id"]) == event_id]
    assert row["attempts"] == 0 and row["parked_at"] is None and row["published_at"] is None
