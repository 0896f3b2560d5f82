"""kill -9 inside a batch, 10 times, at random points of a batch, over a backlog.

Each ``reaper reap --once`` subprocess is SIGKILLed at a random moment (0-50
ms) after one of its batch statements is seen running. The process is frozen
(SIGSTOP) first and its sessions read: a kill counts as landed mid-batch when
a batch's transaction was open with rows claimed (its statement ran or runs,
its transaction holds an xid, nothing committed it) at the moment of the kill.
The test goes on until 10 kills landed so. After every kill: no half-applied
batch (every Ended/Failed row has exactly its outbox rows and every outbox row
its transition), nothing twice, the run lock free within REAPER_LOCK_TTL; at
the end the backlog is fully drained. A second test kills the prefork children
of a real ``worker -B`` mid-cycle.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from reaper.clock import rfc3339
from reaper.runs import holder
from tests.conftest import clean
from tests.support import factory as f
from tests.support import services
from tests.support.activity import BATCH_RUNNING, BATCH_TEXT
from tests.support.factory import T0
from tests.support.figures import figure
from tests.support.ledger import assert_clean, books, tally
from tests.support.processes import Worker

# A batch lasts milliseconds: poll fast enough to catch one in flight.
wait_until = functools.partial(services.wait_until, interval=0.01)

REAPER = str(Path(sys.executable).parent / "reaper")
SOAK = os.environ.get("REAPER_SOAK") == "1"
# kills that landed mid-batch; the others (the batch had just committed) count apart
KILLS = int(os.environ.get("REAPER_KILLS", "100" if SOAK else "10"))
LOCK_TTL = 5.0
ENV = {
    "REAPER_BATCH_SIZE": "25",
    "REAPER_LOCK_TTL": str(LOCK_TTL),
    "REAPER_RUN_LEASE": "2",  # the least: a killed run is taken over soonest
    "REAPER_MAX_RUN_DURATION": "4",
    "REAPER_MASS_CLOSURE_SHARE": "1",  # the backlog is all stale: not what this tests
}

BUSY = text(
    f"""
    SELECT count(*) FILTER (WHERE xact_start IS NOT NULL) AS in_xact,
           count(*) FILTER (WHERE {BATCH_RUNNING}) AS running,
           -- a batch's transaction open with rows claimed: its statement (running,
           -- or the last one of an idle transaction) is a phase batch's, and its
           -- claim's row locks gave the transaction an xid
           count(*) FILTER (WHERE xact_start IS NOT NULL AND backend_xid IS NOT NULL
                            AND query LIKE '{BATCH_TEXT}') AS in_batch
    FROM pg_stat_activity
    WHERE datname = current_database() AND application_name = 'conference-room-reaper'
      AND state <> 'idle'
    """
)


STATEMENTS_RUNNING = text(
    """
    SELECT count(*) FROM pg_stat_activity
    WHERE datname = current_database() AND application_name = 'conference-room-reaper'
      AND state = 'active'
    """
)


@pytest.fixture
def db(database_url: str) -> Iterator[Engine]:
    """The test's own engine, with its own application_name: every
    'conference-room-reaper' backend that is not idle belongs to the subject."""
    engine = create_engine(database_url, connect_args={"application_name": "reliability-test"})
    with engine.begin() as conn:
        clean(conn)
    yield engine
    engine.dispose()


def seed_backlog(engine: Engine, empty: int, provisioning: int, stale: int) -> None:
    with engine.begin() as conn:
        f.bulk_conferences(conn, empty)
        f.bulk_conferences(conn, provisioning, status="Provisioning")
        conn.execute(
            text(
                """
                WITH s AS (
                    INSERT INTO messenger.conference_sessions
                      (id, chat_id, deal_id, tenant_id, media_type, status, started_by_user_id,
                       created_at, started_at, last_activity_at, updated_at,
                       active_participant_count, peak_participant_count)
                    SELECT gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
                           gen_random_uuid(), 'Audio', 'Active', gen_random_uuid(),
                           :t - interval '6 hours', :t - interval '6 hours',
                           :t - interval '5 hours' - g * interval '1 ms', :t, 2, 2
                    FROM generate_series(1, :n) g RETURNING id
                )
                INSERT INTO messenger.conference_participants (conference_id, user_id, joined_at)
                SELECT s.id, gen_random_uuid(), :t - interval '6 hours'
                FROM s, generate_series(1, 2)
                """
            ),
            {"t": T0, "n": stale},
        )


def reap_once(log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as err:
        return subprocess.Popen(
            [REAPER, "reap", "--once", "--json", "--as-of", rfc3339(T0)],
            env={**os.environ, **ENV},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def settle(engine: Engine) -> float:
    """Seconds until the killed runner's lock and sessions are gone."""
    freed = wait_until(lambda: holder(engine) is None, LOCK_TTL, "lock free")

    def idle() -> bool:
        with engine.connect() as conn:
            return conn.execute(BUSY).one().in_xact == 0

    wait_until(idle, LOCK_TTL, "killed runner's sessions gone")
    return freed


