"""Validated configuration from the ``REAPER_*`` environment (docs/design.md#configuration).

Every process (worker, beat, CLI) calls :func:`get_settings` once at start; an
invalid value stops it with a single line naming the variable and the rule.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from collections.abc import Callable
from datetime import timedelta
from functools import lru_cache
from typing import Annotated, Literal
from urllib.parse import parse_qsl, urlsplit

from kafka import codec as kafka_codec
from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "REAPER_"


_SECONDS = re.compile(r"[+-]?\d+(\.\d+)?")
_DURATION_RULE = "must be seconds (90) or an ISO 8601 duration (PT90S)"


def _duration(value: object) -> object:
    """Accept seconds or ISO 8601 only; pydantic alone would also take 'HH:MM:SS'."""
    if isinstance(value, str):
        text = value.strip()
        if _SECONDS.fullmatch(text):
            return float(text)
        if not text.upper().startswith(("P", "-P", "+P")):
            raise ValueError(_DURATION_RULE)
        return text
    return value


def _positive(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise ValueError("must be a positive duration (seconds like 90, or ISO 8601 like PT90S)")
    return value


def _url(*schemes: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as exc:
            raise ValueError(f"is not a valid URL ({exc})") from None
        if parts.scheme not in schemes or not parts.hostname:
            raise ValueError(f"must be a URL with a host and scheme {' or '.join(schemes)}")
        return value

    return check


def _readable_file(value: str) -> str:
    try:
        with open(value, "rb"):
            pass
    except OSError as exc:
        raise ValueError(f"must be a readable file ({exc.strerror})") from None
    return value


def _no_tls_in_query(value: str) -> str:
    """kombu takes ``ssl_*`` query parameters of the URL over the app's TLS options:
    ``?ssl_cert_reqs=none`` would turn verification off without a word."""
    query = urlsplit(value).query
    if any(key.lower().startswith("ssl_") for key, _ in parse_qsl(query)):
        raise ValueError(
            "must not carry ssl_* parameters: the broker's TLS is verified, with "
            "REAPER_BROKER_SSL_CAFILE naming the CA"
        )
    return value


_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


def _listen_address(value: str) -> str:
    """An IP address or a host name to bind to (no port, no scheme)."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not _HOSTNAME.fullmatch(value):
            raise ValueError("must be an IP address or host name, without a port") from None
    return value


def _bootstrap(value: str) -> str:
    servers = [s.strip() for s in value.split(",") if s.strip()]
    if not servers:
        raise ValueError("must list at least one host:port")
    for server in servers:
        host, _, port = server.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"must be host:port[,host:port...] (bad entry {server!r})")
    return ",".join(servers)


Duration = Annotated[timedelta, BeforeValidator(_duration), AfterValidator(_positive)]


# The one database driver the reaper runs with: it hands libpq its connection
# bounds (budgets.Peer) and reads psycopg2's errors. SQLAlchemy maps a bare
# postgresql:// to its own default driver, which is psycopg 3 from SQLAlchemy
# 2.1 on (not installed here), and does not know postgres:// at all; both are
# how libpq and most platforms write the URL, so both mean psycopg2 here.
DATABASE_DRIVER = "psycopg2"
DATABASE_SCHEMES = ("postgresql", "postgres")


def _database_url(value: str) -> str:
    """A PostgreSQL URL on the reaper's driver: ``postgresql://``, ``postgres://``
    and ``postgresql+psycopg2://`` all become ``postgresql+psycopg2://``; a URL
    that names another driver is refused before anything imports it."""
    scheme, separator, rest = value.partition("://")
    dialect, _, driver = scheme.partition("+")
    if separator and dialect in DATABASE_SCHEMES and driver not in ("", DATABASE_DRIVER):
        raise ValueError(
            f"names the driver {driver!r}, which the reaper does not run with: write "
            f"postgresql://, postgres:// or postgresql+{DATABASE_DRIVER}:// "
            f"({DATABASE_DRIVER} is installed with the reaper)"
        )
    _url(*DATABASE_SCHEMES, f"postgresql+{DATABASE_DRIVER}")(value)
    return f"postgresql+{DATABASE_DRIVER}://{rest}"


