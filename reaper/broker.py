"""The Redis broker transport: the bounds of every connection to Redis
(:func:`transport_options`), its TLS (:func:`ssl_options`, :class:`TlsConnection`),
and one repair that keeps a worker alive when Redis restarts under it.

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

import logging
import socket
import ssl
import sys
from importlib.metadata import version as installed_version
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import redis as redis_client
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


def ssl_options(settings: Settings) -> dict[str, Any] | None:
    """The TLS of every broker connection, as Celery's ``broker_use_ssl`` takes it;
    None for a plain ``redis://`` URL.

    A ``rediss://`` URL alone makes kombu connect *without* checking the server
    (it warns and uses ``CERT_NONE``): anyone in between could read the tasks
    and the broker's password. Here the server's certificate must chain to
    REAPER_BROKER_SSL_CAFILE (unset: the system's CAs) and name the host of the
    URL. redis-py builds its context with ``ssl.create_default_context``, so an
    expired certificate is refused too. Flower reads the same setting for its
    own Redis client (its broker page).
    """
    if urlsplit(settings.broker_url).scheme != "rediss":
        return None
    return {
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
        "ssl_ca_certs": settings.broker_ssl_cafile,
        "ssl_check_hostname": True,
    }


def tls_refusal(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate check that failed somewhere in ``exc``'s chain, if any
    (redis-py and kombu each wrap the ``ssl`` error in their own)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class TlsConnection(redis_client.SSLConnection):
    """redis-py's TLS connection that says, in one log line, why a server's
    certificate was refused (``broker.tls_refused``): the worker's consumer, its
    beat and every sender connect through it; kombu and Celery then retry as
    for any unreachable broker, never in plain text.

    Said once per process while the same refusal lasts (a sender retries its
    publish, the consumer reconnects every few seconds): again when the reason
    changes or after a connection got through. (redis-py 6 and later connect
    through ``connect_check_health``.)"""

    # (host, port, reason) of the refusal said last in this process; None after
    # a connection got through. Shared by every connection of the process.
    _said: tuple[str, int, str] | None = None

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().connect_check_health(*args, **kwargs)
        except redis_client.ConnectionError as exc:
            refused = tls_refusal(exc)
            said = (str(self.host), int(self.port), str(refused and refused.verify_message))
            if refused is not None and TlsConnection._said != said:
                TlsConnection._said = said
                log(
                    logger,
                    "broker.tls_refused",
                    level=logging.ERROR,
                    host=said[0],
                    port=said[1],
                    reason=said[2],
                )
            raise
        TlsConnection._said = None


def quiet_tls_refusal(
    kind: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    """``sys.excepthook`` of a process that loads the app (``celery call``, Flower):
    a refused broker certificate ends it with the one ``broker.tls_refused`` line
    already said, exit status 1, no traceback; anything else as Python does."""
    if tls_refusal(exc) is not None:
        raise SystemExit(1)
    sys.__excepthook__(kind, exc, tb)


class Channel(redis.Channel):
    # rediss:// connections report a refused certificate (TlsConnection)
    connection_class_ssl = TlsConnection

    def close(self) -> None:
        if (
            _repair_restore
            and not self.closed
            and self.connection.client is None
            and self._qos is not None
        ):
            log(
                logger,
                "broker.unacked_left_for_redelivery",
                level=logging.WARNING,
                count=len(self._qos._delivered or ()),
                reason="the broker connection was lost; visibility_timeout redelivers them",
            )
            self._qos = None
        # kombu leaves Channel.close unannotated (celery-types' stubs annotate it)
        super().close()  # type: ignore[no-untyped-call, unused-ignore]


class Transport(redis.Transport):
    Channel = Channel


# Whether Channel.close skips the restore of a collected transport (the repair
# above); set by install() on the kombu versions that have the defect.
_repair_restore = False


def install(version: str = installed_version("kombu")) -> bool:
    """Make ``redis://`` and ``rediss://`` broker URLs use :class:`Transport`; True
    when the Redis-restart repair applies too (the kombu versions that need it).

    Through the scheme aliases (kombu's way to name a transport) rather than
    ``broker_transport``: kombu keys its ``rediss`` handling (TLS defaults) on
    the scheme name, which must stay. Called when the Celery configuration is
    read, before kombu resolves (and caches) any transport. The transport's TLS
    report (:class:`TlsConnection`) applies on every version.
    """
    global _repair_restore
    from kombu import transport

    for scheme in ("redis", "rediss"):
        transport.TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
    _repair_restore = defect_expected(version)
    if not _repair_restore:
        log(
            logger,
            "broker.repair_not_applied",
            level=logging.WARNING,
            kombu=version,
            reason="outside the kombu versions the Redis-restart repair was tested on",
        )
    return _repair_restore
