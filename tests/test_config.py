"""Bad input at start: a table over every ``REAPER_*`` variable.

Each wrong type, range or combination is refused by :func:`load_settings` with
one line naming the variable; a representative subset is also run through the
real ``reaper`` CLI and ``celery -A reaper worker``: non-zero exit, exactly one
line on stderr naming the variable, no traceback, no secret echoed back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import make_url

from reaper.config import (
    COMPRESSION_PACKAGES,
    ENV_PREFIX,
    ConfigError,
    Settings,
    load_settings,
)
from tests.support import factory as f
from tests.support.kafka import create_topic
from tests.support.processes import Worker, run_cli, wait_until

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
SECRET = "hunter2-canary"

BAD_DURATIONS = ["", "abc", "0", "-5", "PT0S", "10:00", "1e3", "PT-5S", "nan", "9" * 20]

# variable -> values that must be refused at start
INVALID: dict[str, list[str]] = {
    "DATABASE_URL": [
        "",
        "not a url",
        "mysql://db.example/reaper",
        "postgresql://",
        "postgresql://127.0.0.1:99999/reaper",
        "postgres://",
        # another driver than the reaper's: refused before anything imports it
        f"postgresql+psycopg://reaper:{SECRET}@db.example/reaper",
        "postgresql+asyncpg://db.example/reaper",
        "postgresql+pg8000://db.example/reaper",
    ],
    "BROKER_URL": [
        "",
        "amqp://127.0.0.1//",
        "redis://",
        f"redis://:{SECRET}@h:port/0",
        # kombu would take these over the verified TLS: never weaker than verified
        f"rediss://:{SECRET}@h:6380/0?ssl_cert_reqs=none",
        "rediss://h:6380/0?ssl_check_hostname=false",
        "rediss://h:6380/0?SSL_CA_CERTS=/tmp/any.pem",
    ],
    "BROKER_SSL_CAFILE": ["/nonexistent/ca.pem", "/"],
    "BROKER_KEY_PREFIX": ["with space:", "new\nline", "x" * 129],
    "BROKER_CONNECT_TIMEOUT": [*BAD_DURATIONS, "0.5", "601"],
    "BROKER_TCP_TIMEOUT": [*BAD_DURATIONS, "1", "1.5", "PT11M"],
    "BROKER_HEALTH_CHECK_INTERVAL": [*BAD_DURATIONS, "0.5", "601"],
    "KAFKA_BOOTSTRAP_SERVERS": ["", ",", "kafka", "kafka:0", "kafka:65536", ":9092", "k:90a"],
    "CONFERENCE_ENDED_TOPIC": ["", "a topic", "t" * 250, "tópico"],
    "KAFKA_SECURITY_PROTOCOL": ["", "plaintext", "TLS", "SASL"],
    "KAFKA_SASL_MECHANISM": ["", "GSSAPI", "plain", "OAUTHBEARER"],
    "KAFKA_SSL_CAFILE": ["/nonexistent/ca.pem", "/"],
    "KAFKA_SSL_CERTFILE": ["/nonexistent/cert.pem"],
    "KAFKA_SSL_KEYFILE": ["/nonexistent/key.pem"],
    "KAFKA_SSL_CHECK_HOSTNAME": ["maybe", "2", ""],
    "KAFKA_TIMEOUT": BAD_DURATIONS,
    "RELAY_INTERVAL": BAD_DURATIONS,
    "RELAY_BATCH_SIZE": ["0", "-1", "10001", "ten", "1.5", ""],
    "RELAY_MAX_PASS_DURATION": BAD_DURATIONS,
    "RELAY_BACKOFF_INITIAL": BAD_DURATIONS,
    "RELAY_BACKOFF_MAX": BAD_DURATIONS,
    "RELAY_MAX_ATTEMPTS": ["0", "-1", "1001", "many", "1.5", ""],
    "KAFKA_MAX_REQUEST_SIZE": ["0", "1023", "104857601", "1MB", "1.5", ""],
    "KAFKA_COMPRESSION": ["", "ZSTD", "brotli", "lz4hc", "true", "None", "gzip,zstd"],
    "OUTBOX_RETENTION": BAD_DURATIONS,
    "POLLING_INTERVAL": BAD_DURATIONS,
    "EMPTY_ROOM_GRACE": BAD_DURATIONS,
    "PROVISION_TIMEOUT": BAD_DURATIONS,
    "STALE_LIVE_TIMEOUT": BAD_DURATIONS,
    "BATCH_SIZE": ["0", "-1", "10001", "ten", "1.5", ""],
    "DRAIN_LANES": ["0", "-1", "9", "two", "1.5", ""],
    "LOCK_TTL": BAD_DURATIONS,
    "RUN_LEASE": [*BAD_DURATIONS, "1", "601"],
    "DATABASE_CONNECT_TIMEOUT": [*BAD_DURATIONS, "0.5", "601"],
    "DATABASE_TCP_TIMEOUT": [*BAD_DURATIONS, "0.5", "PT11M"],
    "MAX_RUN_DURATION": BAD_DURATIONS,
    "RECORDER_URL": ["ftp://recorder", "http://", "recorder:8080", f"http://u:{SECRET}@h:x/"],
    "RECORDER_TIMEOUT": BAD_DURATIONS,
    "RECORDER_RETRY_WINDOW": BAD_DURATIONS,
    "METRICS_PORT": ["-1", "65536", "http", "80.5"],
    "METRICS_ADDRESS": ["", "0.0.0.0:9808", "http://h", "not a host", "-h"],
    "MASS_CLOSURE_SHARE": ["0", "-0.1", "1.01", "half", "nan", "inf", ""],
    "MASS_CLOSURE_FLOOR": ["-1", "x", "2.5", ""],
    "OPERATOR": ["", "x" * 201],
}

# Wrong combinations: the environment, and the variable the line must name.
COMBINATIONS: list[tuple[dict[str, str], str]] = [
    ({"EMPTY_ROOM_GRACE": "PT4H"}, "EMPTY_ROOM_GRACE"),
    ({"EMPTY_ROOM_GRACE": "600", "STALE_LIVE_TIMEOUT": "300"}, "STALE_LIVE_TIMEOUT"),
    ({"LOCK_TTL": "30"}, "LOCK_TTL"),
    ({"LOCK_TTL": "10", "MAX_RUN_DURATION": "60"}, "MAX_RUN_DURATION"),
    ({"RUN_LEASE": "120"}, "RUN_LEASE"),
    ({"RUN_LEASE": "50", "LOCK_TTL": "45"}, "LOCK_TTL"),
    ({"RELAY_BACKOFF_INITIAL": "120"}, "RELAY_BACKOFF_MAX"),
    ({"OUTBOX_RETENTION": "3599"}, "OUTBOX_RETENTION"),
    ({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "KAFKA_SASL_MECHANISM"),
    # a CA for a broker reached in plain text: the operator believes it is encrypted
    ({"BROKER_SSL_CAFILE": "/etc/hostname"}, "BROKER_SSL_CAFILE"),
    (
        {
            "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "KAFKA_SASL_MECHANISM": "PLAIN",
            "KAFKA_SASL_PASSWORD": SECRET,
        },
        "KAFKA_SASL_USERNAME",
    ),
    (
        {
            "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "KAFKA_SASL_USERNAME": "reaper",
        },
        "KAFKA_SASL_PASSWORD",
    ),
]

# Any value is a valid value for these; what can be wrong is covered above.
FREE_TEXT = {"KAFKA_SSL_PASSWORD": "a key passphrase may be anything"}

VALID: list[dict[str, str]] = [
    {"POLLING_INTERVAL": "PT90S", "EMPTY_ROOM_GRACE": "1.5", "LOCK_TTL": "P1D"},
    {"MASS_CLOSURE_SHARE": "1", "MASS_CLOSURE_FLOOR": "0", "METRICS_PORT": "0"},
    {"METRICS_ADDRESS": "127.0.0.1"},
    {"OUTBOX_RETENTION": "PT1H"},
    {"METRICS_ADDRESS": "::"},
    {"METRICS_ADDRESS": "worker-1.internal"},
    {"DATABASE_URL": "postgresql://u:p%40ss@db:5432/reaper?sslmode=verify-full"},
    {"BROKER_URL": "rediss://:pw@redis:6380/1", "BROKER_KEY_PREFIX": "{reaper}:"},
    {"BROKER_URL": "rediss://redis:6380/1", "BROKER_SSL_CAFILE": "/etc/hostname"},
    {"KAFKA_BOOTSTRAP_SERVERS": " a:9092 , b:9093 ", "CONFERENCE_ENDED_TOPIC": "x.y-z_1"},
    {"KAFKA_COMPRESSION": "none"},
    {"KAFKA_COMPRESSION": "gzip"},
    {"KAFKA_COMPRESSION": "zstd"},
]


def covered() -> set[str]:
    names = set(INVALID) | set(FREE_TEXT)
    for env, _ in COMBINATIONS:
        names |= set(env)
    return names


def test_the_table_covers_every_setting():
    fields = {name.upper() for name in Settings.model_fields}
    assert fields - covered() == set(), "add the new settings to the table in tests/test_config.py"
    assert covered() - fields == set()


def all_cases() -> list[tuple[dict[str, str], str]]:
    cases = [({name: value}, name) for name, values in INVALID.items() for value in values]
    return cases + COMBINATIONS


def case_id(case: tuple[dict[str, str], str]) -> str:
    env, _ = case
    return ",".join(f"{k}={v!r}"[:40] for k, v in env.items())


def set_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in Settings.model_fields:  # only the session's own (conftest) are kept
        if name not in ("database_url", "broker_url", "broker_key_prefix", "metrics_port"):
            monkeypatch.delenv(ENV_PREFIX + name.upper(), raising=False)
    for name, value in env.items():
        monkeypatch.setenv(ENV_PREFIX + name, value)


@pytest.mark.parametrize("case", all_cases(), ids=[case_id(c) for c in all_cases()])
def test_invalid_value_is_refused_with_one_line_naming_it(monkeypatch, case):
    env, variable = case
    set_env(monkeypatch, env)
    with pytest.raises(ConfigError) as refused:
        load_settings()
    message = str(refused.value)
    assert "\n" not in message
    assert ENV_PREFIX + variable in message
    assert SECRET not in message


@pytest.mark.parametrize("codec", ["snappy", "lz4", "zstd"])
def test_a_codec_without_its_package_is_refused_at_start(monkeypatch, codec):
    from kafka import codec as kafka_codec

    # kafka-python's own check says the package is missing, as on a machine
    # where it is not installed
    monkeypatch.setattr(kafka_codec, f"has_{codec}", lambda: False)
    set_env(monkeypatch, {"KAFKA_COMPRESSION": codec})
    with pytest.raises(ConfigError) as refused:
        load_settings()
    message = str(refused.value)
    assert "\n" not in message
    assert "REAPER_KAFKA_COMPRESSION" in message
    assert COMPRESSION_PACKAGES[codec] in message


@pytest.mark.parametrize("env", VALID, ids=[case_id((v, "")) for v in VALID])
def test_valid_edge_values_are_accepted(monkeypatch, env):
    set_env(monkeypatch, env)
    load_settings()


# The forms users write, and what the reaper connects with: always psycopg2,
# whatever SQLAlchemy's own default driver for the scheme is.
URL_FORMS = {
    "postgresql://u@db/reaper": "postgresql+psycopg2://u@db/reaper",
    "postgres://u:p%40ss@db:5433/reaper": "postgresql+psycopg2://u:p%40ss@db:5433/reaper",
    "postgresql+psycopg2://u@db/reaper?sslmode=verify-full": (
        "postgresql+psycopg2://u@db/reaper?sslmode=verify-full"
    ),
    "postgres://u@db/reaper?sslmode=require&sslrootcert=/ca.pem": (
        "postgresql+psycopg2://u@db/reaper?sslmode=require&sslrootcert=/ca.pem"
    ),
}


@pytest.mark.parametrize("written", list(URL_FORMS))
def test_the_url_forms_users_write_mean_psycopg2(monkeypatch, written):
    set_env(monkeypatch, {"DATABASE_URL": written})
    url = load_settings().database_url
    assert url == URL_FORMS[written]
    assert make_url(url).get_dialect().driver == "psycopg2"


def test_a_url_naming_another_driver_says_which_in_one_line(monkeypatch):
    set_env(monkeypatch, {"DATABASE_URL": f"postgresql+psycopg://u:{SECRET}@db/reaper"})
    with pytest.raises(ConfigError) as refused:
        load_settings()
    message = str(refused.value)
    assert "REAPER_DATABASE_URL: names the driver 'psycopg'" in message
    assert "postgresql://, postgres:// or postgresql+psycopg2://" in message
    assert "\n" not in message and SECRET not in message


# A representative subset through the real entry points.
# Every bad value is refused in process above (the same load_settings every
# entry point calls); each real entry point is run with one of each kind: a
# URL holding a secret, a value of the wrong form, one refused beside another.
PROCESS_CASES = [
    ({"DATABASE_URL": f"postgresql+psycopg://reaper:{SECRET}@db.example/reaper"}, "DATABASE_URL"),
    ({"POLLING_INTERVAL": "10:00"}, "POLLING_INTERVAL"),
    ({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "KAFKA_SECURITY_PROTOCOL"),
]
COMMANDS = {
    "reaper reap --once": [str(BIN / "reaper"), "reap", "--once"],
    "reaper migrate": [str(BIN / "reaper"), "migrate"],
    "celery worker -B": [str(BIN / "celery"), "-A", "reaper", "worker", "-B", "-l", "INFO"],
}


def run(command: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    full = {**os.environ, **{ENV_PREFIX + k: v for k, v in env.items()}}
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=full, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as exc:  # it started instead of refusing
        return -1, str(exc.stdout), str(exc.stderr)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.process
@pytest.mark.parametrize("command", list(COMMANDS))
def test_real_entry_points_refuse_bad_config(command):
    jobs = [(env, variable) for env, variable in PROCESS_CASES]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda c: run(COMMANDS[command], c[0]), jobs))
    for (env, variable), (code, stdout, stderr) in zip(jobs, results, strict=True):
        lines = stderr.strip().splitlines()
        assert code not in (0, -1), (env, code, stderr)
        assert len(lines) == 1, (env, stderr)
        assert ENV_PREFIX + variable in lines[0], (env, stderr)
        assert "Traceback" not in stderr + stdout
        assert SECRET not in stderr + stdout


def test_a_rediss_broker_is_verified_with_its_ca_and_host_name():
    """What Celery's broker_use_ssl gets (celeryconfig): never kombu's unchecked default."""
    import ssl

    from reaper.broker import ssl_options

    plain = Settings(broker_url="redis://redis:6379/0")
    assert ssl_options(plain) is None
    default_cas = Settings(broker_url="rediss://redis:6380/0")
    assert ssl_options(default_cas) == {
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
        "ssl_ca_certs": None,  # the system's CAs
        "ssl_check_hostname": True,
    }
    own_ca = Settings(broker_url="rediss://redis:6380/0", broker_ssl_cafile="/etc/hostname")
    assert ssl_options(own_ca) == {
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
        "ssl_ca_certs": "/etc/hostname",
        "ssl_check_hostname": True,
    }


@pytest.mark.process
def test_the_cli_and_the_worker_run_on_the_url_forms_users_write(
    engine, database_url, tmp_path, kafka_broker
):
    """postgresql:// and postgres:// as libpq writes them: every command and the
    worker connect with psycopg2 (no traceback naming psycopg 3), and a room is
    closed by a worker given the short form. The worker has a real broker: its
    relay sends the room's event, so an ERROR line can only be this test's own
    (with the suite's unreachable default, kafka-python logs "Bootstrap failed"
    at ERROR whenever the relay's pass outlasts the room's closing)."""
    tail = database_url.partition("://")[2]
    for scheme in ("postgresql", "postgres"):
        done = run_cli("status", "--json", env={"REAPER_DATABASE_URL": f"{scheme}://{tail}"})
        assert done.returncode == 0, (scheme, done.stderr)
        assert "Traceback" not in done.stderr and "psycopg'" not in done.stderr
        json.loads(done.stdout)
    with engine.begin() as conn:
        room = f.conference(conn, as_of=datetime.now(UTC), idle=timedelta(minutes=5))
    topic = f"test.conference-ended.{uuid.uuid4().hex[:10]}"
    create_topic(kafka_broker, topic)
    worker = Worker(
        tmp_path,
        {
            "REAPER_DATABASE_URL": f"postgres://{tail}",
            "REAPER_POLLING_INTERVAL": "1",
            "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker,
            "REAPER_CONFERENCE_ENDED_TOPIC": topic,
        },
    ).start()
    try:
        wait_until(lambda: f.session_row_status(engine, room["id"]) == "Ended", 30, "room ended")
    finally:
        worker.stop()
    assert "Traceback" not in worker.output()
    assert " ERROR" not in worker.output()


@pytest.mark.process
def test_a_url_naming_a_driver_not_installed_is_one_line_and_exit_2():
    """psycopg 3 is what SQLAlchemy 2.1 takes for postgresql+psycopg://; it is not
    installed with the reaper, and no command gets as far as importing it."""
    url = f"postgresql+psycopg://reaper:{SECRET}@127.0.0.1/reaper"
    done = run_cli("status", env={"REAPER_DATABASE_URL": url})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "REAPER_DATABASE_URL: names the driver 'psycopg'" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout and SECRET not in done.stderr
