"""Taken over in seconds (docs/reliability.md): a crashed node, a deploy whose
broker lost its queues, a frozen owner.

Each test drains a backlog on a real ``celery -A reaper worker -B`` and hits it
mid-drain; a second worker must resume the closing within one polling interval
plus 15 s, with the default REAPER_RUN_LEASE, and nothing is closed twice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from reaper.ledger import Verdict
from tests.conftest import clean
from tests.support import factory as f
from tests.support.facts import output_events
from tests.support.figures import figure
from tests.support.ledger import books
from tests.support.processes import Worker, wait_until
from tests.support.services import PrivateRedis

pytestmark = pytest.mark.process

INTERVAL = 2.0
# The bound: closing resumes within one polling interval plus this.
RESUME_BOUND = INTERVAL + 15
BACKLOG = 30_000
ENV = {
    "REAPER_POLLING_INTERVAL": str(INTERVAL),
    # small batches: the drain lasts long enough to be hit in the middle
    "REAPER_BATCH_SIZE": "5",
    "REAPER_MAX_RUN_DURATION": "20",
    "REAPER_MASS_CLOSURE_SHARE": "1",
}


@pytest.fixture
def db(database_url: str) -> Iterator[Engine]:
    engine = create_engine(database_url, connect_args={"application_name": "takeover-test"})
    with engine.begin() as conn:
        clean(conn)
        f.bulk_conferences(conn, BACKLOG, as_of=f.db_now(engine))
    yield engine
    engine.dispose()


def ended(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT count(*) FROM messenger.conference_sessions WHERE status = 'Ended'")
        ).scalar_one()


def mid_drain(worker: Worker, engine: Engine) -> int:
    """Wait until the worker has closed some of the backlog, not all of it."""
    closed = wait_until(lambda: ended(engine) >= 200 and ended(engine), 60, "a drain under way")
    assert closed < BACKLOG - 2000, "the drain ended before the fault: seed more"
    return closed


def resumed_after(engine: Engine, before: int, started: float) -> float:
    """Seconds from ``started`` until the closing moves past ``before`` again."""
    wait_until(lambda: ended(engine) > before + 20, RESUME_BOUND + 30, "closing resumed")
    return time.monotonic() - started


def settled(engine: Engine) -> int:
    """The count once the dead worker's commits in flight have landed."""
    last = -1
    while (now := ended(engine)) != last:
        last = now
        time.sleep(0.5)
    return now


def killpg(worker: Worker, sig: int) -> None:
    assert worker.proc is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.proc.pid, sig)


def finish(worker: Worker, engine: Engine) -> Verdict:
    """The successor goes on closing; every room closed once, with its events.
    (Draining the whole backlog adds minutes and nothing: a room left behind
    stays eligible for the next cycle.)"""
    target = min(BACKLOG, ended(engine) + 500)
    wait_until(lambda: ended(engine) >= target, 60, "the successor goes on", 0.5)
    worker.stop()
    found = books(engine)
    verdict = found.assert_clean()  # nothing lost, nothing closed twice, no half batch
    assert found.tally.integration == found.tally.ended >= target
    return verdict


def test_a_crashed_node_is_taken_over_within_an_interval_plus_15s(db, tmp_path: Path):
    """kill -9 of the whole worker (parent, beat, pool) mid-drain, a new worker at once."""
    first = Worker(tmp_path, ENV, name="crashed").start()
    second = Worker(tmp_path, ENV, name="successor")
    try:
        mid_drain(first, db)
        killpg(first, signal.SIGKILL)
        first.stop()
        before = settled(db)
        started = time.monotonic()
        second.start()
        took = resumed_after(db, before, started)
        verdict = finish(second, db)
    finally:
        first.stop()
        second.stop()
    assert took <= RESUME_BOUND, took
    figure(
        f"kill -9 of the whole worker mid-drain ({before} of {BACKLOG} closed): "
        f"closing resumed {took:.1f}s after the new worker started (interval {INTERVAL:g}s, "
        "lease 10s); "
        f"lost {len(verdict.lost)}, duplicated {len(verdict.duplicated)} (the ledger)"
    )


