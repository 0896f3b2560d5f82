"""The check of delivery every fault and race test shares: the ledger
(reaper/ledger.py, docs/delivery.md) over every room the reaper closed, read
from PostgreSQL and, when a relay ran, from the test's topic.

A test whose relay never ran reads no topic (``bootstrap=None``): every event
must then still be in the outbox, so one missing from it is lost. A test whose
relay ran names its broker and topic: a published event is deleted from the
outbox at its acknowledgement and read back from the topic.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine, text

from reaper.config import Settings
from reaper.ledger import Ledger, Verdict

# Every room a test closes: its as_of (a fixed past moment or the database's
# clock) lies in between.
SINCE = datetime(2000, 1, 1, tzinfo=UTC)
UNTIL = datetime(2100, 1, 1, tzinfo=UTC)

TALLY = text(
    """
    SELECT count(*) FILTER (WHERE status IN ('Active', 'Provisioning')) AS live,
           count(*) FILTER (WHERE status = 'Ended') AS ended,
           count(*) FILTER (WHERE status = 'Failed') AS failed,
           (SELECT count(*) FROM messenger.integration_outbox) AS integration,
           (SELECT count(*) FROM messenger.realtime_outbox) AS realtime
    FROM messenger.conference_sessions
    """
)


@dataclass(frozen=True)
class Tally:
    """Rooms by state and the outbox rows: what a test waits on."""

    live: int
    ended: int
    failed: int
    integration: int
    realtime: int


def tally(engine: Engine) -> Tally:
    with engine.connect() as conn:
        return Tally(**conn.execute(TALLY).one()._mapping)


@dataclass(frozen=True)
class Books:
    """The ledger's verdict beside the tally it was read with."""

    tally: Tally
    verdict: Verdict

    def assert_clean(self) -> Verdict:
        assert self.verdict.ok, "\n".join(self.verdict.summary())
        return self.verdict

    @property
    def lost(self) -> int:
        return len(self.verdict.lost)


def books(
    engine: Engine,
    *,
    bootstrap: str | None = None,
    topic: str | None = None,
    exclude: Collection[str] = (),
) -> Books:
    """The ledger over every room closed (``exclude``: rooms the test seeded as
    already closed, which carry no outbox rows)."""
    settings = Settings(database_url=engine.url.render_as_string(hide_password=False))
    if bootstrap and topic:
        settings = settings.model_copy(
            update={"kafka_bootstrap_servers": bootstrap, "conference_ended_topic": topic}
        )
    ledger = Ledger(settings, engine, kafka=bootstrap is not None, exclude=exclude)
    before = tally(engine)
    return Books(before, ledger.check(SINCE, UNTIL))


def assert_clean(
    engine: Engine,
    *,
    bootstrap: str | None = None,
    topic: str | None = None,
    exclude: Collection[str] = (),
) -> Verdict:
    return books(engine, bootstrap=bootstrap, topic=topic, exclude=exclude).assert_clean()