# The worker's role deletes published outbox rows only through a function that
# keeps every row published within the last hour (migration 0009): a shorter
# retention would fail every retention pass.
OUTBOX_RETENTION_FLOOR = timedelta(hours=1)


# The package kafka-python needs for a codec (gzip needs none): zstandard is a
# dependency of the project, the default codec's; another is the operator's to
# install.
COMPRESSION_PACKAGES = {"snappy": "python-snappy", "lz4": "lz4", "zstd": "zstandard"}


def compression_available(codec: str) -> bool:
    """Whether kafka-python can compress with ``codec`` in this installation."""
    checks: dict[str, Callable[[], bool]] = {
        "none": lambda: True,
        "gzip": kafka_codec.has_gzip,
        "snappy": kafka_codec.has_snappy,
        "lz4": kafka_codec.has_lz4,
        "zstd": kafka_codec.has_zstd,
    }
    return checks[codec]()


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    # Always postgresql+psycopg2:// once validated (_database_url).
    database_url: Annotated[str, AfterValidator(_database_url)] = (
        "postgresql+psycopg2://postgres@127.0.0.1:5432/reaper"
    )
    broker_url: Annotated[
        str, AfterValidator(_url("redis", "rediss")), AfterValidator(_no_tls_in_query)
    ] = "redis://127.0.0.1:6379/0"
    # With a rediss:// broker URL: the CA the Redis server's certificate must
    # chain to, host name included; unset: the system's CAs. Never weaker.
    broker_ssl_cafile: Annotated[str, AfterValidator(_readable_file)] | None = None
    # Prefixes every Redis key of the broker: lets several deployments (or test
    # sessions) share one Redis without seeing each other's queues.
    broker_key_prefix: str = Field("", pattern=r"^[A-Za-z0-9._:{}-]{0,128}$")
    # A Redis server that has not accepted a connection within this is given up
    # (redis-py socket_connect_timeout), by the worker, its beat and every sender.
    broker_connect_timeout: Duration = timedelta(seconds=5)
    # A Redis connection that has not answered a command, or acknowledged what
    # was sent, for this long is given up (socket_timeout, TCP_USER_TIMEOUT and
    # keepalive probes): a publish never waits for ever on a dead connection.
    broker_tcp_timeout: Duration = timedelta(seconds=10)
    # How often an idle Redis connection is checked before use, and how often
    # the worker checks its consuming connections (kombu/redis-py
    # health_check_interval): a dead consumer is replaced within about twice this.
    broker_health_check_interval: Duration = timedelta(seconds=10)
    kafka_bootstrap_servers: Annotated[str, AfterValidator(_bootstrap)] = "127.0.0.1:9092"
    # Kafka's own rule for topic names.
    conference_ended_topic: str = Field(
        "pin.messenger.conference-ended.v1", pattern=r"^[A-Za-z0-9._-]{1,249}$"
    )
    # Kafka client security (docs/design.md#configuration).
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: Annotated[str, AfterValidator(_readable_file)] | None = None
    kafka_ssl_certfile: Annotated[str, AfterValidator(_readable_file)] | None = None
    kafka_ssl_keyfile: Annotated[str, AfterValidator(_readable_file)] | None = None
    kafka_ssl_password: SecretStr | None = None
    kafka_ssl_check_hostname: bool = True
    # Bound of one delivery (send + acknowledgement); connecting and metadata
    # waits get half of it, so an unreachable broker fails a pass in seconds.
    kafka_timeout: Duration = timedelta(seconds=10)
    # The outbox relay (reaper.relay_outbox).
    relay_interval: Duration = timedelta(seconds=5)
    relay_batch_size: int = Field(2000, ge=1, le=10_000)
    relay_max_pass_duration: Duration = timedelta(seconds=20)
    relay_backoff_initial: Duration = timedelta(seconds=1)
    relay_backoff_max: Duration = timedelta(seconds=60)
    # A row that failed this often is parked (docs/design.md#parked-events).
    relay_max_attempts: int = Field(20, ge=1, le=1_000)
    # The producer's max_request_size: a larger record is refused, and parked.
    # kafka-python checks a record's size before compression; the broker checks
    # the compressed batch against its own limit (1 MiB by default). 4 MiB takes
    # the largest event (a roster of 20000 rows, about 2.7 MB), which zstd makes
    # about 0.7 MB on the wire (docs/performance.md#compression).
    kafka_max_request_size: int = Field(4 * 1_048_576, ge=1_024, le=100 * 1_048_576)
    # The codec of every batch the producer sends (docs/design.md#the-kafka-event):
    # consumers' clients must support it.
    kafka_compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "zstd"
    outbox_retention: Duration = timedelta(days=7)
    polling_interval: Duration = timedelta(seconds=30)
    empty_room_grace: Duration = timedelta(seconds=90)
    provision_timeout: Duration = timedelta(seconds=120)
    stale_live_timeout: Duration = timedelta(hours=4)
    batch_size: int = Field(100, ge=1, le=10_000)
    # Batches of one phase run side by side on this many connections (SKIP
    # LOCKED keeps them disjoint); 1 = one after the other. See bench/.
    drain_lanes: int = Field(2, ge=1, le=8)
    # The longest a phase may hold the run lock: a hung phase (alive, never
    # ending) stops proving it is alive then, and the server ends its session
    # one REAPER_RUN_LEASE later (docs/design.md#the-single-runner-lock).
    lock_ttl: Duration = timedelta(seconds=120)
    # How long a run stays its cycle's without a sign of life: the gap allowed
    # between two phases, and the silence after which a phase's lock session is
    # ended by the server. A crashed owner is taken over this long after its
    # last sign of life.
    run_lease: Duration = timedelta(seconds=10)
    # A database server that has not answered a connection attempt within this
    # is given up (libpq connect_timeout).
    database_connect_timeout: Duration = timedelta(seconds=5)
    # A database connection whose peer acknowledges nothing (no data, no
    # keepalive) for this long is given up, by the worker (libpq) and, inside
    # each transaction, by the server, which then frees the locks it held.
    database_tcp_timeout: Duration = timedelta(seconds=15)
    max_run_duration: Duration = timedelta(seconds=30)
    recorder_url: Annotated[str, AfterValidator(_url("http", "https"))] | None = None
    recorder_timeout: Duration = timedelta(seconds=2)
    # Stop signals the recorder did not take are retried this long after the close.
    recorder_retry_window: Duration = timedelta(minutes=15)
    metrics_port: int = Field(9808, ge=0, le=65535)
    # Where the worker's /metrics listens (0.0.0.0: reachable by Prometheus in a container).
    metrics_address: Annotated[str, AfterValidator(_listen_address)] = "0.0.0.0"
    # Mass-closure guard of stale_live: a cycle that would end more than this
    # share of the Active conferences, and more than the floor, ends nothing.
    # A presence outage looks exactly like that. 1 turns the guard off.
    mass_closure_share: float = Field(0.5, gt=0, le=1)
    mass_closure_floor: int = Field(20, ge=0, le=1_000_000)
    # Who an operator command says it was (pause, resume, policy, requeue); unset:
    # the OS user running it.
    operator: str | None = Field(None, min_length=1, max_length=200)

    @model_validator(mode="after")
    def _coherent(self) -> Settings:
        if self.empty_room_grace >= self.stale_live_timeout:
            raise ValueError(
                "REAPER_EMPTY_ROOM_GRACE: must be below REAPER_STALE_LIVE_TIMEOUT "
                f"({self.empty_room_grace} >= {self.stale_live_timeout})"
            )
        if self.broker_ssl_cafile and urlsplit(self.broker_url).scheme != "rediss":
            raise ValueError(
                "REAPER_BROKER_SSL_CAFILE: needs a rediss:// REAPER_BROKER_URL "
                "(a CA for a broker reached in plain text protects nothing)"
            )
        if self.kafka_security_protocol.startswith("SASL_") and not (
            self.kafka_sasl_mechanism and self.kafka_sasl_username and self.kafka_sasl_password
        ):
            raise ValueError(
                "REAPER_KAFKA_SECURITY_PROTOCOL: "
                f"{self.kafka_security_protocol} needs REAPER_KAFKA_SASL_MECHANISM, "
                "REAPER_KAFKA_SASL_USERNAME and REAPER_KAFKA_SASL_PASSWORD"
            )
        if not compression_available(self.kafka_compression):
            raise ValueError(
                f"REAPER_KAFKA_COMPRESSION: {self.kafka_compression} needs the Python package "
                f"{COMPRESSION_PACKAGES[self.kafka_compression]}, which is not installed"
            )
        if self.relay_backoff_initial > self.relay_backoff_max:
            raise ValueError(
                "REAPER_RELAY_BACKOFF_INITIAL: must not exceed REAPER_RELAY_BACKOFF_MAX "
                f"({self.relay_backoff_initial} > {self.relay_backoff_max})"
            )
        if self.outbox_retention < OUTBOX_RETENTION_FLOOR:
            raise ValueError(
                "REAPER_OUTBOX_RETENTION: must be at least 1 hour, the least the database "
                f"keeps a published row (got {self.outbox_retention})"
            )
        if self.lock_ttl <= self.max_run_duration:
            raise ValueError(
                "REAPER_LOCK_TTL: must be above REAPER_MAX_RUN_DURATION "
                f"({self.lock_ttl} <= {self.max_run_duration})"
            )
        if not 2 <= self.run_lease.total_seconds() <= 600:
            raise ValueError(
                f"REAPER_RUN_LEASE: must be between 2 s and 10 min (got {self.run_lease})"
            )
        if self.run_lease >= self.lock_ttl:
            raise ValueError(
                "REAPER_RUN_LEASE: must be below REAPER_LOCK_TTL "
                f"({self.run_lease} >= {self.lock_ttl})"
            )
        for name in (
            "database_connect_timeout",
            "database_tcp_timeout",
            "broker_connect_timeout",
            "broker_health_check_interval",
        ):
            value: timedelta = getattr(self, name)
            if not 1 <= value.total_seconds() <= 600:
                raise ValueError(
                    f"REAPER_{name.upper()}: must be between 1 s and 10 min (got {value})"
                )
        # Above the consumer's BRPOP wait (kombu's, one second): a live Redis
        # legitimately takes that long to answer it.
        if not 2 <= self.broker_tcp_timeout.total_seconds() <= 600:
            raise ValueError(
                "REAPER_BROKER_TCP_TIMEOUT: must be between 2 s and 10 min "
                f"(got {self.broker_tcp_timeout})"
            )
        return self


