"""Named SQL queries (``sql/queries.sql``) and one method per query.

The SQL lives in one file, loaded once; Python only binds parameters and
reads rows, so a reader finds every statement the reaper runs in one place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Connection, CursorResult, Row, TextClause, text

from reaper.budgets import KEEPALIVE_PROBES, Budget

QUERIES_FILE = Path(__file__).with_name("sql") / "queries.sql"
# a fragment may name its arguments: "-- fragment: x(a, b)", "-- include: x(y, z)"
_ARGS = r"(?:\((?P<args>[a-z_]+(?:, [a-z_]+)*)\))?"
_HEADER = re.compile(rf"^-- (?P<kind>name|fragment): (?P<name>[a-z_]+){_ARGS}\s*$", re.MULTILINE)
_INCLUDE = re.compile(
    rf"^[ \t]*-- include: (?P<name>(?:\{{phase\}})?[a-z_]+){_ARGS}[ \t]*$", re.MULTILINE
)
# where a fragment's argument stands in its text: "{a}"
_PLACEHOLDER = re.compile(r"\{(?P<name>[a-z_]+)\}")
# "-- for each phase": a query written once per phase (or once per phase whose
# rooms become, or do not become, a status: "-- for each phase becoming Ended")
_FOR_EACH = re.compile(
    r"\A-- for each phase(?: (?P<not>not )?becoming (?P<status>[A-Za-z]+))?[ \t]*\n"
)
# "-- include each phase: x", "-- include each earlier phase joined by UNION ALL: x"
_INCLUDE_EACH = re.compile(
    r"^[ \t]*-- include each (?P<which>phase|earlier phase)"
    r"(?: joined by (?P<joint>[A-Z][A-Z ]*[A-Z]|,))?: (?P<name>[a-z_]+)[ \t]*$",
    re.MULTILINE,
)
# a fragment's own comment lines (not an include that begins it)
_LEADING_COMMENT = re.compile(r"\A(?:--(?! include)[^\n]*\n)+")
PHASE = "{phase}"
# what a phase's values stand for in a statement written for it (PhaseSql)
_BOUND = ("phase", "since", "status", "end_reason")

# A row of any query: its columns are the statement's, which the type checker
# does not read.
ResultRow = Row[*tuple[Any, ...]]


@dataclass(frozen=True, kw_only=True)
class PhaseSql:
    """What a statement written for a phase takes of it (reaper/phases.py's Phase
    is one): in such a statement ``{phase}`` stands for its name, ``{since}`` for
    the column of conference_sessions its lateness counts from, ``{status}`` and
    ``{end_reason}`` for what its rooms become; and ``-- include:
    {phase}_selects`` for its predicate, the one fragment a phase writes in
    sql/queries.sql."""

    name: str
    since: str
    status: str
    end_reason: str

    def binds(self) -> dict[str, str]:
        values = {"phase": self.name, "since": self.since, "status": self.status}
        values["end_reason"] = self.end_reason
        for key, value in values.items():
            if not re.fullmatch(r"[A-Za-z_]+", value):  # pasted into SQL: a name only
                raise ValueError(f"phase {self.name!r}: {key} {value!r} is not a plain name")
        return values


class OutboxRow(NamedTuple):
    """A claimed outbox row, as the relay sends it (``claim_outbox_batch``'s
    columns, in their order). A plain tuple, not a SQLAlchemy Row: the relay reads
    a row's fields several times per event, and a Row's attribute access costs
    ten times a tuple's
    (docs/history/performance-notes.md#the-relays-own-python-per-event-6-december-night)."""

    id: int
    event_id: str
    topic: str
    message_key: str
    attempts: int
    value: str  # the payload as the text Kafka gets
    event_type: str | None
    correlation_id: str | None


def phase_statement(name: str, phase: str) -> str:
    """The key of a query written once per phase (``-- for each phase``), for that phase."""
    return f"{name}[{phase}]"


class NeedsPhases(ValueError):
    """A statement over the phases, asked for without them."""


class Source:
    """A ``-- name: x`` annotated file, split into its queries and fragments.

    A ``-- fragment: y`` block is SQL written once for several queries: a line
    ``-- include: y`` (indented or not) in a query or in another fragment stands
    for it, without the comment lines it starts with (they document it once,
    where it is written). The phase statements share their claim, a phase's
    rooms are one fragment wherever they are selected, and so one rule has one
    text.

    A fragment may take arguments, each the name of another fragment: in
    ``-- fragment: y(a)``, ``{a}`` stands for the text of the fragment the
    include names, ``-- include: y(k)`` (without its comment lines), and an
    include in ``y`` may pass ``a`` on. So one lock test serves every lock,
    each lock's key written once (``lock_held(relay_lock)``).

    The phases are data (reaper/phases.py); a statement is written for them:

    - a query whose first line is ``-- for each phase`` is written once per
      phase, as ``x[a]`` (:func:`phase_statement`), each holding that phase's
      predicate and no other, so the server parses and plans only what runs;
      ``-- for each phase becoming Ended`` (``not becoming Ended``) only for the
      phases whose rooms become (do not become) Ended;
    - ``-- include each phase: y`` stands for ``y`` written for each phase in
      their order, ``-- include each earlier phase: y`` for each phase before
      the one the statement is written for (nothing for the first), and
      ``joined by UNION ALL`` puts those words between them. So a phase's
      precedence follows the order, never an exclusion written by hand.

    In text written for a phase, ``{phase}``, ``{since}``, ``{status}`` and
    ``{end_reason}`` stand for its values (:class:`PhaseSql`), and ``--
    include: {phase}_y`` for its own fragment ``<name>_y``.
    """

    def __init__(self, source: str) -> None:
        headers = list(_HEADER.finditer(source))
        blocks: dict[str, dict[str, str]] = {"name": {}, "fragment": {}}
        self.takes: dict[str, tuple[str, ...]] = {}  # a fragment's arguments, by name
        for header, following in zip(headers, [*headers[1:], None], strict=True):
            end = following.start() if following else len(source)
            kind, name = header["kind"], header["name"]
            if name in blocks[kind]:
                raise ValueError(f"{kind} {name!r} is defined twice in {QUERIES_FILE.name}")
            if header["args"] and kind == "name":
                raise ValueError(f"query {name!r} takes arguments: only a fragment may")
            blocks[kind][name] = source[header.end() : end].strip()
            self.takes[name] = _names(header["args"])
        self.fragments = blocks["fragment"]
        self.queries = blocks["name"]

    def per_phase(self, name: str) -> bool:
        """Whether the query is written once per phase."""
        return _FOR_EACH.match(self.queries[name]) is not None

    def written_for(self, name: str, phase: PhaseSql) -> bool:
        """Whether the query, written once per phase, is written for ``phase``:
        ``becoming X`` for a phase whose rooms become X, ``not becoming X`` for
        the others."""
        found = _FOR_EACH.match(self.queries[name])
        if found is None or found["status"] is None:
            return found is not None
        return (phase.status == found["status"]) != bool(found["not"])

    def statement(
        self, name: str, phase: PhaseSql | None = None, order: Sequence[PhaseSql] = ()
    ) -> str:
        """The query ``name`` with its includes expanded: for ``phase`` when it is
        written once per phase, over the phases ``order`` when it includes each."""
        if name not in self.queries:
            raise ValueError(f"no query {name!r} in {QUERIES_FILE.name}")
        body = self.queries[name]
        found = _FOR_EACH.match(body)
        if (found is not None) != (phase is not None):
            raise ValueError(f"query {name!r} is written once per phase: give the phase")
        if found is not None:
            assert phase is not None
            if not self.written_for(name, phase):
                raise ValueError(f"query {name!r} is not written for phase {phase.name!r}")
            body = body[found.end() :]
        return self._expand(body, (), phase, {}, tuple(order))

    def _text_of(self, name: str, within: tuple[str, ...]) -> str:
        if name not in self.fragments:
            raise ValueError(f"include of an unknown fragment {name!r} in {QUERIES_FILE.name}")
        if name in within:
            raise ValueError(f"fragment {name!r} includes itself in {QUERIES_FILE.name}")
        return _LEADING_COMMENT.sub("", self.fragments[name] + "\n").rstrip("\n")

    def _expand(
        self,
        sql: str,
        within: tuple[str, ...],
        phase: PhaseSql | None,
        given: dict[str, str],
        order: tuple[PhaseSql, ...],
    ) -> str:
        def include(match: re.Match[str]) -> str:
            name = match["name"]
            if PHASE in name:
                if phase is None:
                    raise ValueError(
                        f"include of {name!r} outside a statement written for a phase"
                        f" in {QUERIES_FILE.name}"
                    )
                name = name.replace(PHASE, phase.name)
            body = self._text_of(name, within)
            # an argument is a fragment's name, or passes on one the includer was given
            args = [given.get(arg, arg) for arg in _names(match["args"])]
            if len(args) != len(self.takes[name]):
                raise ValueError(
                    f"fragment {name!r} takes ({', '.join(self.takes[name])}),"
                    f" given ({', '.join(args)}) in {QUERIES_FILE.name}"
                )
            arguments = dict(zip(self.takes[name], args, strict=True))
            if arguments:
                inner = (*within, name)
                values = {
                    param: self._expand(self._text_of(arg, inner), inner, phase, {}, order)
                    for param, arg in arguments.items()
                }
                body = _PLACEHOLDER.sub(lambda found: _argument(found, name, values), body)
            return self._expand(body, (*within, name), phase, arguments, order)

        def include_each(match: re.Match[str]) -> str:
            name, phases = match["name"], order
            if not phases:
                raise NeedsPhases(f"include of each phase without the phases ({name!r})")
            if match["which"] == "earlier phase":
                if phase is None or phase not in order:
                    raise ValueError("include of each earlier phase outside one of the phases")
                phases = order[: order.index(phase)]
            body = self._text_of(name, within)
            joint = f"\n{match['joint']}\n" if match["joint"] else "\n"
            return joint.join(
                self._expand(body, (*within, name), each, {}, order) for each in phases
            )

        sql = _INCLUDE_EACH.sub(include_each, sql)
        sql = _INCLUDE.sub(include, sql)
        if phase is not None:
            values = phase.binds()
            sql = _PLACEHOLDER.sub(lambda found: values.get(found["name"], found[0]), sql)
        return sql

    def written(self, order: Sequence[PhaseSql]) -> dict[str, str]:
        """Every statement, as written for the phases ``order``: a query written
        once per phase under ``x[phase]``, the others under their names."""
        statements: dict[str, str] = {}
        for name in self.queries:
            if self.per_phase(name):
                for phase in order:
                    if self.written_for(name, phase):
                        key = phase_statement(name, phase.name)
                        statements[key] = self.statement(name, phase, order)
                continue
            try:
                statements[name] = self.statement(name, None, order)
            except NeedsPhases:
                if order:
                    raise
        return statements


def parse(source: str, order: Sequence[PhaseSql] = ()) -> dict[str, str]:
    """Every statement of an annotated file (:class:`Source`), written for ``order``."""
    return Source(source).written(order)


def _names(args: str | None) -> tuple[str, ...]:
    return tuple(args.split(", ")) if args else ()


def _argument(placeholder: re.Match[str], fragment: str, values: dict[str, str]) -> str:
    """What ``{a}`` in a fragment's text stands for: its argument ``a``'s text;
    a phase's values are left to the statement written for it."""
    if placeholder["name"] in _BOUND:
        return placeholder[0]
    if placeholder["name"] not in values:
        raise ValueError(
            f"fragment {fragment!r} has {placeholder[0]}, not one of its arguments"
            f" in {QUERIES_FILE.name}"
        )
    return values[placeholder["name"]]


@cache
def source() -> Source:
    return Source(QUERIES_FILE.read_text())


@cache
def load(order: tuple[PhaseSql, ...] = ()) -> dict[str, TextClause]:
    """Every statement, written for the phases ``order`` (reaper/phases.py IN_ORDER)."""
    return {name: text(sql) for name, sql in source().written(order).items()}


@cache
def statement(name: str, phase: PhaseSql | None, order: tuple[PhaseSql, ...]) -> TextClause:
    """One statement as :meth:`Source.statement` writes it, compiled once."""
    return text(source().statement(name, phase, order))


def _run(conn: Connection, name: str, **params: Any) -> CursorResult[Any]:
    return conn.execute(statement(name, None, ()), params)


def _run_phase(conn: Connection, name: str, phase: PhaseSql, **params: Any) -> CursorResult[Any]:
    """A query written once per phase (``-- for each phase``): ``phase``'s statement."""
    return conn.execute(statement(name, phase, ()), params)


def _run_phases(
    conn: Connection, name: str, order: Sequence[PhaseSql], **params: Any
) -> CursorResult[Any]:
    """A query over every phase (``-- include each phase``), written for ``order``."""
    return conn.execute(statement(name, None, tuple(order)), params)


class Queries:
    """Thin manager over one connection: one method per named query."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def bound_transaction(self, budget: Budget) -> None:
        peer = budget.peer
        _run(
            self.conn,
            "bound",
            idle_ms=str(budget.idle_ms),
            statement_ms=str(budget.statement_ms),
            silence_ms=str(peer.silence_ms),
            keepalive_idle_s=str(peer.keepalive_idle_s),
            keepalive_interval_s=str(peer.keepalive_interval_s),
            keepalive_count=str(KEEPALIVE_PROBES),
        )

    def database_clock(self) -> datetime:
        clock: datetime = _run(self.conn, "database_clock").scalar_one()
        return clock

    # -- the run: lock and ownership -----------------------------------------

    def try_run_lock(self) -> bool:
        return bool(_run(self.conn, "try_run_lock").scalar())

    def wait_run_lock(self) -> None:
        _run(self.conn, "wait_run_lock")

    def run_lock_holder(self) -> int | None:
        return _run(self.conn, "run_lock_holder").scalar()

    def open_run(self) -> ResultRow | None:
        return _run(self.conn, "open_run").one_or_none()

    def close_run(self, run_id: str, outcome: str | None = None) -> ResultRow | None:
        return _run(self.conn, "close_run", run_id=run_id, outcome=outcome).one_or_none()

    def insert_run(
        self,
        *,
        run_id: str,
        as_of: datetime,
        started_at: datetime,
        max_run_s: float,
        lease_s: float,
        owner: str,
    ) -> bool:
        """False when ``run_id`` names an earlier run."""
        inserted = _run(
            self.conn,
            "insert_run",
            run_id=run_id,
            as_of=as_of,
            started_at=started_at,
            max_run_s=max_run_s,
            lease_s=lease_s,
            owner=owner,
        ).one_or_none()
        return inserted is not None

    def run_for_phase(self, run_id: str, phase: str) -> ResultRow | None:
        return _run(self.conn, "run_for_phase", run_id=run_id, phase=phase).one_or_none()

    def run_heartbeat(self) -> None:
        _run(self.conn, "run_heartbeat")

    def run_state(self, run_id: str) -> ResultRow | None:
        return _run(self.conn, "run_state", run_id=run_id).one_or_none()

    def save_run(
        self,
        run_id: str,
        *,
        counts: str,
        excluded: list[str],
        blocked: list[str],
        paused: list[str],
        errors: int,
        lease_s: float,
    ) -> int:
        return _run(
            self.conn,
            "save_run",
            run_id=run_id,
            counts=counts,
            excluded=excluded,
            blocked=blocked,
            paused=paused,
            errors=errors,
            lease_s=lease_s,
        ).rowcount

    def save_run_totals(
        self,
        run_id: str,
        *,
        counts: str,
        excluded: list[str],
        blocked: list[str],
        paused: list[str],
        errors: int,
    ) -> int:
        return _run(
            self.conn,
            "save_run_totals",
            run_id=run_id,
            counts=counts,
            excluded=excluded,
            blocked=blocked,
            paused=paused,
            errors=errors,
        ).rowcount

    def record_unknown_phase(self, run_id: str, phase: str) -> int:
        return _run(self.conn, "record_unknown_phase", run_id=run_id, phase=phase).rowcount

    def count_run_error(self, run_id: str) -> int:
        return _run(self.conn, "count_run_error", run_id=run_id).rowcount

    def delete_old_runs(self, keep_s: float) -> int:
        return _run(self.conn, "delete_old_runs", keep_s=keep_s).rowcount

    def last_runs(self) -> list[ResultRow]:
        return list(_run(self.conn, "last_runs"))

    # A phase statement selects the rooms of ``phase`` by ``bounds``: every
    # phase's default cutoff and range end (phases.bounds), named as in the SQL.

    def end_active_batch(
        self,
        *,
        phase: PhaseSql,
        as_of: datetime,
        bounds: Mapping[str, datetime],
        batch_size: int,
        excluded: list[str],
        only: list[str] | None,
        run_id: str,
        holder_pid: int,
        topic: str,
    ) -> list[ResultRow]:
        return list(
            _run_phase(
                self.conn,
                "end_active_batch",
                phase,
                as_of=as_of,
                **bounds,
                batch_size=batch_size,
                excluded=excluded,
                only=only,
                run_id=run_id,
                holder_pid=holder_pid,
                topic=topic,
            )
        )

    def fail_provisioning_batch(
        self,
        *,
        phase: PhaseSql,
        as_of: datetime,
        bounds: Mapping[str, datetime],
        batch_size: int,
        excluded: list[str],
        only: list[str] | None,
        run_id: str,
        holder_pid: int,
    ) -> list[ResultRow]:
        return list(
            _run_phase(
                self.conn,
                "fail_provisioning_batch",
                phase,
                as_of=as_of,
                **bounds,
                batch_size=batch_size,
                excluded=excluded,
                only=only,
                run_id=run_id,
                holder_pid=holder_pid,
            )
        )

    def batch_candidates(
        self,
        *,
        phase: PhaseSql,
        as_of: datetime,
        bounds: Mapping[str, datetime],
        batch_size: int,
        excluded: list[str],
    ) -> list[str]:
        return list(
            _run_phase(
                self.conn,
                "batch_candidates",
                phase,
                as_of=as_of,
                **bounds,
                batch_size=batch_size,
                excluded=excluded,
                only=None,
            ).scalars()
        )

    def guard_eligible(
        self,
        *,
        phase: PhaseSql,
        as_of: datetime,
        bounds: Mapping[str, datetime],
        excluded: list[str],
    ) -> int:
        """The rooms a guarded phase would end now (the mass-closure guard)."""
        row = _run_phase(
            self.conn, "guard_eligible", phase, as_of=as_of, **bounds, excluded=excluded
        )
        return int(row.scalar_one())

    def active_count(self) -> int:
        return int(_run(self.conn, "active_count").scalar_one())

    def mark_stop_requested(self, recording_ids: list[str]) -> int:
        return _run(self.conn, "mark_stop_requested", recording_ids=recording_ids).rowcount

    def mark_stop_failed(
        self, recording_ids: list[str], *, backoff_initial_s: float, backoff_max_s: float
    ) -> int:
        return _run(
            self.conn,
            "mark_stop_failed",
            recording_ids=recording_ids,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
        ).rowcount

    def claim_stops_due(
        self,
        *,
        phases: Sequence[PhaseSql],
        window_s: float,
        lease_s: float,
        limit: int,
        holder_pid: int | None,
    ) -> list[ResultRow]:
        """The due signals of rooms the ``phases`` ended, claimed; none once the
        stop lock is no longer held by ``holder_pid`` (None: a pass that takes no
        lock)."""
        return list(
            _run_phases(
                self.conn,
                "claim_stops_due",
                phases,
                window_s=window_s,
                lease_s=lease_s,
                limit=limit,
                holder_pid=holder_pid,
            )
        )

    def release_stops(self, recording_ids: list[str]) -> int:
        return _run(self.conn, "release_stops", recording_ids=recording_ids).rowcount

    def try_stop_lock(self) -> int | None:
        """This session's backend pid when it took the stop lock, else None."""
        pid: int | None = _run(self.conn, "try_stop_lock").scalar_one()
        return pid

    def stop_marks_fence(self, holder_pid: int) -> bool:
        """Whether the stop lock is still held by ``holder_pid``, the gate of the
        marks taken for this transaction."""
        return bool(_run(self.conn, "stop_marks_fence", holder_pid=holder_pid).scalar_one())

    def wait_stop_marks(self) -> None:
        _run(self.conn, "wait_stop_marks")

    # -- the outbox relay ----------------------------------------------------

    def census_planner(self) -> None:
        _run(self.conn, "census_planner")

    def relay_planner(self) -> None:
        _run(self.conn, "relay_planner")

    def claim_outbox_batch(
        self, batch_size: int, holder_pid: int, from_id: int = 0
    ) -> list[OutboxRow]:
        """A batch of due rows from id ``from_id`` on (0: all), locked; none once the
        relay lock is no longer held by ``holder_pid``."""
        result = _run(
            self.conn,
            "claim_outbox_batch",
            batch_size=batch_size,
            holder_pid=holder_pid,
            from_id=from_id,
        )
        if tuple(result.keys()) != OutboxRow._fields:  # the rows are read by position
            raise RuntimeError(f"claim_outbox_batch returns {list(result.keys())}")
        return list(map(OutboxRow._make, result))

    def acknowledge_outbox(self, ids: list[int]) -> int:
        """Delete the acknowledged rows that are still pending; how many."""
        return int(_run(self.conn, "acknowledge_outbox", ids=ids).scalar_one())

    def mark_outbox_failed(
        self,
        failures: dict[int, str],
        *,
        charged: bool,
        backoff_initial_s: float,
        backoff_max_s: float,
        max_attempts: int,
    ) -> list[int]:
        """Back off each failed row, an attempt ``charged`` to it or not; returns
        those that ran out of attempts (parked)."""
        rows = _run(
            self.conn,
            "mark_outbox_failed",
            ids=list(failures),
            errors=list(failures.values()),
            charged=charged,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
            max_attempts=max_attempts,
        )
        return [row.id for row in rows if row.parked]

    def mark_outbox_parked(self, refused: dict[int, str]) -> int:
        return _run(
            self.conn, "mark_outbox_parked", ids=list(refused), errors=list(refused.values())
        ).rowcount

    def outbox_pending_stats(self) -> tuple[int, float, int]:
        """``(pending rows, age in seconds of the oldest one, parked rows)``."""
        row = _run(self.conn, "outbox_pending_stats").one()
        return int(row.pending), float(row.oldest_age_seconds), int(row.parked)

    def outbox_vacuum_stats(self) -> tuple[int, float | None]:
        """``(dead row versions of the outbox, age in seconds of the oldest
        transaction holding a snapshot: 0 none, None unknown)``."""
        row = _run(self.conn, "outbox_vacuum_stats").one()
        age = row.oldest_snapshot_age_seconds
        return int(row.dead_rows), None if age is None else float(age)

    def parked_outbox(self, limit: int) -> list[ResultRow]:
        return list(_run(self.conn, "parked_outbox", limit=limit))

    def requeue_outbox(self, event_id: str | None) -> int:
        """Parked rows back to pending: one (by event id) or, with None, all."""
        return _run(self.conn, "requeue_outbox", event_id=event_id).rowcount

    def discard_outbox(self, event_id: str, reason: str, operator: str) -> ResultRow:
        """A parked row moved into messenger.outbox_discards; the kept row."""
        return _run(
            self.conn, "discard_outbox", event_id=event_id, reason=reason, operator=operator
        ).one()

    def outbox_discarded_count(self) -> int:
        return int(_run(self.conn, "outbox_discarded_count").scalar_one())

    def delete_published_outbox(self, retention: timedelta, batch_size: int) -> int:
        deleted = _run(
            self.conn,
            "delete_published_outbox",
            retention_s=retention.total_seconds(),
            batch_size=batch_size,
        ).scalar_one()
        return int(deleted)

    def try_relay_lock(self) -> int | None:
        """This session's backend pid when it took the relay lock, else None."""
        pid: int | None = _run(self.conn, "try_relay_lock").scalar_one()
        return pid

    def relay_marks_fence(self, holder_pid: int) -> bool:
        """Whether the relay lock is still held by ``holder_pid``, the gate of the
        marks taken for this transaction."""
        return bool(_run(self.conn, "relay_marks_fence", holder_pid=holder_pid).scalar_one())

    def wait_relay_marks(self) -> None:
        _run(self.conn, "wait_relay_marks")

    # -- operations: metrics, reaper status / plan ----------------------------

    def eligible_census(
        self, *, phases: Sequence[PhaseSql], as_of: datetime, bounds: Mapping[str, datetime]
    ) -> list[ResultRow]:
        """One row per phase, in their order: ``phase``, ``n``, ``since``."""
        return list(_run_phases(self.conn, "eligible_census", phases, as_of=as_of, **bounds))

    def plan_candidates(
        self,
        *,
        phases: Sequence[PhaseSql],
        as_of: datetime,
        bounds: Mapping[str, datetime],
        per_phase: int,
    ) -> list[ResultRow]:
        return list(
            _run_phases(
                self.conn,
                "plan_candidates",
                phases,
                as_of=as_of,
                **bounds,
                per_phase=per_phase,
                phases=[phase.name for phase in phases],
            )
        )

    def backend_activity(self, pid: int) -> ResultRow | None:
        return _run(self.conn, "backend_activity", pid=pid).one_or_none()

    # -- operator controls ------------------------------------------------------

    def active_pauses(self, phases: Sequence[str]) -> list[ResultRow]:
        """``phases``: every phase, in the order to list them (phases.ORDER)."""
        return list(_run(self.conn, "active_pauses", phases=list(phases)))

    def phase_pause(self, phase: str) -> str | None:
        """The reason the phase is paused now, or None."""
        return _run(self.conn, "phase_pause", phase=phase).scalar()

    def pause_phase(self, phase: str, reason: str, for_s: float | None, by: str) -> ResultRow:
        return _run(self.conn, "pause_phase", phase=phase, reason=reason, for_s=for_s, by=by).one()

    def resume_phases(self, phases: list[str]) -> list[ResultRow]:
        return list(_run(self.conn, "resume_phases", phases=phases))

    def set_tenant_window(self, tenant_id: str, *, phase: str, window_s: float, by: str) -> None:
        """The tenant's window for ``phase``, replacing the one it had (locked
        until the caller's transaction ends)."""
        _run(
            self.conn,
            "set_tenant_window",
            tenant_id=tenant_id,
            phase=phase,
            window_s=window_s,
            by=by,
        )

    def unset_tenant_windows(self, tenant_id: str) -> list[ResultRow]:
        """The windows the tenant had, removed (none: it had none)."""
        return list(_run(self.conn, "unset_tenant_windows", tenant_id=tenant_id))

    def tenant_window_bounds(self) -> dict[str, timedelta]:
        """Per phase, the shortest window any tenant sets (a phase none sets: absent)."""
        return {row.phase: row.shortest for row in _run(self.conn, "tenant_window_bounds")}

    def tenant_windows(self, tenant_id: str | None = None) -> list[ResultRow]:
        """A tenant's windows (None: every tenant's), one row per tenant and phase."""
        return list(_run(self.conn, "tenant_windows", tenant_id=tenant_id))

    def tenant_policy_count(self) -> int:
        return int(_run(self.conn, "tenant_policy_count").scalar_one())

    # -- health -------------------------------------------------------------------

    def last_run_completed(self) -> ResultRow | None:
        """``finished_at`` and ``age_seconds`` of the last completed run, or None."""
        return _run(self.conn, "last_run_completed").one_or_none()

    # -- the schema (docs/design.md#releases-and-the-schema) ----------------------

    def schema_readable(self) -> ResultRow:
        """``revision_readable``, ``record_readable``: may this login read them."""
        return _run(self.conn, "schema_readable").one()

    def schema_revision(self) -> str | None:
        revision: str | None = _run(self.conn, "schema_revision").scalar_one_or_none()
        return revision

    def schema_record(self) -> list[ResultRow]:
        return list(_run(self.conn, "schema_record"))

    def schema_owner(self) -> ResultRow | None:
        """``owner``, ``acts_as_owner`` of the revision table; None before it exists."""
        return _run(self.conn, "schema_owner").one_or_none()

    # -- anomalies (docs/design.md#anomalies) ------------------------------------

    def activity_ahead_count(self, ahead_of: datetime) -> int:
        """Active conferences whose last_activity_at is later than ``ahead_of``."""
        return int(_run(self.conn, "activity_ahead_count", ahead_of=ahead_of).scalar_one())

    def activity_ahead(self, now: datetime, ahead_of: datetime, limit: int) -> list[ResultRow]:
        """Those conferences, the furthest ahead first (reaper plan)."""
        return list(_run(self.conn, "activity_ahead", now=now, ahead_of=ahead_of, limit=limit))

    # -- the ledger (reaper/ledger.py, docs/delivery.md) --------------------------

    def ledger_closings(
        self, phases: Sequence[PhaseSql], since: datetime, until: datetime
    ) -> list[ResultRow]:
        """The rooms the ``phases`` closed in [since, until)."""
        return list(_run_phases(self.conn, "ledger_closings", phases, since=since, until=until))

    def ledger_pending(self) -> list[ResultRow]:
        return list(_run(self.conn, "ledger_pending"))

    def ledger_pushes(
        self, phases: Sequence[PhaseSql], since: datetime, until: datetime
    ) -> list[ResultRow]:
        """The push rows of the rooms the ``phases`` closed in [since, until)."""
        return list(_run_phases(self.conn, "ledger_pushes", phases, since=since, until=until))

    def ledger_discarded(self, since: datetime, until: datetime) -> list[str]:
        return list(_run(self.conn, "ledger_discarded", since=since, until=until).scalars())

    def ledger_republished(self, since: datetime, until: datetime) -> list[str]:
        return list(_run(self.conn, "ledger_republished", since=since, until=until).scalars())

    def ledger_rooms(self, ids: Sequence[str]) -> list[ResultRow]:
        return list(_run(self.conn, "ledger_rooms", ids=list(ids)))

    def republish_outbox(
        self, conference_id: str, topic: str, reason: str, operator: str
    ) -> ResultRow:
        """A lost event put back into the outbox (migration 0014); the record kept."""
        return _run(
            self.conn,
            "republish_outbox",
            conference_id=conference_id,
            topic=topic,
            reason=reason,
            operator=operator,
        ).one()

    def may_republish(self) -> ResultRow:
        """``login``, ``allowed``: may this login run messenger.republish_outbox."""
        return _run(self.conn, "may_republish").one()
