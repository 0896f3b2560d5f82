"""The Kafka producer of this process: one per worker process, created lazily.

The producer owns a sender thread, so it must be created after the prefork
fork (a thread does not survive into a child) and closed when the process
ends: ``process_slot(settings).get()`` creates it on first use in the calling process,
``close_producer`` flushes and closes it (wired to ``worker_process_shutdown``
and ``worker_shutdown`` in :mod:`reaper.lifecycle`).
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Any, Literal

from kafka import KafkaProducer

from reaper import budgets
from reaper.config import Settings
from reaper.errors import describe
from reaper.logs import get_logger, log

logger = get_logger("kafka")


def producer_config(settings: Settings) -> dict[str, Any]:
    """The producer's settings: the safest delivery kafka-python offers, bounded waits."""
    timeout_ms = int(settings.kafka_timeout.total_seconds() * 1000)
    # delivery >= linger + request timeout is enforced by kafka-python.
    wait_ms = max(500, timeout_ms // 2)
    config: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap_servers.split(","),
        "client_id": f"conference-room-reaper-{os.getpid()}",
        # Explicit, so that a conflicting setting raises instead of silently
        # turning idempotence off (docs/design.md#what-the-stack-does).
        "enable_idempotence": True,
        "acks": "all",
        "max_in_flight_requests_per_connection": 5,
        "linger_ms": 5,
        "batch_size": 256 * 1024,
        # A larger record is refused by the producer itself (and parked); the
        # size checked is the record's before compression.
        "max_request_size": settings.kafka_max_request_size,
        # Batches are compressed as a whole: a huge roster's event shrinks about
        # 4x with zstd (docs/performance.md#compression).
        "compression_type": (
            None if settings.kafka_compression == "none" else settings.kafka_compression
        ),
        "delivery_timeout_ms": timeout_ms,
        "request_timeout_ms": wait_ms,
        # send() waits this long for metadata (an unreachable broker): below the
        # relay task's soft time limit.
        "max_block_ms": wait_ms,
        "bootstrap_timeout_ms": wait_ms,
        "reconnect_backoff_max_ms": 5_000,
        # The relay assumes the topic exists (it is provisioned, not guessed).
        "allow_auto_create_topics": False,
        "security_protocol": settings.kafka_security_protocol,
    }
    if settings.kafka_security_protocol.startswith("SASL_"):
        config["sasl_mechanism"] = settings.kafka_sasl_mechanism
        config["sasl_plain_username"] = settings.kafka_sasl_username
        config["sasl_plain_password"] = (
            settings.kafka_sasl_password.get_secret_value()
            if settings.kafka_sasl_password
            else None
        )
    if settings.kafka_security_protocol in ("SSL", "SASL_SSL"):
        config["ssl_cafile"] = settings.kafka_ssl_cafile
        config["ssl_certfile"] = settings.kafka_ssl_certfile
        config["ssl_keyfile"] = settings.kafka_ssl_keyfile
        config["ssl_check_hostname"] = settings.kafka_ssl_check_hostname
        if settings.kafka_ssl_password:
            config["ssl_password"] = settings.kafka_ssl_password.get_secret_value()
    return config


UnavailableCause = Literal["unreachable", "tls", "authentication"]


@dataclass(frozen=True)
class Unavailable:
    """Why no producer could reach Kafka, in one line for the operator."""

    cause: UnavailableCause
    detail: str


def tls_context(settings: Settings) -> ssl.SSLContext:
    """The TLS the producer's connections use (kafka-python's SSL settings): the
    server's certificate always verified, against REAPER_KAFKA_SSL_CAFILE (unset:
    the system's CAs), its host name unless REAPER_KAFKA_SSL_CHECK_HOSTNAME=false."""
    context = ssl.create_default_context(cafile=settings.kafka_ssl_cafile)
    context.check_hostname = settings.kafka_ssl_check_hostname
    if settings.kafka_ssl_certfile:
        context.load_cert_chain(
            settings.kafka_ssl_certfile,
            settings.kafka_ssl_keyfile,
            settings.kafka_ssl_password.get_secret_value() if settings.kafka_ssl_password else None,
        )
    return context


