"""One cycle at a time: a cycle owns the run from its first phase to its end
(docs/design.md#one-cycle-at-a-time).

The second runner is always the real ``reaper reap --once``; the first is the
engine the worker's tasks run, driven phase by phase so that the gap between
two phase subtasks (another process, a queue wait) can be held open on purpose.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import Engine, text

from reaper.cycle import Reaper
from reaper.events import CountKey, CycleCompleted, PhaseFailed
from tests.support import factory as f
from tests.support.facts import FactRecorder
from tests.support.figures import figure
from tests.support.processes import ROOT, run_cli, wait_until

COUNTS: tuple[CountKey, ...] = (
    "empty_timeout_count",
    "provision_failed_count",
    "stale_timeout_count",
    "skipped_locked_count",
    "failed_count",
)


def seed(engine: Engine) -> dict[str, dict]:
    now = f.db_now(engine)
    with engine.begin() as conn:
        return {
            "empty": f.conference(conn, as_of=now, idle=timedelta(minutes=5)),
            "provisioning": f.conference(
                conn, as_of=now, status="Provisioning", age=timedelta(minutes=5)
            ),
            "stale": f.conference(conn, as_of=now, idle=timedelta(hours=5), participants=1),
        }


def reap_once(**env: str) -> dict:
    done = run_cli("reap", "--once", "--json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def assert_skipped_whole(result: dict) -> None:
    assert result["skipped"] is True
    assert [result[k] for k in COUNTS] == [0, 0, 0, 0, 0]
    assert result["paused"] == []


@pytest.mark.process
def test_a_cycle_between_its_phases_still_owns_the_run(settings, engine, facts: FactRecorder):
    rooms = seed(engine)
    owner = Reaper(settings, engine=engine)
    cycle = owner.start()
    assert cycle.owns_run
    owner.run_phase("empty_room", cycle.run_id)
    # The gap between two phase subtasks: no lock is held now, the run is.
    other = reap_once()
    assert_skipped_whole(other)
    with engine.connect() as conn:
        statuses = f.statuses(conn)
    assert statuses[rooms["provisioning"]["id"]] == ("Provisioning", None)  # untouched
    assert statuses[rooms["stale"]["id"]] == ("Active", None)
    owner.run_phase("provision_timeout", cycle.run_id)
    owner.run_phase("stale_live", cycle.run_id)
    result = owner.finish(cycle.run_id)
    assert result["skipped"] is False
    assert [result[k] for k in COUNTS[:3]] == [1, 1, 1]
    # The run is free again: the next cycle owns it.
    assert reap_once()["skipped"] is False


def sleeping(engine: Engine) -> bool:
    """A session of the database sleeps in the test's trigger."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT EXISTS (SELECT FROM pg_stat_activity"
                    " WHERE wait_event = 'PgSleep' AND datname = current_database())"
                )
            ).scalar()
        )


