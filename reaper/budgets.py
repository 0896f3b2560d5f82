"""Every time budget of a database transaction, named in one place.

PostgreSQL enforces them, for the current transaction only (``set_config(...,
true)`` through ``Queries.bound_transaction``; never for the session, which a
pooler in transaction mode would hand to another client): a statement that
runs too long, or a lock wait, is cancelled (``statement_timeout``,
``lock_timeout``); a session that sits idle inside its transaction too long is
ended (``idle_in_transaction_session_timeout``), which frees every lock it
held; and a client that stops acknowledging is given up within
``REAPER_DATABASE_TCP_TIMEOUT`` (``tcp_user_timeout`` and keepalives), so a
backend never holds a transaction's locks for a client that is gone. The
worker's side of the same connection is bounded by :class:`Peer` (libpq).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from math import ceil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reaper.config import Settings

# A lock check, the run bookkeeping, a mark: statements that touch a row or two.
# Also the longest a transaction of a drain lane sits idle between its
# statements: they are sent back to back.
QUICK = timedelta(seconds=5)
# Read-only statements of an operator command or a metrics scrape: never hang.
READ = timedelta(seconds=10)
# A relay batch's own statements (claim, mark) on a large backlog.
RELAY_STATEMENT = timedelta(seconds=15)
# The longest a caller waits for a connection of the process's own pool. The
# pool is sized for what a phase holds at once (db.connections_needed), so a
# wait this long means connections leak or the configuration is off: fail
# with one line instead of stalling the phase.
POOL_WAIT = timedelta(seconds=10)
# The first statement of a transaction (its budget) is trivial on a server that
# has a connection for us: past this, nobody does (a pooler with no server
# connection free, a silent server), and the watchdog ends the wait.
FIRST_ANSWER = timedelta(seconds=5)
# Keepalive probes sent before a silent peer is given up; the first probe
# leaves after a third of the TCP timeout, the rest are spread over the
# remaining two thirds, so a silent peer is noticed within about that timeout
# whether or not data is in flight (tcp_user_timeout covers the latter).
KEEPALIVE_PROBES = 4


@dataclass(frozen=True)
class Peer:
    """How long either side waits on a database connection that went silent."""

    connect: timedelta  # REAPER_DATABASE_CONNECT_TIMEOUT
    silence: timedelta  # REAPER_DATABASE_TCP_TIMEOUT

    @property
    def silence_ms(self) -> int:
        return _ms(self.silence)

    @property
    def keepalive_idle_s(self) -> int:
        return max(1, round(self.silence.total_seconds() / 3))

    @property
    def keepalive_interval_s(self) -> int:
        return max(1, round(self.silence.total_seconds() * 2 / 3 / KEEPALIVE_PROBES))

    def libpq(self) -> dict[str, int]:
        """The worker's side: libpq connection parameters."""
        return {
            "connect_timeout": max(1, ceil(self.connect.total_seconds())),
            "keepalives": 1,
            "keepalives_idle": self.keepalive_idle_s,
            "keepalives_interval": self.keepalive_interval_s,
            "keepalives_count": KEEPALIVE_PROBES,
            "tcp_user_timeout": self.silence_ms,
        }


@dataclass(frozen=True)
class Budget:
    idle: timedelta  # idle_in_transaction_session_timeout
    statement: timedelta  # statement_timeout and lock_timeout
    peer: Peer  # the server's side of the connection (tcp_user_timeout, keepalives)

    @property
    def idle_ms(self) -> int:
        return _ms(self.idle)

    @property
    def statement_ms(self) -> int:
        return _ms(self.statement)


def _ms(duration: timedelta) -> int:
    return int(duration.total_seconds() * 1000)


def peer(settings: Settings) -> Peer:
    return Peer(connect=settings.database_connect_timeout, silence=settings.database_tcp_timeout)


def run_lock(settings: Settings) -> Budget:
    """A lock session's transaction: a phase's run lock, a relay pass's or a stop
    pass's lock. It sits idle while the work runs on other connections; the
    holder's heartbeat (lease.Heartbeat) speaks on it several times per lease,
    so only a dead, frozen, cut-off or hung holder is silent for a whole
    REAPER_RUN_LEASE, and the server then ends it and frees the lock. Its
    lock_timeout also bounds a new pass's wait for an earlier holder's marks
    (lease.pass_lock): those are in their commit, a round trip or two."""
    return Budget(idle=settings.run_lease, statement=QUICK, peer=peer(settings))


def batch(settings: Settings) -> Budget:
    """One phase batch: a statement never outlives the cycle's whole budget."""
    return Budget(idle=QUICK, statement=settings.max_run_duration, peer=peer(settings))


def quick(settings: Settings) -> Budget:
    return Budget(idle=QUICK, statement=QUICK, peer=peer(settings))