def test_a_deploy_whose_broker_lost_its_queues_is_taken_over(db, tmp_path: Path):
    """A warm shutdown mid-drain while Redis restarts without persistence: the rest
    of the cycle's chain is gone with the queues; the run is not left to its lease."""
    redis = PrivateRedis().start()
    env = {**ENV, "REAPER_BROKER_URL": redis.url}
    first = Worker(tmp_path, env, name="deployed").start()
    second = Worker(tmp_path, env, name="deploy")
    try:
        mid_drain(first, db)
        assert first.proc is not None
        first.proc.send_signal(signal.SIGTERM)  # the deploy: a warm shutdown
        redis.stop()
        redis.start()  # empty: the queued phases are gone
        first.stop()
        before = settled(db)
        started = time.monotonic()
        second.start()
        took = resumed_after(db, before, started)
        verdict = finish(second, db)
    finally:
        first.stop()
        second.stop()
        redis.stop()
    assert took <= RESUME_BOUND, took
    figure(
        f"warm shutdown mid-drain with the broker's queues lost ({before} of "
        f"{BACKLOG} closed): closing resumed {took:.1f}s after the new worker started; "
        f"lost {len(verdict.lost)}, duplicated {len(verdict.duplicated)} (the ledger)"
    )


def test_a_frozen_owner_loses_the_run_and_never_commits_after_it(db, tmp_path: Path):
    """SIGSTOP of the whole worker mid-drain: a second worker takes the run over;
    woken again, the first one's lanes are fenced off and commit nothing more."""
    first = Worker(tmp_path, ENV, name="frozen").start()
    # its own broker key space: a replica that only meets the first in the database
    second = Worker(
        tmp_path, {**ENV, "REAPER_BROKER_KEY_PREFIX": f"{os.getpid()}-second:"}, name="second"
    )
    frozen_run = None
    try:
        mid_drain(first, db)
        killpg(first, signal.SIGSTOP)
        frozen_at = time.monotonic()
        with db.connect() as conn:
            frozen_run = conn.execute(
                text("SELECT run_id FROM messenger.reaper_runs WHERE finished_at IS NULL")
            ).scalar()
        assert frozen_run is not None
        before = settled(db)
        second.start()
        took = resumed_after(db, before, frozen_at)

        def outcome() -> str | None:
            with db.connect() as conn:
                return conn.execute(
                    text("SELECT outcome FROM messenger.reaper_runs WHERE run_id = :r"),
                    {"r": frozen_run},
                ).scalar()

        assert outcome() == "taken_over"
        by_frozen = frozen_events(db, frozen_run)
        killpg(first, signal.SIGCONT)
        # Woken, its lanes try their next batches and find the run fenced off; the
        # phase ends and says so when it lets go of its lock: nothing of that
        # phase commits after its lock.lost line.
        first.wait_for(
            lambda out: any(e.get("run_id") == frozen_run for e in output_events(out, "lock.lost")),
            60,
            "the woken owner's lock.lost",
        )
        assert frozen_events(db, frozen_run) == by_frozen
        verdict = finish(second, db)
    finally:
        killpg(first, signal.SIGCONT)
        first.stop()
        second.stop()
    assert took <= RESUME_BOUND, took
    figure(
        f"SIGSTOP of the owner mid-drain ({before} of {BACKLOG} closed): a second "
        f"worker resumed the closing {took:.1f}s after the freeze; the woken owner committed "
        f"nothing more ({by_frozen} rooms were its run's); lost {len(verdict.lost)}, "
        f"duplicated {len(verdict.duplicated)} (the ledger)"
    )


def frozen_events(engine: Engine, run_id: str) -> int:
    """Rooms closed by the given run (its events carry the run id)."""
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM messenger.integration_outbox"
                " WHERE payload->>'correlationId' = :r"
            ),
            {"r": run_id},
        ).scalar_one()
