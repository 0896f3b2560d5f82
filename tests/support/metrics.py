"""Reading the worker's metrics as ``/metrics`` serves them, without its HTTP endpoint."""

from __future__ import annotations

from prometheus_client import generate_latest

from reaper import multiproc


def exposition() -> bytes:
    """What ``/metrics`` serves: every process's files in multiprocess mode."""
    return generate_latest(multiproc.serving_registry())