@pytest.mark.soak
def test_kill_9_mid_batch_10_times(db, tmp_path):
    rng = random.Random(int(os.environ.get("REAPER_SEED", "5")))
    seed_backlog(db, empty=6000, provisioning=1500, stale=1500)
    total = 9000
    kills = in_batch = in_xact = exited_first = 0
    lock_waits: list[float] = []
    drained_per_run: list[int] = []
    before = tally(db)
    # every read of pg_stat_activity fresh (its snapshot lasts a transaction), on one
    # connection: a batch lasts milliseconds, a new connection a few
    watch = db.connect().execution_options(isolation_level="AUTOCOMMIT")
    while in_batch < KILLS and kills + exited_first < 4 * KILLS:
        log = tmp_path / f"run-{kills}-{exited_first}.log"
        proc = reap_once(log)

        def batch_running(proc: subprocess.Popen[bytes] = proc) -> bool:
            return watch.execute(BUSY).one().running > 0 or proc.poll() is not None

        wait_until(batch_running, 30, "a batch running")
        time.sleep(rng.uniform(0, 0.005))  # a random point of that batch, or just past it
        # Frozen, it sends nothing more: a statement in flight finishes on the
        # server, and then what its sessions show is what the kill meets (nothing
        # can commit what that statement claimed).
        proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(
                lambda: watch.execute(STATEMENTS_RUNNING).scalar_one() == 0,
                LOCK_TTL,
                "the frozen runner's statements in flight done",
            )
            at_kill = watch.execute(BUSY).one()
        finally:  # never a stopped process left behind
            finished = proc.poll() is not None
            if not finished:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        if finished:  # it finished first: not a kill
            exited_first += 1
            assert proc.returncode == 0, log.read_text()
            if tally(db).live == 0:  # it drained the rest: a backlog to kill in
                seed_backlog(db, empty=3000, provisioning=0, stale=0)
                total += 3000
            before = tally(db)  # what a finished run drained is no killed run's
            continue
        kills += 1
        in_batch += at_kill.in_batch > 0
        in_xact += at_kill.in_xact > 0
        lock_waits.append(settle(db))
        assert_clean(db)  # nothing lost, no half batch, nothing twice
        after = tally(db)
        drained_per_run.append(before.live - after.live)
        before = after
        if after.live == 0:
            seed_backlog(db, empty=3000, provisioning=0, stale=0)  # keep a backlog to kill in
            total += 3000
            before = tally(db)
    watch.close()
    # the kills did land inside batches: a transaction open with claimed rows
    assert in_batch == KILLS, f"{in_batch} of {kills} kills landed mid-batch"

    runs = 0
    while tally(db).live and runs < 20:  # recovery: plain runs drain the rest
        runs += 1
        done = subprocess.run(
            [REAPER, "reap", "--once", "--json", "--as-of", rfc3339(T0)],
            env={**os.environ, **ENV},
            capture_output=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    final = books(db)
    verdict = final.assert_clean()
    assert final.tally.live == 0 and final.tally.ended + final.tally.failed == total
    assert final.tally.integration == final.tally.ended and final.tally.realtime == total
    assert max(lock_waits) < LOCK_TTL
    figure(
        f"kill -9 of reap --once: {kills} kills ({in_batch} mid-batch: a batch's "
        f"transaction open with rows claimed; {in_xact} with a transaction open at the "
        f"signal; {exited_first} runs finished first), backlog {total} rooms, rows per "
        f"killed run {min(drained_per_run)}..{max(drained_per_run)}, lock free after "
        f"max {max(lock_waits):.3f}s (TTL {LOCK_TTL}s), {runs} recovery runs; "
        f"lost {len(verdict.lost)}, duplicated {len(verdict.duplicated)} (the ledger), "
        "half batches 0"
    )


BATCH_CLIENT = text(
    f"""
    SELECT client_port FROM pg_stat_activity
    WHERE datname = current_database() AND application_name = 'conference-room-reaper'
      AND {BATCH_RUNNING}
    LIMIT 1
    """
)


def batch_owner(engine: Engine) -> int | None:
    """The pid of the local process whose connection runs a batch statement now."""
    with engine.connect() as conn:
        port = conn.execute(BATCH_CLIENT).scalar()
    if port is None:
        return None
    out = subprocess.run(
        ["ss", "-tnpH", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
    ).stdout
    marker = "pid="
    return int(out.split(marker, 1)[1].split(",", 1)[0]) if marker in out else None


def backend_pids(engine: Engine, pid: int) -> set[int]:
    """The PostgreSQL backends serving the process ``pid``'s connections: by their
    client ports, read once while the process lives. Waited on by backend pid,
    not by port: a port the killed process used (to PostgreSQL, closed without
    TIME_WAIT, or to Redis) may be the next child's connection to PostgreSQL."""
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True)
    server_port = engine.url.port or 5432
    ports = set()
    for line in out.stdout.splitlines():
        fields = line.split()
        if f"pid={pid}," in line and fields[3].rsplit(":", 1)[1] == str(server_port):
            ports.add(int(fields[2].rsplit(":", 1)[1]))
    return sessions(engine, "client_port", ports)


def sessions(engine: Engine, column: str, values: set[int]) -> set[int]:
    """The backend pids of the sessions whose ``column`` is one of ``values``."""
    with engine.connect() as conn:
        return set(
            conn.execute(
                text(f"SELECT pid FROM pg_stat_activity WHERE {column} = ANY(:v)"),
                {"v": list(values)},
            ).scalars()
        )


@pytest.mark.process
def test_kill_9_worker_children_mid_cycle(db, tmp_path):
    """The prefork children run the phases: SIGKILL them mid-cycle; the parent
    replaces them and the next ticks finish the job."""
    rng = random.Random(7)
    seed_backlog(db, empty=6000, provisioning=0, stale=0)
    worker = Worker(
        tmp_path,
        {**ENV, "REAPER_POLLING_INTERVAL": "1", "REAPER_EMPTY_ROOM_GRACE": "1"},
        name="killed",
    )
    # the rows were stale at T0, long before the worker's real clock: all eligible
    worker.start()
    kills = 0
    victims: list[int] = []
    waits: list[float] = []
    try:
        while kills < 5 and tally(db).live:
            owner: list[int] = []

            def found(owner: list[int] = owner) -> bool:
                pid = batch_owner(db)
                if pid is not None:
                    owner.append(pid)
                return bool(owner) or not tally(db).live

            wait_until(found, 30, "a batch running in a worker child")
            if not owner:
                break
            assert worker.proc is not None and owner[0] != worker.proc.pid
            time.sleep(rng.uniform(0, 0.02))
            backends = backend_pids(db, owner[0])
            if not backends:
                # its batch ended and its connection went back before they were
                # read (seen once): find a batch again; if none is ever found,
                # kills stays short of 5 below
                continue
            try:
                os.kill(owner[0], signal.SIGKILL)
            except ProcessLookupError:
                continue
            victims.append(owner[0])
            kills += 1
            gone = wait_until(
                lambda backends=backends: not sessions(db, "pid", backends),
                LOCK_TTL,
                "sessions gone",
            )
            waits.append(gone)
            assert_clean(db)
        wait_until(lambda: tally(db).live == 0, 90, "backlog drained by the worker")
    finally:
        worker.stop()
    final = books(db)
    verdict = final.assert_clean()
    assert final.tally.ended == 6000 and final.tally.integration == 6000
    assert kills == 5, f"only {kills} kills landed in a batch"
    assert worker.output().count("exited with 'signal 9 (SIGKILL)'") == kills
    figure(
        f"kill -9 of worker children: {kills} kills inside a batch statement, "
        f"their sessions (and locks) gone after max {max(waits):.3f}s, 6000 rooms "
        f"drained by later ticks without a restart by hand; lost {len(verdict.lost)}, "
        f"duplicated {len(verdict.duplicated)} (the ledger)"
    )
