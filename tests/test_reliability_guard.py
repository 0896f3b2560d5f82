"""The mass-closure guard of stale_live: when one cycle would end more than
REAPER_MASS_CLOSURE_SHARE of the Active conferences (and more than
REAPER_MASS_CLOSURE_FLOOR), the phase ends nothing, logs
``phase.mass_closure_blocked`` at ERROR, and an operator can override it for
one run with ``reaper reap --once --allow-mass-closure``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from reaper import metrics
from reaper.clock import rfc3339
from reaper.config import Settings
from reaper.cycle import Reaper
from tests.support import factory as f
from tests.support.factory import T0
from tests.support.facts import fields, log_records

REAPER = str(Path(sys.executable).parent / "reaper")


def seed(engine: Engine, *, stale: int, fresh: int, empty: int = 0) -> None:
    """``stale`` rooms with people in them whose heartbeats stopped 5 h ago,
    ``fresh`` live rooms, ``empty`` rooms empty for 5 minutes."""
    with engine.begin() as conn:
        for _ in range(stale):
            f.conference(conn, idle=timedelta(hours=5), age=timedelta(hours=6), participants=2)
        for _ in range(fresh):
            f.conference(conn, idle=timedelta(minutes=1), participants=2)
        for _ in range(empty):
            f.conference(conn, idle=timedelta(minutes=5))


def count(engine: Engine, status: str, reason: str | None = None) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM messenger.conference_sessions WHERE status = :s"
                " AND end_reason IS NOT DISTINCT FROM :r"
            ),
            {"s": status, "r": reason},
        ).scalar_one()


def outbox_rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM messenger.integration_outbox")).scalar_one()


def test_defaults_are_half_and_a_floor_of_20():
    settings = Settings()
    assert settings.mass_closure_share == 0.5 and settings.mass_closure_floor == 20


def blocked_total() -> float:
    return metrics.sample("messenger_conf_reaper_mass_closure_blocked_total")


def test_presence_outage_is_blocked_and_other_phases_go_on(settings, engine, caplog):
    caplog.set_level(logging.INFO, "reaper")
    seed(engine, stale=30, fresh=10, empty=3)  # 30 of 40 live rooms look stale
    before = blocked_total()
    result = Reaper(settings, engine=engine).run_cycle(T0)
    assert blocked_total() == before + 1
    assert result["stale_timeout_count"] == 0
    assert result["empty_timeout_count"] == 3  # empty_room is not guarded
    assert count(engine, "Active") == 40 and count(engine, "Ended", "Timeout") == 0
    assert outbox_rows(engine) == 3
    [blocked] = log_records(caplog, "phase.mass_closure_blocked")
    assert blocked.levelno == logging.ERROR
    assert (
        fields(blocked).items()
        >= {
            "phase": "stale_live",
            "eligible": 30,
            "active": 40,
            "share": 0.5,
            "floor": 20,
            "run_id": result["run_id"],
        }.items()
    )
    assert not log_records(caplog, "conference.reaped") or all(
        fields(r)["phase"] == "empty_room" for r in log_records(caplog, "conference.reaped")
    )


def test_at_or_below_the_share_is_reaped(settings, engine, caplog):
    caplog.set_level(logging.INFO, "reaper")
    seed(engine, stale=25, fresh=25)  # exactly half: not more than the share
    result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["stale_timeout_count"] == 25
    assert not log_records(caplog, "phase.mass_closure_blocked")


def test_at_or_below_the_floor_is_reaped_even_when_all_are_stale(settings, engine, caplog):
    caplog.set_level(logging.INFO, "reaper")
    seed(engine, stale=20, fresh=0)  # 100 % but only the floor
    result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["stale_timeout_count"] == 20
    assert not log_records(caplog, "phase.mass_closure_blocked")


def test_one_above_the_floor_is_blocked(settings, engine, caplog):
    caplog.set_level(logging.INFO, "reaper")
    seed(engine, stale=21, fresh=0)
    result = Reaper(settings, engine=engine).run_cycle(T0)
    assert result["stale_timeout_count"] == 0 and count(engine, "Active") == 21
    assert len(log_records(caplog, "phase.mass_closure_blocked")) == 1


def test_override_lets_one_run_through_and_says_so(settings, engine, caplog):
    caplog.set_level(logging.INFO, "reaper")
    seed(engine, stale=30, fresh=10)
    before = blocked_total()
    reaper = Reaper(settings, engine=engine, allow_mass_closure=True)
    result = reaper.run_cycle(T0)
    assert blocked_total() == before
    assert result["stale_timeout_count"] == 30 and count(engine, "Ended", "Timeout") == 30
    [allowed] = log_records(caplog, "phase.mass_closure_allowed")
    assert allowed.levelno == logging.WARNING and fields(allowed)["eligible"] == 30
    assert not log_records(caplog, "phase.mass_closure_blocked")
    assert outbox_rows(engine) == 30


def test_share_of_one_turns_the_guard_off(database_url, engine):
    settings = Settings(database_url=database_url, mass_closure_share=1)
    seed(engine, stale=30, fresh=0)
    assert Reaper(settings, engine=engine).run_cycle(T0)["stale_timeout_count"] == 30


def test_poison_rows_do_not_count_as_eligible(database_url, refusing_database, caplog):
    """Rows the database refused earlier in the cycle (poison, left out for the
    cycle) are out of the guard's census."""
    engine = refusing_database
    caplog.set_level(logging.INFO, "reaper")
    settings = Settings(database_url=database_url, mass_closure_floor=2)
    with engine.begin() as conn:
        for _ in range(3):  # empty and stale: empty_room meets them first, and is refused
            f.refuse(conn, f.conference(conn, idle=timedelta(hours=5))["id"])
        good = f.conference(conn, idle=timedelta(hours=5), age=timedelta(hours=6), participants=1)
        for _ in range(3):
            f.conference(conn, idle=timedelta(minutes=1), participants=2)
    result = Reaper(settings, engine=engine).run_cycle(T0)
    # the census leaves out the cycle's poison rows: 1 eligible <= floor 2
    assert result["stale_timeout_count"] == 1 and result["failed_count"] == 3, result
    assert not log_records(caplog, "phase.mass_closure_blocked")
    with engine.connect() as conn:
        assert f.statuses(conn)[good["id"]] == ("Ended", "Timeout")


