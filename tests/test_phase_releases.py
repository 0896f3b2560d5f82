"""Releases tolerate each other's phases (docs/design.md#releases-and-the-schema).

A cycle's chain is one ``reaper.reap_phase`` per phase of the release that
built it. A worker given a phase its release does not know (a newer release's)
goes on with the chain without it, tells it once (``phase.unknown``) and the
run records it (``reaper_runs.unknown_phases``); a newer release's phase runs
on its own workers. Tested in this process, then with this release's worker
beside one that has a phase more and one that has a phase less
(tests/support/phase_variants.py), all on one broker and one database.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from reaper import tasks
from reaper.cycle import Reaper
from reaper.phases import ORDER
from tests.conftest import ROOT
from tests.support import factory as f
from tests.support.facts import count_events, log_events
from tests.support.phase_variants import DROPPED, EXTRA, pythonpath
from tests.support.processes import Worker, wait_until

WITHIN = 30.0


def run_row(engine: Engine, run_id: str) -> tuple[str | None, list[str]]:
    """The run's outcome and the phases it recorded as unknown."""
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT outcome, unknown_phases FROM messenger.reaper_runs WHERE run_id = :r"),
            {"r": run_id},
        ).one()
    return row.outcome, list(row.unknown_phases)


def test_a_link_of_a_phase_this_release_does_not_know_is_left_out_told_once_and_recorded(
    settings, engine, monkeypatch, caplog
):
    caplog.set_level("INFO", "reaper")
    with engine.begin() as conn:
        room = f.conference(conn, as_of=f.db_now(engine), idle=timedelta(minutes=5))
    reaper = Reaper(settings, engine=engine)
    monkeypatch.setattr(tasks, "get_reaper", lambda: reaper)
    for _ in range(2):  # two cycles whose chains name a phase of a newer release
        cycle = reaper.start()
        for name in (EXTRA, *ORDER):
            link = tasks.reap_phase(name, of_run=cycle.run_id)
            assert link["run_id"] == cycle.run_id
        assert tasks.reap(finish=cycle.run_id)["failed_count"] == 0
        assert run_row(engine, cycle.run_id) == ("completed", [EXTRA])
    # the known phases ran: the room is closed; the unknown one was told once
    assert f.session_row_status(engine, room["id"]) == "Ended"
    told = log_events(caplog, "phase.unknown")
    assert [(t["phase"], tuple(t["known"])) for t in told] == [(EXTRA, ORDER)]
    # by hand, an unknown phase is a mistake, as before
    with pytest.raises(ValueError, match=f"unknown phase '{EXTRA}'"):
        tasks.reap_phase(EXTRA)


# A chain built by the sending process's release (its ORDER), for the consumer.
SEND_CHAIN = """
import json, time
from celery import chain
from reaper.phases import ORDER
from reaper.tasks import get_reaper, reap, reap_phase

for _ in range(50):
    cycle = get_reaper().start(None)
    if cycle.owns_run:
        break
    time.sleep(0.2)
assert cycle.owns_run, "the run stayed another cycle's"
links = [reap_phase.si(name, of_run=cycle.run_id) for name in ORDER]
chain(*links, reap.si(finish=cycle.run_id)).apply_async(expires=60)
print(json.dumps({"run_id": cycle.run_id, "phases": list(ORDER)}))
"""


def send_chain(env: dict[str, str], variant: str | None) -> dict[str, object]:
    """A cycle's chain sent by this release (``variant`` None) or by a variant."""
    full = {**env}
    if variant is not None:
        full["PYTHONPATH"] = pythonpath(variant, ROOT)
    sent = subprocess.run(
        [sys.executable, "-c", SEND_CHAIN],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sent.returncode == 0, sent.stderr
    chained: dict[str, object] = json.loads(sent.stdout.strip().splitlines()[-1])
    return chained


@pytest.mark.process
def test_this_release_beside_one_with_a_phase_more_and_one_with_a_phase_less(
    engine, tmp_path: Path
):
    env = {
        **os.environ,
        "REAPER_BROKER_KEY_PREFIX": f"reaper-variants-{uuid.uuid4().hex[:8]}:",
        "REAPER_POLLING_INTERVAL": "1",
    }
    now = f.db_now(engine)
    with engine.begin() as conn:
        # nobody ever joined it; active a moment ago: only the extra phase selects it
        lonely = f.conference(
            conn, as_of=now, idle=timedelta(0), age=timedelta(hours=1), peak_participant_count=0
        )
    current = Worker(tmp_path, env, beat=False, name="current")
    less = Worker(
        tmp_path, {**env, "PYTHONPATH": pythonpath("less", ROOT)}, beat=False, name="less"
    )
    more = Worker(
        tmp_path, {**env, "PYTHONPATH": pythonpath("more", ROOT)}, beat=False, name="more"
    )
    try:
        # a newer release's chain (a phase more) on this release's worker alone
        current.start()
        chained = send_chain(env, "more")
        assert chained["phases"] == [*ORDER, EXTRA]
        wait_until(
            lambda: run_row(engine, str(chained["run_id"]))[0] == "completed",
            WITHIN,
            "the newer release's chain completed on this release's worker",
        )
        assert run_row(engine, str(chained["run_id"])) == ("completed", [EXTRA])
        assert f.session_row_status(engine, lonely["id"]) == "Active"
        assert current.stop() == 0

        # this release's chain on a worker of a release without one of its phases
        less.start()
        chained = send_chain(env, None)
        wait_until(
            lambda: run_row(engine, str(chained["run_id"]))[0] == "completed",
            WITHIN,
            "this release's chain completed on the older release's worker",
        )
        assert run_row(engine, str(chained["run_id"])) == ("completed", [DROPPED])
        assert less.stop() == 0

        # the newer release's phase runs on its own workers
        more.start()
        chained = send_chain(env, "more")
        wait_until(
            lambda: run_row(engine, str(chained["run_id"]))[0] == "completed",
            WITHIN,
            "the newer release's chain completed on its own worker",
        )
        assert run_row(engine, str(chained["run_id"])) == ("completed", [])
        assert f.session_row_status(engine, lonely["id"]) == "Ended"
        assert more.stop() == 0
    finally:
        for worker in (current, less, more):
            worker.stop()
    # each worker told its unknown phase once, and no task of the chains failed
    # (the relay a closing asks for has no broker here: its Kafka errors are not ours)
    assert count_events(current.output(), "phase.unknown") == 1
    assert count_events(less.output(), "phase.unknown") == 1
    assert count_events(more.output(), "phase.unknown") == 0
    for name, worker in (("current", current), ("less", less), ("more", more)):
        assert "raised unexpected" not in worker.output(), name
