"""The worker's signal handlers: one per signal, all in reaper.lifecycle, each
running its steps in the order the module's docstring gives."""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from celery.signals import (
    after_setup_logger,
    beat_init,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

# The app and its tasks, as a worker loads them: every handler is connected.
import reaper.celery_app
import reaper.tasks  # noqa: F401
from reaper import db, endpoint, kafka, lifecycle, logs, multiproc, tracing, wiring
from reaper.config import Settings

SIGNALS = (
    after_setup_logger,
    worker_init,
    beat_init,
    worker_ready,
    worker_process_init,
    worker_shutting_down,
    worker_process_shutdown,
    worker_shutdown,
)


def reaper_receivers(signal: Any) -> list[Callable[..., Any]]:
    """The receivers of ``signal`` that the reaper's own modules connected."""
    receivers = []
    for _, ref in signal.receivers:
        receiver = ref() if isinstance(ref, weakref.ReferenceType) else ref
        if receiver is not None and receiver.__module__.startswith("reaper"):
            receivers.append(receiver)
    return receivers


@pytest.mark.parametrize("signal", SIGNALS, ids=lambda s: s.name)
def test_each_worker_signal_has_one_handler_in_lifecycle(signal: Any) -> None:
    receivers = reaper_receivers(signal)
    assert [r.__module__ for r in receivers] == ["reaper.lifecycle"], receivers


class Pool:
    """What Celery passes as the sender of worker_init: only ``pool_cls`` is read."""

    pool_cls = "celery.concurrency.solo:TaskPool"


class App:
    def send_task(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the relay request is recorded here, never sent")


class PreforkPool:
    """A prefork worker as the sender of worker_init: its pool and its app."""

    pool_cls = "celery.concurrency.prefork:TaskPool"
    app = App()


def test_a_worker_runs_each_signal_s_steps_in_lifecycle_order(
    monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    steps: list[str] = []

    def record(name: str, result: Any = None) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            steps.append(name)
            return result

        return step

    real_stopping = lifecycle.stopping

    def stopping() -> Any:
        steps.append("stopping")
        return real_stopping()

    server = endpoint.Server(port=1, close=record("server.close"))
    settings = Settings(database_url=database_url, metrics_port=9808, recorder_url=None)
    monkeypatch.setattr(lifecycle, "get_settings", lambda: settings)
    monkeypatch.setattr(lifecycle, "stopping", stopping)
    monkeypatch.setattr(lifecycle, "_stopping", None)  # a stop event of this test's own
    monkeypatch.setattr(lifecycle, "_server", None)
    monkeypatch.setattr(lifecycle, "_schema_checked", False)
    monkeypatch.setattr(logs, "configure", record("logs.configure"))
    monkeypatch.setattr(logs, "log", lambda _logger, event, **_: steps.append(f"log {event}"))
    monkeypatch.setattr(multiproc, "enable_multiprocess", record("multiproc.enable_multiprocess"))
    monkeypatch.setattr(multiproc, "multiprocess_dir", lambda: "/metrics-dir")
    monkeypatch.setattr(endpoint, "serve", record("endpoint.serve", server))
    monkeypatch.setattr(multiproc, "child_exited", record("multiproc.child_exited"))
    monkeypatch.setattr(tracing, "enabled", lambda: False)
    monkeypatch.setattr(tracing, "configure", record("tracing.configure"))
    monkeypatch.setattr(tracing, "shutdown", record("tracing.shutdown"))
    monkeypatch.setattr(db, "dispose_engines", record("db.dispose_engines"))
    monkeypatch.setattr(kafka, "close_producer", record("kafka.close_producer"))
    monkeypatch.setattr(wiring, "request_relay_on_events", record("wiring.request_relay_on_events"))
    monkeypatch.setattr(gc, "freeze", record("gc.freeze"))

    def during(signal: Any, **named: Any) -> list[str]:
        steps.clear()
        signal.send(sender=named.pop("sender", None), **named)
        return list(steps)

    assert during(worker_init, sender=Pool()) == [
        "logs.configure",
        # the schema, before anything else is set up (the session's database: in range)
        "db.dispose_engines",  # its connection is not handed to the children
        "log schema.checked",
        "stopping",  # created before the pool forks, so the children share it
        "multiproc.enable_multiprocess",
        "tracing.configure",  # a solo pool runs tasks in the main process
        "log recorder.disabled",
    ]
    assert during(worker_init, sender=PreforkPool()) == [
        "logs.configure",
        "db.dispose_engines",
        "log schema.checked",
        "stopping",
        "multiproc.enable_multiprocess",
        # before the fork: every pool child's drains ask for relay passes
        "wiring.request_relay_on_events",
        "log recorder.disabled",
        "gc.freeze",  # before the fork: the children's collections skip it too
    ]
    assert during(beat_init) == []  # an embedded beat: checked with its worker
    monkeypatch.setattr(lifecycle, "_schema_checked", False)  # `celery beat` on its own
    assert during(beat_init) == ["logs.configure", "db.dispose_engines", "log schema.checked"]
    assert during(worker_ready) == ["endpoint.serve"]
    assert during(worker_process_init) == ["db.dispose_engines", "tracing.configure", "gc.freeze"]
    assert during(worker_shutting_down, sig="SIGTERM", how="Warm") == [
        "stopping",
        "log worker.stopping",
    ]
    assert lifecycle._stopping is not None and lifecycle._stopping.is_set()
    assert during(worker_process_shutdown, pid=os.getpid()) == [
        "kafka.close_producer",
        "tracing.shutdown",
        "multiproc.child_exited",
    ]
    assert during(worker_shutdown) == [
        "kafka.close_producer",
        "tracing.shutdown",
        "server.close",
    ]