def test_celery_phase_task_is_guarded_too(engine, caplog):
    """``reaper.reap_phase`` run by hand goes through the same guard."""
    from reaper.tasks import get_reaper, reap_phase

    caplog.set_level(logging.INFO, "reaper")
    get_reaper.cache_clear()
    seed(engine, stale=30, fresh=10)
    result = reap_phase("stale_live", as_of=rfc3339(T0))
    assert result["stale_timeout_count"] == 0 and count(engine, "Active") == 40
    assert len(log_records(caplog, "phase.mass_closure_blocked")) == 1


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [REAPER, "reap", "--once", "--json", "--as-of", rfc3339(T0), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ.copy(),
    )


@pytest.mark.process
def test_cli_blocks_then_override_for_one_run_then_blocks_again(engine):
    seed(engine, stale=30, fresh=10)
    blocked = run_cli()
    assert blocked.returncode == 0, blocked.stderr
    assert json.loads(blocked.stdout)["stale_timeout_count"] == 0
    lines = [json.loads(line) for line in blocked.stderr.splitlines() if line.startswith("{")]
    [guard] = [e for e in lines if e["event"] == "phase.mass_closure_blocked"]
    assert guard["level"] == "ERROR" and guard["eligible"] == 30 and guard["active"] == 40
    assert "--allow-mass-closure" in blocked.stderr.splitlines()[-1]
    assert count(engine, "Active") == 40 and outbox_rows(engine) == 0

    allowed = run_cli("--allow-mass-closure")
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["stale_timeout_count"] == 30
    assert count(engine, "Ended", "Timeout") == 30 and outbox_rows(engine) == 30

    seed(engine, stale=25, fresh=0)  # the override was for that run only
    again = run_cli()
    assert json.loads(again.stdout)["stale_timeout_count"] == 0
    assert '"phase.mass_closure_blocked"' in again.stderr