def diagnose(settings: Settings, exc: BaseException) -> Unavailable:
    """Why the producer could not bootstrap, when its connections are secured.

    kafka-python retries a refused certificate or login until its bootstrap
    timeout and then says only ``Unable to bootstrap``: the true reason is in
    its debug logs, where no operator looks. So each bootstrap server is asked
    again here, with the producer's own TLS settings: a certificate refused is
    ``tls``, with OpenSSL's reason; a server that takes the TCP connection (and
    its TLS) while no client could bootstrap, with SASL configured, is
    ``authentication``: the login was refused (a wrong password, an unknown
    user, a mechanism the broker does not offer). Anything else, and every
    plain-text connection, is ``unreachable``. Bounded: one connection per
    server, each within half of REAPER_KAFKA_TIMEOUT.
    """
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return Unavailable("unreachable", describe(exc))
    wait_s = settings.kafka_timeout.total_seconds() / 2
    reached = False
    for server in settings.kafka_bootstrap_servers.split(","):
        host, _, port = server.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
                if protocol in ("SSL", "SASL_SSL"):
                    with tls_context(settings).wrap_socket(sock, server_hostname=host):
                        pass
        except ssl.SSLCertVerificationError as refused:
            return Unavailable(
                "tls", f"the TLS certificate of {server} was refused: {refused.verify_message}"
            )
        except ssl.SSLError as failed:
            return Unavailable("tls", f"no TLS session with {server}: {failed.reason}")
        except OSError:
            continue  # this one is unreachable; another may answer
        reached = True
    if reached and protocol.startswith("SASL_"):
        return Unavailable(
            "authentication",
            f"the brokers take the connection but not the SASL login "
            f"({settings.kafka_sasl_mechanism} as {settings.kafka_sasl_username!r}): "
            f"a wrong password, an unknown user or a mechanism they do not offer",
        )
    return Unavailable("unreachable", describe(exc))


class ProducerSlot:
    """Holds at most one producer, created on first use in the calling process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._producer: KafkaProducer | None = None
        self._owner_pid: int | None = None

    def get(self) -> KafkaProducer:
        """The producer (raises when Kafka is unreachable: nothing is cached then)."""
        with self._lock:
            if self._producer is not None and self._owner_pid != os.getpid():
                # Inherited through a fork: its sender thread stayed in the parent.
                self._producer = None
            if self._producer is None:
                self._producer = KafkaProducer(**producer_config(self.settings))
                self._owner_pid = os.getpid()
                log(
                    logger,
                    "kafka.producer_created",
                    bootstrap_servers=self.settings.kafka_bootstrap_servers,
                    security_protocol=self.settings.kafka_security_protocol,
                    compression=self.settings.kafka_compression,
                )
            return self._producer

    def discard(self, reason: str) -> None:
        """Drop the producer without waiting (Kafka is gone or it is broken); the
        next ``get`` starts a fresh one, with a new idempotent producer id.

        The dropped one is closed on a thread of its own: kafka-python flushes
        before it closes, and a flush with no time to wait raises while records
        are in flight (a pipelined pass's next batch). They fail at their
        delivery timeout, and their rows go again with the next pass."""
        with self._lock:
            producer, owner = self._producer, self._owner_pid
            self._producer = self._owner_pid = None
        if producer is not None and owner == os.getpid():
            timeout = budgets.producer_close(self.settings).total_seconds()
            threading.Thread(
                target=_close_dropped, args=(producer, timeout), name="kafka-discard", daemon=True
            ).start()
            log(logger, "kafka.producer_discarded", level=logging.WARNING, reason=reason)

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is in flight and close; a no-op without a producer of this process."""
        with self._lock:
            producer, owner = self._producer, self._owner_pid
            self._producer = self._owner_pid = None
        if producer is None or owner != os.getpid():
            return
        try:
            producer.flush(timeout=timeout)
        except Exception as exc:  # closing anyway: the outbox rows are still pending
            _flush_failed(exc)
        producer.close(timeout=timeout)
        log(logger, "kafka.producer_closed")


def _close_dropped(producer: KafkaProducer, timeout: float) -> None:
    """Close a dropped producer once its records in flight are done (at most their
    delivery timeout); its sender thread ends with it."""
    try:
        producer.close(timeout=timeout)
    except Exception as exc:  # its rows are pending either way; its sender thread stays
        _flush_failed(exc)


def _flush_failed(exc: Exception) -> None:
    log(
        logger,
        "kafka.flush_failed",
        level=logging.WARNING,
        error=type(exc).__name__,
        detail=str(exc),
    )


_process_slot: ProducerSlot | None = None
_slot_lock = threading.Lock()


def process_slot(settings: Settings) -> ProducerSlot:
    """The producer slot of this process (one producer per worker process), for
    these settings. A worker has one set of settings; a process that relays with
    others (another Kafka, other credentials) gets a slot of its own for them,
    and the previous one's producer is dropped: serving the first caller's
    producer to every later one sent their records to the first one's brokers."""
    global _process_slot
    with _slot_lock:
        slot = _process_slot
        if slot is None or producer_config(slot.settings) != producer_config(settings):
            if slot is not None:
                slot.discard("the process relays with other Kafka settings")
            slot = _process_slot = ProducerSlot(settings)
        return slot


def close_producer(timeout: float = 5.0) -> None:
    """Flush and close this process's producer, if it has one."""
    if _process_slot is not None:
        _process_slot.close(timeout)
