"""The Redis broker transport, with one repair that keeps a worker alive when
Redis restarts under it.

Celery 5.7 / kombu 5.7: on a lost broker connection the consumer first
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

from kombu.transport import redis

from reaper.logs import get_logger, log

logger = get_logger("broker")


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


def install() -> None:
    """Make ``redis://`` and ``rediss://`` broker URLs use :class:`Transport`.

    Through the scheme aliases rather than ``broker_transport``: kombu keys its
    ``rediss`` handling (TLS defaults) on the scheme name, which must stay.
    """
    from kombu import transport

    for scheme in ("redis", "rediss"):
        transport.TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
        transport._transport_cache.pop(scheme, None)  # resolved before install()
