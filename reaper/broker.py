"""The Redis broker transport: the bounds of every connection to Redis
(:func:`transport_options`), and one repair that keeps a worker alive when
Redis restarts under it.

Bounds: kombu hands redis-py ``socket_timeout=None`` and no keepalive unless
told otherwise, so a Redis that went silent (a failover, a dropped NAT entry,
a partition: no reset, no reply) kept a publish waiting for ever (beat's tick,
a task sending the next link of a cycle's chain or ``relay_outbox``) and left
the worker consuming from a dead connection. The options below are the
Celery app's ``broker_transport_options``, so the worker's consumer, its beat
and every producer (a task's send, ``celery call``) get them alike.

kombu 5.5 to 5.7 (the versions it was tested on; :func:`install` applies it to
those only, and tests/test_reliability_deps.py fails when an upgrade leaves the
range): on a lost broker connection the consumer first
*collects* the connection (``transport.client = None``) and then closes it;
closing the channel tries to restore the unacknowledged messages through a new
Redis client, whose parameters come from ``transport.client``: an
``AttributeError`` that Celery treats as unrecoverable, so the whole worker
exits instead of reconnecting (seen with any task in flight at the moment
Redis went away; tests/test_reliability_deps.py). Here a channel whose
transport was collected skips that restore: it cannot reach Redis anyway, and
the messages come back through the broker's ``visibility_timeout``; the tasks
are idempotent.
"""

from __future__ import annotations

import socket
from importlib.metadata import version as installed_version
from typing import TYPE_CHECKING, Any

from kombu.transport import redis

from reaper.budgets import KEEPALIVE_PROBES, Peer
from reaper.logs import get_logger, log

if TYPE_CHECKING:
    from reaper.config import Settings

logger = get_logger("broker")

# [first, last) kombu versions with the defect, on which the repair was tested.
REPAIRED_VERSIONS = ((5, 5), (5, 8))


def defect_expected(version: str = installed_version("kombu")) -> bool:
    major_minor = tuple(int(part) for part in version.split(".")[:2])
    first, last = REPAIRED_VERSIONS
    return first <= major_minor < last


def peer(settings: Settings) -> Peer:
    """How long a broker connection may stay silent: the same rule as the database's."""
    return Peer(connect=settings.broker_connect_timeout, silence=settings.broker_tcp_timeout)


def transport_options(settings: Settings) -> dict[str, Any]:
    """The bounds of every Redis connection, as kombu's Redis transport takes them.

    - ``socket_connect_timeout``: REAPER_BROKER_CONNECT_TIMEOUT.
    - ``socket_timeout``: REAPER_BROKER_TCP_TIMEOUT, the longest wait for a
      command's reply (a publish, an acknowledgement). Above kombu's BRPOP wait
      (one second), the longest a live Redis legitimately takes to answer.
    - keepalive probes and ``TCP_USER_TIMEOUT``: an idle connection, or one
      whose sent data is never acknowledged, fails within about the same
      timeout, so a consumer waiting on a dead socket sees an error.
    - ``health_check_interval``: REAPER_BROKER_HEALTH_CHECK_INTERVAL; an idle
      connection is pinged before use, and the worker drops a consuming
      connection whose reply is overdue by this much (kombu 5.7).
    """
    bounds = peer(settings)
    return {
        "socket_connect_timeout": bounds.connect.total_seconds(),
        "socket_timeout": bounds.silence.total_seconds(),
        "socket_keepalive": True,
        "socket_keepalive_options": {
            socket.TCP_KEEPIDLE: bounds.keepalive_idle_s,
            socket.TCP_KEEPINTVL: bounds.keepalive_interval_s,
            socket.TCP_KEEPCNT: KEEPALIVE_PROBES,
            socket.TCP_USER_TIMEOUT: bounds.silence_ms,
        },
        "health_check_interval": settings.broker_health_check_interval.total_seconds(),
    }


class Channel(redis.Channel):
    def close(self) -> None:
        if not self.closed and self.connection.client is None and self._qos is not None:
            log(
                logger,
                "broker.unacked_left_for_redelivery",
                level=30,
                count=len(self._qos._delivered or ()),
                reason="the broker connection was lost; visibility_timeout redelivers them",
            )
            self._qos = None
        # kombu leaves Channel.close unannotated (celery-types' stubs annotate it)
        super().close()  # type: ignore[no-untyped-call, unused-ignore]


class Transport(redis.Transport):
    Channel = Channel


def install(version: str = installed_version("kombu")) -> bool:
    """Make ``redis://`` and ``rediss://`` broker URLs use :class:`Transport`, on the
    kombu versions that need it; True when it did.

    Through the scheme aliases (kombu's way to name a transport) rather than
    ``broker_transport``: kombu keys its ``rediss`` handling (TLS defaults) on
    the scheme name, which must stay. Called when the Celery configuration is
    read, before kombu resolves (and caches) any transport.
    """
    if not defect_expected(version):
        log(
            logger,
            "broker.repair_not_applied",
            level=30,
            kombu=version,
            reason="outside the kombu versions the Redis-restart repair was tested on",
        )
        return False
    from kombu import transport

    for scheme in ("redis", "rediss"):
        transport.TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
    return True
