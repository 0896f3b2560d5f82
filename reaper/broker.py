"""The Redis broker transport, with one repair that keeps a worker alive when
Redis restarts under it.

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

import kombu
from kombu.transport import redis

from reaper.logs import get_logger, log

logger = get_logger("broker")

# [first, last) kombu versions with the defect, on which the repair was tested.
REPAIRED_VERSIONS = ((5, 5), (5, 8))


def defect_expected(version: str = kombu.__version__) -> bool:
    major_minor = tuple(int(part) for part in version.split(".")[:2])
    first, last = REPAIRED_VERSIONS
    return first <= major_minor < last


class Channel(redis.Channel):
    def close(self) -> None:
        if not self.closed and self.connection.client is None and self._qos is not None:
            log(
                logger,
                "broker.unacked_left_for_redelivery",
                level=30,
                count=len(self._qos._delivered),
                reason="the broker connection was lost; visibility_timeout redelivers them",
            )
            self._qos = None
        super().close()


class Transport(redis.Transport):
    Channel = Channel


def install(version: str = kombu.__version__) -> bool:
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
