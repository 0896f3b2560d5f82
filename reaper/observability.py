"""Process set-up for metrics, traces and Flower, by the ``celery`` command being run.

:func:`prepare` runs when the Celery app is loaded (``reaper/celery_app.py``),
which ``celery`` does before it runs the sub-command and before the worker
imports the tasks, so before any metric exists in the process:

- ``celery worker``: Prometheus multiprocess mode in a directory of its own
  (``PROMETHEUS_MULTIPROC_DIR`` if set, else a private temporary one), wiped
  now; the parent serves ``/metrics`` once the worker is ready; each pool
  child configures tracing after the fork and says goodbye on exit.
- ``celery flower``: refuses to start without ``FLOWER_BASIC_AUTH``; never
  touches the worker's metrics directory.
- anything else (``celery call``, ``inspect``, the ``reaper`` CLI): plain
  in-process metrics that nobody serves.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click
from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_ready
from celery.signals import worker_shutdown as worker_shutdown_signal

from reaper import logs, metrics, tracing
from reaper.config import get_settings

logger = logs.get_logger("worker")

FLOWER_AUTH_ENV = "FLOWER_BASIC_AUTH"

_server: metrics.Server | None = None


def celery_command() -> str | None:
    """The ``celery`` sub-command this process runs (``worker``, ``flower``...), if any."""
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        if getattr(ctx, "invoked_subcommand", None):
            return ctx.invoked_subcommand
        ctx = ctx.parent
    return None


def prepare(command: str | None = None) -> str | None:
    command = command if command is not None else celery_command()
    if command == "flower":
        require_flower_auth()
    metrics.prepare_process(command, get_settings().metrics_port)
    return command


# -- Flower --------------------------------------------------------------------


def auth_problem(value: str | list[str] | None) -> str | None:
    """Why a basic-auth setting is unusable, or None when it is fine."""
    entries = value.split(",") if isinstance(value, str) else list(value or [])
    entries = [e.strip() for e in entries]
    if not entries or entries == [""]:
        return "is not set"
    for entry in entries:
        user, sep, password = entry.partition(":")
        if not sep or not user or not password:
            return "must be user:password[,user:password...] with a non-empty password"
    return None


def _refuse(problem: str) -> None:
    print(
        f"reaper: refusing to start Flower: {FLOWER_AUTH_ENV} {problem} "
        "(without auth anyone who reaches it can revoke and terminate tasks)",
        file=sys.stderr,
    )
    raise SystemExit(2)


def require_flower_auth() -> None:
    """Exit unless Flower will run with basic auth from ``FLOWER_BASIC_AUTH``.

    Checked now, from the environment, and again after Flower has parsed its
    command line and config file (a tornado parse callback), so an empty
    ``--basic-auth=`` cannot switch it off.
    """
    problem = auth_problem(os.environ.get(FLOWER_AUTH_ENV))
    if problem:
        _refuse(problem)
    from tornado.options import options

    def check_parsed() -> None:
        parsed = options.basic_auth if "basic_auth" in options else None
        problem = auth_problem(parsed)
        if problem:
            _refuse(problem.replace("is not set", "was emptied by an option"))

    options.add_parse_callback(check_parsed)


# -- the worker ------------------------------------------------------------------


def _refresh() -> None:
    from reaper.cycle import utcnow
    from reaper.db import engine_for
    from reaper.overview import refresh_gauges

    settings = get_settings()
    refresh_gauges(engine_for(settings.database_url), settings, utcnow())


@worker_ready.connect
def _serve_metrics(**_: Any) -> None:
    global _server
    settings = get_settings()
    if not settings.metrics_port or metrics.multiprocess_dir() is None or _server is not None:
        return
    try:
        _server = metrics.serve(settings.metrics_port, settings.metrics_address, _refresh)
    except OSError as exc:
        logs.log(
            logger, "metrics.unavailable", level=40, port=settings.metrics_port, error=str(exc)
        )


@worker_shutdown_signal.connect
def _stop_metrics(**_: Any) -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


@worker_init.connect
def _worker_starting(sender: Any = None, **_: Any) -> None:
    # solo/threads pools run tasks in this process: no child will configure it
    pool = str(getattr(sender, "pool_cls", "")).lower()
    if "prefork" not in pool and not tracing.enabled():
        tracing.configure()


@worker_process_init.connect
def _child_started(**_: Any) -> None:
    tracing.configure()


@worker_process_shutdown.connect
def _child_exiting(**_: Any) -> None:
    tracing.shutdown()
    metrics.child_exited(os.getpid())
