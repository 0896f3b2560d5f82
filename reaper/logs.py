"""Structured logs: every line has a stable ``event`` name plus its fields.

``log(logger, "conference.reaped", conference_id=...)`` puts the fields on the
record (``record.event``, ``record.fields``), so tests assert on names, and
:class:`JsonFormatter` renders one JSON object per line for the log pipeline.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

LOGGER_NAME = "reaper"


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"{LOGGER_NAME}.{name}")


def log(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, _Message(event, fields), extra={"event": event, "fields": fields})


class _Message:
    """``event k=v ...``, built only if a handler renders the plain message (the
    JSON formatter does not): one per reaped room otherwise (bench/)."""

    __slots__ = ("event", "fields")

    def __init__(self, event: str, fields: dict[str, Any]) -> None:
        self.event = event
        self.fields = fields

    def __str__(self) -> str:
        return " ".join([self.event, *(f"{k}={_plain(v)}" for k, v in self.fields.items())])


def _plain(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "event": getattr(record, "event", None) or record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=_plain)


def configure(level: str = "INFO") -> None:
    """Send the reaper's logs as JSON lines to stderr (worker and CLI)."""
    logger = logging.getLogger(LOGGER_NAME)
    if any(isinstance(h.formatter, JsonFormatter) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
