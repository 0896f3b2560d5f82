"""The Celery tasks' wiring (reaper.tasks, docs/design.md#tasks) on an in-process
worker: Celery's own ``celery_worker`` fixture (celery.contrib.pytest, a worker
thread with the solo pool, no Docker) running the reaper's real app, its queues,
routes and JSON serializer, against the session's real Redis.

There is no result backend (docs/design.md#tasks): a task's result is what its
``task_success`` signal carries, the value Flower shows from the worker's
task-succeeded event. The process and fault layer runs the real
``celery -A reaper worker -B`` (tests/test_worker.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from celery.signals import task_failure, task_prerun, task_success
from sqlalchemy import Engine

from reaper.cycle import Reaper
from reaper.phases import EMPTY_ROOM, IN_ORDER, ORDER, PROVISION_TIMEOUT, STALE_LIVE
from reaper.runs import COUNT_KEYS
from tests.support import factory as f
from tests.support.results import CYCLE_RESULT_KEYS, RELAY_RESULT_KEYS

WAIT = 30.0  # seconds for a task to run on the worker: far above what it takes


@dataclass
class Ran:
    """A task the worker ran: its id, name, arguments, and how it ended."""

    id: str
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any = None
    error: BaseException | None = None
    ended: threading.Event = field(default_factory=threading.Event)


class Tasks:
    """Every task the worker begins, in order, with its result once it ends."""

    def __init__(self) -> None:
        self.ran: list[Ran] = []
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)

    def prerun(self, task_id: str, task: Any, args: tuple, kwargs: dict, **_: Any) -> None:
        with self.changed:
            self.ran.append(Ran(task_id, task.name, tuple(args), dict(kwargs)))
            self.changed.notify_all()

    def success(self, sender: Any, result: Any, **_: Any) -> None:
        self._end(sender.request.id, result=result)

    def failure(self, task_id: str, exception: BaseException, **_: Any) -> None:
        self._end(task_id, error=exception)

    def _end(self, task_id: str, **how: Any) -> None:
        with self.changed:
            for ran in reversed(self.ran):
                if ran.id == task_id and not ran.ended.is_set():
                    ran.result, ran.error = how.get("result"), how.get("error")
                    ran.ended.set()
                    break
            self.changed.notify_all()

    def wait_for(self, name: str, **kwargs: Any) -> Ran:
        """The first task of that name (and those kwargs) to have ended."""

        def found() -> Ran | None:
            for ran in self.ran:
                if ran.name == name and ran.ended.is_set() and kwargs.items() <= ran.kwargs.items():
                    return ran
            return None

        with self.changed:
            assert self.changed.wait_for(found, WAIT), f"{name} {kwargs} never ended: {self.ran}"
            return found()  # type: ignore[return-value]

    def names(self) -> list[str]:
        with self._lock:
            return [ran.name for ran in self.ran]


@pytest.fixture
def celery_app(database_url: str) -> Iterator[Celery]:
    """Celery's fixture, overridden: the reaper's own app, not a test app, its
    queues emptied of what an earlier test's cycle sent (a relay request). The
    worker's start configures logging (the worker's JSON lines): put back
    afterwards so later tests capture the reaper's log records."""
    from reaper.celery_app import app

    app.control.purge()  # the session's own key space (REAPER_BROKER_KEY_PREFIX)
    loggers = [logging.getLogger(), logging.getLogger("reaper")]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    yield app
    for logger, handlers, level, propagate in saved:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.fixture
def celery_worker_parameters() -> dict[str, Any]:
    # Celery's ping check needs a result backend; the reaper has none.
    return {"perform_ping_check": False, "shutdown_timeout": WAIT}


@pytest.fixture
def tasks() -> Iterator[Tasks]:
    seen = Tasks()
    task_prerun.connect(seen.prerun, weak=False)
    task_success.connect(seen.success, weak=False)
    task_failure.connect(seen.failure, weak=False)
    yield seen
    task_prerun.disconnect(seen.prerun)
    task_success.disconnect(seen.success)
    task_failure.disconnect(seen.failure)


@pytest.fixture
def fresh_tasks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The tasks' engine objects are cached per process: built again for this
    worker, on the settings of this session. Kafka is unreachable here (no
    broker on 127.0.0.1:1): a relay pass gives up on it within a second, not
    the default's five."""
    from reaper import tasks
    from reaper.config import get_settings

    cached = (get_settings, tasks.get_reaper, tasks.get_relay, tasks.get_stop_pass)
    monkeypatch.setenv("REAPER_KAFKA_TIMEOUT", "2")
    for function in cached:
        function.cache_clear()
    yield
    monkeypatch.undo()
    for function in cached:
        function.cache_clear()


