"""Process set-up of the worker and of Flower: metrics mode, serving, auth.

- ``celery worker``: on ``worker_init`` (the worker's main process, before the
  pool forks) Prometheus goes into multiprocess mode in a directory of its own
  (``PROMETHEUS_MULTIPROC_DIR`` from the worker's environment, else a private
  temporary one), wiped now; the main process serves ``/metrics`` and
  ``/healthz`` once the worker is ready; each pool child configures tracing
  after the fork and says goodbye on exit.
- ``celery flower``: refuses to start without basic auth, checked when Flower
  has parsed its options (``FLOWER_BASIC_AUTH``, the command line, its config
  file); never touches the worker's metrics directory.
- anything else (``celery call``, ``inspect``): no metrics are ever created.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_ready
from celery.signals import worker_shutdown as worker_shutdown_signal

from reaper import health, logs, metrics, tracing
from reaper.config import get_settings

logger = logs.get_logger("worker")

FLOWER_AUTH_ENV = "FLOWER_BASIC_AUTH"

_server: metrics.Server | None = None


def prepare() -> None:
    """At app load, in every process that loads it: Flower's checks wait for its options."""
    from tornado.options import options

    options.add_parse_callback(_flower_options_parsed)


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


def _flower_options_parsed() -> None:
    """Tornado calls this when a program parses its options: only Flower does.

    By then Flower has applied ``FLOWER_BASIC_AUTH`` and its command line, so
    an empty ``--basic-auth=`` cannot switch auth off. Flower creates its own
    Prometheus metrics later, on its first event: here they are kept out of a
    worker's multiprocess directory it may have inherited.
    """
    from tornado.options import options

    if "basic_auth" not in options:
        return  # not Flower
    problem = auth_problem(options.basic_auth)
    if problem and not auth_problem(os.environ.get(FLOWER_AUTH_ENV)):
        problem = problem.replace("is not set", "was emptied by an option")
    if problem:
        _refuse(problem)
    metrics.keep_out_of_multiprocess()


# -- the worker ------------------------------------------------------------------


@worker_init.connect
def _worker_starting(sender: Any = None, **_: Any) -> None:
    settings = get_settings()
    if settings.metrics_port:
        metrics.enable_multiprocess(os.environ.get(metrics.MULTIPROC_ENV) or None)
    # solo/threads pools run tasks in this process: no child will configure it
    pool = str(getattr(sender, "pool_cls", "")).lower()
    if "prefork" not in pool and not tracing.enabled():
        tracing.configure()


@worker_ready.connect
def _serve_metrics(**_: Any) -> None:
    global _server
    settings = get_settings()
    if not settings.metrics_port or metrics.multiprocess_dir() is None or _server is not None:
        return
    from reaper.wiring import gauges

    try:
        _server = metrics.serve(
            settings.metrics_port,
            settings.metrics_address,
            refresh=gauges(settings).refresh,
            health=health.Check(settings).answer,
        )
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


@worker_process_init.connect
def _child_started(**_: Any) -> None:
    tracing.configure()


@worker_process_shutdown.connect
def _child_exiting(**_: Any) -> None:
    tracing.shutdown()
    metrics.child_exited(os.getpid())