def read(settings: Settings) -> Budget:
    return Budget(idle=READ, statement=READ, peer=peer(settings))


def relay_batch(settings: Settings) -> Budget:
    """A relay batch's transaction waits on Kafka between its claim and its marks
    (its acknowledgements and the batch before it: up to about four Kafka
    timeouts), holding its rows locked, and so every later event of their deals
    (the claim lets nothing overtake a row claimed elsewhere). The pass's
    heartbeat speaks on it while it waits (lease.Heartbeat.tend), so the idle
    bound is one REAPER_RUN_LEASE whatever Kafka does: a frozen, cut-off or
    hung relay holds those deals for a lease after it stopped, as it holds the
    relay lock, never for the Kafka waits of a healthy one (65 s with the
    defaults before this bound, measured in tests/test_pass_takeover.py)."""
    return Budget(idle=settings.run_lease, statement=RELAY_STATEMENT, peer=peer(settings))


def relay_pass_give_up(settings: Settings) -> timedelta:
    """How long a relay pass's heartbeat speaks for it: the longest a healthy pass
    runs (no claim after REAPER_RELAY_MAX_PASS_DURATION; the two batches in flight
    then settle within a few Kafka timeouts, metadata and acknowledgements). A
    pass alive past it but never ending loses its lock, and its batches' rows,
    one REAPER_RUN_LEASE later."""
    return settings.relay_max_pass_duration + 6 * settings.kafka_timeout + timedelta(seconds=10)


def producer_close(settings: Settings) -> timedelta:
    """How long a dropped producer's closing waits for its records in flight: each
    fails at its delivery timeout (REAPER_KAFKA_TIMEOUT), which its sender notices
    after at most one request timeout more (half of it, reaper.kafka)."""
    return settings.kafka_timeout * 2


# A stop-signal pass (reaper/recorder.py) claims signals while a whole recorder
# timeout is left of this many: a few calls' worth, so a pass, and `reaper reap
# --once` after its cycle, ends within seconds whatever the recorder does, and
# never holds a worker slot long. Signals left over are due to the next pass.
STOP_PASS_TIMEOUTS = 3


def stop_pass(settings: Settings) -> timedelta:
    """How long a stop-signal pass sends: every call ends by then."""
    return STOP_PASS_TIMEOUTS * settings.recorder_timeout


def stop_pass_give_up(settings: Settings) -> timedelta:
    """How long a stop pass's heartbeat speaks for it: the pass's sending and its
    last claim and mark transactions. A pass alive past it but never ending loses
    the stop lock one REAPER_RUN_LEASE later."""
    return stop_pass(settings) + 3 * QUICK


# /healthz's database read (the last completed run, the run lock's holder): a
# probe (Docker's, a kubelet's) gives up after a few seconds, so the answer
# never waits longer than this for the database, connecting included.
HEALTH = timedelta(seconds=2)


def health(settings: Settings) -> Budget:
    return Budget(idle=HEALTH, statement=HEALTH, peer=peer(settings))


# The ledger (reaper/ledger.py, reaper reconcile). Its reads are an operator's,
# over a window of hours: the rooms closed in it (by the partial index of reaped
# rooms) and the pending outbox, a few seconds for 50,000 rooms; a minute is far
# above that, and still ends a read stuck behind a lock or a silent server.
LEDGER_READ = timedelta(seconds=60)
# Kafka's records are read from this long before the window's start: a record's
# timestamp is its producer's clock when it was sent, after the commit that
# closed its room (whose ended_at is the database's clock); this covers a
# producer host's clock running behind the database's.
LEDGER_KAFKA_SLACK = timedelta(minutes=5)
# The whole read of the topic, metadata to the end offsets it began with: a
# broker that stops answering midway fails the check (no verdict on delivery)
# instead of hanging it. A night's events of a busy deployment are read in
# seconds; several Kafka timeouts on top cover a slow metadata answer.
LEDGER_KAFKA_READ = timedelta(minutes=2)
# How many times the ledger's consumer tries to bootstrap (each within half the
# Kafka timeout) before the read fails: a broker just restarted, or slow on a
# busy host, can let one bootstrap time out (seen in a fault campaign: no
# verdict after a healed outage); three in a row that fail mean it is down.
LEDGER_KAFKA_CONNECTS = 3
# One poll of the ledger's consumer, and its wait between metadata requests
# for a topic not known yet: short, so the read notices its end (an empty poll
# after the end offsets) and its deadline promptly.
LEDGER_POLL = timedelta(milliseconds=200)


def ledger_read(settings: Settings) -> Budget:
    return Budget(idle=QUICK, statement=LEDGER_READ, peer=peer(settings))


def ledger_kafka_read(settings: Settings) -> timedelta:
    return LEDGER_KAFKA_READ + 3 * settings.kafka_timeout