def seed_one_per_phase(engine: Engine) -> None:
    now = f.db_now(engine)  # the cycle's as_of is the database's clock
    with engine.begin() as conn:
        f.conference(conn, as_of=now, idle=timedelta(minutes=5))
        f.conference(conn, as_of=now, status="Provisioning", age=timedelta(minutes=5))
        f.conference(conn, as_of=now, idle=timedelta(hours=5), participants=1)


def test_a_cycle_replaces_itself_by_its_phases_then_its_end_under_the_original_id(
    engine: Engine, fresh_tasks: None, tasks: Tasks, celery_worker: Any
) -> None:
    from reaper.tasks import reap

    seed_one_per_phase(engine)
    sent = reap.delay()
    end = tasks.wait_for("reaper.reap", finish=tasks.wait_for("reaper.reap_phase").kwargs["of_run"])
    run_id = end.kwargs["finish"]
    cycle = [ran for ran in tasks.ran if ran.name in ("reaper.reap", "reaper.reap_phase")]
    assert [(ran.name, ran.args, ran.kwargs) for ran in cycle] == [
        ("reaper.reap", (), {}),
        *[("reaper.reap_phase", (name,), {"of_run": run_id}) for name in ORDER],
        ("reaper.reap", (), {"finish": run_id}),
    ]
    head = cycle[0]
    assert head.id == end.id == sent.id  # the last link inherits the original task id
    assert head.result is None and head.error is None  # replaced: no result of its own
    assert set(end.result) == CYCLE_RESULT_KEYS
    assert end.result["run_id"] == run_id and end.result["skipped"] is False
    counts = [end.result[key] for key in COUNT_KEYS]
    seeded = {p.count_key for p in (EMPTY_ROOM, PROVISION_TIMEOUT, STALE_LIVE)}
    assert counts == [1 if key in seeded else 0 for key in COUNT_KEYS]
    links = cycle[1 : 1 + len(ORDER)]
    for phase in links:  # each phase's share of the counts
        assert phase.result["run_id"] == run_id and phase.result["skipped"] is False
        assert set(COUNT_KEYS) <= set(phase.result)
    assert [sum(p.result[key] for p in links) for key in COUNT_KEYS] == counts


def test_a_cycle_that_ended_rooms_asks_the_relay_on_its_own_queue(
    engine: Engine, fresh_tasks: None, tasks: Tasks, celery_worker: Any
) -> None:
    """The relay pass runs at once (Kafka is unreachable here: the events stay
    pending, and the pass says so)."""
    from reaper.tasks import reap

    seed_one_per_phase(engine)
    reap.delay()
    end = tasks.wait_for("reaper.reap", finish=tasks.wait_for("reaper.reap_phase").kwargs["of_run"])
    relay = tasks.wait_for("reaper.relay_outbox")
    assert tasks.names().index("reaper.relay_outbox") > tasks.names().index("reaper.reap_phase")
    assert relay.error is None and set(relay.result) == RELAY_RESULT_KEYS
    # an event per room a phase ended (Phase.ends_active), none per room it failed
    ended = sum(end.result[p.count_key] for p in IN_ORDER if p.ends_active)
    assert relay.result["published"] + relay.result["pending"] == ended == 2


def test_a_cycle_whose_run_another_owns_is_skipped_without_a_chain(
    engine: Engine, settings: Any, fresh_tasks: None, tasks: Tasks, celery_worker: Any
) -> None:
    from reaper.tasks import reap

    owner = Reaper(settings, engine=engine).start()
    assert owner.owns_run
    reap.delay()
    head = tasks.wait_for("reaper.reap")
    assert set(head.result) == CYCLE_RESULT_KEYS
    assert head.result["skipped"] is True
    assert all(head.result[key] == 0 for key in COUNT_KEYS)
    assert "reaper.reap_phase" not in tasks.names()
    Reaper(settings, engine=engine).finish(owner.run_id)


def test_a_phase_by_hand_is_a_cycle_of_that_phase_alone(
    engine: Engine, fresh_tasks: None, tasks: Tasks, celery_worker: Any
) -> None:
    from reaper.tasks import reap_phase

    seed_one_per_phase(engine)
    reap_phase.delay(STALE_LIVE.name)
    ran = tasks.wait_for("reaper.reap_phase")
    assert set(ran.result) == CYCLE_RESULT_KEYS
    assert {key: ran.result[key] for key in COUNT_KEYS} == {
        key: int(key == STALE_LIVE.count_key) for key in COUNT_KEYS
    }
    assert tasks.names() == ["reaper.reap_phase"]  # no chain


def test_an_unknown_phase_fails_the_task_and_names_the_phases(
    fresh_tasks: None, tasks: Tasks, celery_worker: Any
) -> None:
    from reaper.tasks import reap_phase

    reap_phase.delay("everything")
    ran = tasks.wait_for("reaper.reap_phase")
    assert isinstance(ran.error, ValueError)
    assert ", ".join(ORDER) in str(ran.error)
