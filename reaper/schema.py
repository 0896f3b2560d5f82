"""The schema the database holds, read as the process's own login, and judged
against this release's range (:mod:`reaper.release`,
docs/design.md#releases-and-the-schema).

The worker and beat check it at start (reaper/lifecycle.py), every ``reaper``
command that uses the database before it does anything (reaper/cli.py);
``reaper status`` and ``/healthz`` show it.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Engine

from reaper import budgets, logs, release
from reaper.config import Settings
from reaper.db import transaction
from reaper.queries import Queries
from reaper.release import Migration, SchemaState, Verdict

logger = logs.get_logger("schema")


def read(queries: Queries) -> Verdict:
    """The verdict on the schema, in the caller's transaction. A database from
    before the record (0010), or a login that may not read the revision, reads
    as older than this release needs: never an error."""
    readable = queries.schema_readable()
    revision = queries.schema_revision() if readable.revision_readable else None
    record = (
        [
            Migration(row.revision, row.kind, row.release, row.compatible_from)
            for row in queries.schema_record()
        ]
        if readable.record_readable
        else []
    )
    return release.judge(revision, record, version=release.version())


def check(engine: Engine, settings: Settings) -> Verdict:
    """The verdict, in a transaction of its own (raises SQLAlchemyError when the
    database cannot be reached)."""
    with transaction(engine, budgets.quick(settings)) as queries:
        return read(queries)


def not_the_owner(engine: Engine, settings: Settings) -> str | None:
    """The schema owner's name when this login is not (a member of) it: reaper
    migrate refuses then, even with nothing to apply. None: it may migrate (or
    the database is new, and creating the schema will say)."""
    with transaction(engine, budgets.quick(settings)) as queries:
        found = queries.schema_owner()
    return None if found is None or found.acts_as_owner else str(found.owner)


def log_verdict(verdict: Verdict, *, process: str) -> None:
    """The verdict as a log line: ``schema.checked`` (in range), ``schema.newer``
    (newer, compatible: runs), ``schema.refused`` (the process exits)."""
    fields: dict[str, Any] = {
        "revision": verdict.revision,
        "state": verdict.state.value,
        "release": verdict.version,
        "needs": verdict.needed,
        "knows": verdict.known,
        "process": process,
        "message": verdict.message(),
    }
    if verdict.state is SchemaState.SUPPORTED:
        logs.log(logger, "schema.checked", **fields)
    elif verdict.state is SchemaState.NEWER_COMPATIBLE:
        logs.log(logger, "schema.newer", level=logging.WARNING, **fields)
    else:
        logs.log(logger, "schema.refused", level=logging.ERROR, **fields)
