"""Conference room reaper: the safety net that closes orphaned conferences.

``celery -A reaper ...`` finds the Celery app as ``reaper.app`` (or
``reaper.celery``); it is loaded on first access so that the CLI and the
library can be imported without building it.
"""

from typing import Any

__all__ = ["app", "celery"]


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):
        from reaper.celery_app import app

        return app
    raise AttributeError(f"module 'reaper' has no attribute {name!r}")