def parse_duration(value: str) -> timedelta:
    """A duration as the environment takes it (seconds or ISO 8601), positive."""
    from pydantic import TypeAdapter

    try:
        return TypeAdapter(Duration).validate_python(value)
    except ValidationError as exc:
        message = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        raise ValueError(f"{value!r} {message}") from None


class ConfigError(Exception):
    """A configuration problem, phrased as one line for the operator."""


_USERINFO_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*:)[^/?#@]*@")


def _redact(name: str, value: object) -> object:
    """An error line must not print a secret: URL passwords and *_PASSWORD values."""
    if "PASSWORD" in name:
        return "***"
    if isinstance(value, str):
        return _USERINFO_PASSWORD.sub(r"\g<head>***@", value)
    return value


def describe(error: ValidationError) -> str:
    """One line per problem: ``REAPER_X: rule (got 'value')``."""
    lines = []
    for item in error.errors():
        message = str(item["msg"]).removeprefix("Value error, ")
        if not item["loc"]:  # model-level rule, already names its variables
            lines.append(message)
            continue
        name = ENV_PREFIX + str(item["loc"][0]).upper()
        lines.append(f"{name}: {message} (got {_redact(name, item['input'])!r})")
    return "; ".join(lines)


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        raise ConfigError(f"invalid configuration: {describe(exc)}") from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings; exits with one clear line when they are invalid."""
    try:
        return load_settings()
    except ConfigError as exc:
        print(f"reaper: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
