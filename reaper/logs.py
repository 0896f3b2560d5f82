"""Structured logs: every line has a stable ``event`` name plus its fields.

``log(logger, "conference.reaped", conference_id=...)`` puts the fields on the
record (``record.event``, ``record.fields``), so tests assert on names, and
:class:`JsonFormatter` renders one JSON object per line for the log pipeline.
Every name is written out where it is logged (a string, or a choice between
two) or where its fact is declared (``@logged`` in reaper/events.py), so that
docs/design.md#log-events lists each one; tests/test_docs.py reads every call
of :func:`log` and every declaration and holds that list to them.

A drain logs one line per reaped room, thousands a second beside PostgreSQL on
the same cores, so the path is kept short
(docs/history/performance-notes.md#what-the-profile-showed-and-what-changed): the record
is made without looking up the caller (the event name says where it comes from),
the plain message is built only if a handler renders it, and the line is
encoded by orjson with the timestamp's second formatted once.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

LOGGER_NAME = "reaper"


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"{LOGGER_NAME}.{name}")


def log(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        # makeRecord + handle is what Logger.log does, less findCaller's walk up
        # the stack: a quarter of a line's cost (measured), for a file and line
        # number that no JSON line shows.
        record = logger.makeRecord(
            logger.name,
            level,
            "",
            0,
            _Message(event, fields),
            (),
            None,
            extra={"event": event, "fields": fields},
        )
        logger.handle(record)


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
    def __init__(self) -> None:
        super().__init__()
        # (second, its text): replaced whole, so a thread never reads half of it
        self._second: tuple[int, str] = (-1, "")

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self._timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "event": getattr(record, "event", None) or record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        # Keys that are not strings are written as text, as json.dumps does.
        return orjson.dumps(entry, default=_plain, option=orjson.OPT_NON_STR_KEYS).decode()

    def _timestamp(self, created: float) -> str:
        """RFC 3339 in UTC with microseconds, as datetime.isoformat() writes it."""
        second = int(created)
        cached, text = self._second
        if cached != second:
            text = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            self._second = (second, text)
        return f"{text}.{int((created - second) * 1_000_000):06d}+00:00"


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