@pytest.mark.process
def test_a_slowed_phase_skips_every_other_cycle_whole(settings, engine):
    """A trigger makes the empty_room batch sleep: CLI runs meanwhile are skipped."""
    rooms = seed(engine)
    with engine.begin() as conn:
        conn.execute(
            text(
                """
                CREATE FUNCTION messenger.test_slow() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN PERFORM pg_sleep(10); RETURN NEW; END $$;
                CREATE TRIGGER test_slow BEFORE UPDATE ON messenger.conference_sessions
                FOR EACH ROW WHEN (NEW.end_reason = 'EmptyTimeout')
                EXECUTE FUNCTION messenger.test_slow();
                """
            )
        )
    owner = subprocess.Popen(
        [str(ROOT / ".venv/bin/reaper"), "reap", "--once", "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # the owner is inside its slowed first phase (seen, not slept for: a CLI
        # starts in a second on a quiet machine, in several on a busy one)
        wait_until(lambda: sleeping(engine), 30, "the owner's batch in the slowed trigger")
        others = [reap_once() for _ in range(2)]
        assert sleeping(engine), "the owner's phase ended before the other runs did"
        out, err = owner.communicate(timeout=60)
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER test_slow ON messenger.conference_sessions"))
            conn.execute(text("DROP FUNCTION messenger.test_slow()"))
    assert owner.returncode == 0, err
    for other in others:
        assert_skipped_whole(other)
    result = json.loads(out)
    assert [result[k] for k in COUNTS[:3]] == [1, 1, 1]
    with engine.connect() as conn:
        assert f.session_row(conn, rooms["empty"]["id"])["status"] == "Ended"


def test_a_phase_that_cannot_take_the_lock_fails_and_never_reports_skipped(
    settings, engine, facts: FactRecorder
):
    """Another session holds the key between two phases: the owner's next phase
    fails (counted), the cycle reports what it did, never ``skipped``."""
    seed(engine)
    settings = settings.model_copy(update={"lock_ttl": timedelta(seconds=40)})
    owner = Reaper(settings, engine=engine)
    cycle = owner.start()
    owner.run_phase("empty_room", cycle.run_id)
    with engine.connect() as holder, holder.begin():
        holder.execute(
            text(
                "SELECT pg_advisory_xact_lock("
                "hashtextextended('messenger.conference-room-reaper', 0))"
            )
        )
        phase = owner.run_phase("provision_timeout", cycle.run_id)
    owner.run_phase("stale_live", cycle.run_id)
    result = owner.finish(cycle.run_id)
    assert phase["skipped"] is True and phase["provision_failed_count"] == 0
    assert result["skipped"] is False
    assert (result["empty_timeout_count"], result["provision_failed_count"]) == (1, 0)
    assert result["stale_timeout_count"] == 1
    [failed] = [p for p in facts.of(PhaseFailed) if p.phase == "provision_timeout"]
    assert failed.error.startswith("RunLockBusy: the single-runner lock is held by another")
    [end] = facts.of(CycleCompleted)
    assert end.errors == 1


@pytest.mark.parametrize("name", ["of_run", "cycle"])
def test_a_chain_link_runs_the_phase_of_its_cycle(settings, engine, monkeypatch, name: str):
    """reaper.reap_phase given a run id runs that cycle's phase, not a cycle of its
    own: as ``of_run``, and as ``cycle``, the name older workers queue it with."""
    from reaper import tasks

    seed(engine)
    owner = Reaper(settings, engine=engine)
    monkeypatch.setattr(tasks, "get_reaper", lambda: owner)
    cycle = owner.start()
    phase = tasks.reap_phase("empty_room", **{name: cycle.run_id})
    result = owner.finish(cycle.run_id)
    assert phase["run_id"] == cycle.run_id and phase["empty_timeout_count"] == 1
    assert result["empty_timeout_count"] == 1 and result["stale_timeout_count"] == 0


@pytest.mark.process
def test_a_dead_owner_is_taken_over_within_its_lease(settings, engine):
    """The owner took the run, ran a phase, and was killed between phases."""
    rooms = seed(engine)
    # Long enough that the first `reaper reap --once` after the kill starts and
    # reads the run inside it: a CLI takes about a second to start, several on
    # a busy machine (3 s was once too short there).
    lease = 8.0
    env = {"REAPER_RUN_LEASE": str(lease), "REAPER_MAX_RUN_DURATION": "2"}
    script = textwrap.dedent(
        f"""
        import os, signal
        from datetime import timedelta
        from reaper.config import Settings
        from reaper.cycle import Reaper
        settings = Settings(database_url={settings.database_url!r},
                            run_lease=timedelta(seconds={lease}),
                            max_run_duration=timedelta(seconds=2))
        reaper = Reaper(settings)
        cycle = reaper.start()
        reaper.run_phase("empty_room", cycle.run_id)
        print(cycle.run_id, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None and owner.stderr is not None  # both piped
    try:
        dead_run = owner.stdout.readline().strip()
        assert dead_run, owner.stderr.read() if owner.poll() is not None else "no run id"
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        died = time.monotonic()
        assert_skipped_whole(reap_once(**env))  # the lease is still running
        assert time.monotonic() - died < lease, "the check above came after the lease"
        while True:
            result = reap_once(**env)
            if not result["skipped"]:
                break
            assert time.monotonic() - died < lease + 2, "not taken over within the run lease"
            time.sleep(0.2)
        took = time.monotonic() - died
    finally:
        if owner.poll() is None:
            owner.kill()
    assert result["provision_failed_count"] == 1 and result["stale_timeout_count"] == 1
    with engine.connect() as conn:
        run = conn.execute(
            text("SELECT outcome FROM messenger.reaper_runs WHERE run_id = :r"), {"r": dead_run}
        ).scalar_one()
        assert f.session_row(conn, rooms["empty"]["id"])["status"] == "Ended"
    assert run == "taken_over"
    figure(f"a killed owner's run taken over {took:.2f}s after its death (lease {lease}s)")


def test_the_end_of_a_run_that_no_longer_exists_is_lost_not_a_traceback(
    settings, engine, facts: FactRecorder
):
    """A chain's last link delivered after its run's row is gone (deleted a day
    after its end; seen in the suite: a link left in the broker's queue by an
    earlier test, whose rows were emptied): the end is reported lost, as the end
    of a run taken over is, and raises nothing (it was a ValueError's traceback
    at ERROR in the worker's log)."""
    gone = str(uuid.uuid4())
    result = Reaper(settings, engine=engine).finish(gone)
    assert result["run_id"] == gone and result["skipped"] is False
    assert [result[k] for k in COUNTS] == [0, 0, 0, 0, 0]
    [end] = facts.of(CycleCompleted)
    assert (end.run_id, end.lost, end.errors) == (gone, True, 1)
