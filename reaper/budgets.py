"""Every time budget of a database transaction, named in one place.

PostgreSQL enforces them (``SET LOCAL`` through ``Queries.bound_transaction``,
or once for a drain lane's session through ``Queries.bound_session``):
a statement that runs too long, or a lock wait, is cancelled
(``statement_timeout``, ``lock_timeout``), and a session that sits idle inside
its transaction too long is ended (``idle_in_transaction_session_timeout``),
which frees every lock it held. That is how a hung runner loses the run lock
within ``REAPER_LOCK_TTL`` (docs/design.md#the-single-runner-lock).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reaper.config import Settings

# A lock check, the run bookkeeping, a mark: statements that touch a row or two.
QUICK = timedelta(seconds=5)
# Read-only statements of an operator command or a metrics scrape: never hang.
READ = timedelta(seconds=10)
# A relay batch's own statements (claim, mark) on a large backlog.
RELAY_STATEMENT = timedelta(seconds=15)


@dataclass(frozen=True)
class Budget:
    idle: timedelta  # idle_in_transaction_session_timeout
    statement: timedelta  # statement_timeout and lock_timeout

    @property
    def idle_ms(self) -> int:
        return _ms(self.idle)

    @property
    def statement_ms(self) -> int:
        return _ms(self.statement)


def _ms(duration: timedelta) -> int:
    return int(duration.total_seconds() * 1000)


def run_lock(settings: Settings) -> Budget:
    """The run lock's own transaction: idle while the phase's batches run."""
    return Budget(idle=settings.lock_ttl, statement=QUICK)


def batch(settings: Settings) -> Budget:
    """One phase batch: a statement never outlives the cycle's whole budget."""
    return Budget(idle=settings.lock_ttl, statement=settings.max_run_duration)


def quick() -> Budget:
    return Budget(idle=QUICK, statement=QUICK)


def read() -> Budget:
    return Budget(idle=READ, statement=READ)


def relay_batch(settings: Settings) -> Budget:
    """A relay batch's transaction waits on Kafka (its acknowledgements and the
    batch before it): bounded, so a hung relay's row locks are freed and its
    rows sent again by the next pass."""
    return Budget(idle=settings.kafka_timeout * 6 + timedelta(seconds=5), statement=RELAY_STATEMENT)


def relay_pass(settings: Settings) -> Budget:
    """The relay lock's transaction idles for the whole pass."""
    idle = settings.relay_max_pass_duration + 6 * settings.kafka_timeout + timedelta(seconds=10)
    return Budget(idle=idle, statement=QUICK)


# /healthz's database read (the last completed run, the run lock's holder): a
# probe (Docker's, a kubelet's) gives up after a few seconds, so the answer
# never waits longer than this for the database, connecting included.
HEALTH = timedelta(seconds=2)


def health() -> Budget:
    return Budget(idle=HEALTH, statement=HEALTH)
