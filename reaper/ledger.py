"""The ledger of rooms and conference-ended events (docs/delivery.md).

Every room the reaper closes gets exactly one conference-ended event on Kafka,
in the order of its deal's closings; a room it fails gets none. Since 0.4.0 a
row leaves the outbox at its acknowledgement, so delivery is read where it
lives: on the topic. :func:`judge` is pure: given the closings read from
PostgreSQL, the outbox rows still pending, the push rows and the records read
from Kafka, it says per room, in the vocabulary of Jepsen's total-queue
checker, what was lost, unexpected, duplicated, redelivered or out of order,
and which closings lack their one push row. :class:`Ledger` reads those
inputs (named queries, a fresh Kafka consumer by timestamps, every wait
bounded) and judges them; ``reaper reconcile`` and the fault tests both use it.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine

from reaper import budgets
from reaper.clock import parse_time, rfc3339
from reaper.config import Settings
from reaper.db import transaction
from reaper.kafka import producer_config
from reaper.phases import IN_ORDER

# The push row each kind of closing writes (reaper/sql/queries.sql).
PUSH_KIND = {"Ended": "ConferenceEnded", "Failed": "ConferenceSignal"}
# How many findings of each category the summary and the JSON name.
EXAMPLES = 10
# Polls after the end offsets the read began with (see read_topic).
LEDGER_EXTRA_POLLS = 5
CATEGORIES = ("lost", "unexpected", "duplicated", "out_of_order", "realtime")


@dataclass(frozen=True)
class Closing:
    """A room as PostgreSQL has it: closed (status Ended or Failed) or not."""

    conference_id: str
    deal_id: str
    status: str
    end_reason: str | None
    ended_at: datetime | None


@dataclass(frozen=True)
class Pending:
    """An outbox row not yet on Kafka (pending or parked)."""

    event_id: str
    message_key: str
    value: Mapping[str, Any]
    parked: bool = False


@dataclass(frozen=True)
class Push:
    """A realtime_outbox row."""

    conference_id: str
    kind: str


@dataclass(frozen=True)
class Record:
    """A record read from the topic (timestamp: ms since the epoch)."""

    key: str | None
    value: bytes | str
    partition: int
    offset: int
    timestamp: int


@dataclass(frozen=True)
class Finding:
    """One thing wrong (or counted), about one room or one deal."""

    category: str
    conference_id: str | None
    deal_id: str | None
    end_reason: str | None
    detail: str
    event_ids: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "conference_id": self.conference_id,
            "deal_id": self.deal_id,
            "end_reason": self.end_reason,
            "detail": self.detail,
            "event_ids": list(self.event_ids),
        }


@dataclass
class Verdict:
    """What the ledger found for the rooms closed in [since, until)."""

    since: datetime
    until: datetime
    closings: int = 0
    on_kafka: int = 0  # closings whose event is on the topic
    pending: int = 0  # closings whose event is still in the outbox (not on the topic yet)
    redelivered: int = 0  # extra copies of an event id on the topic: at-least-once, counted
    records: int = 0  # records read from the topic
    lost: list[Finding] = field(default_factory=list)
    unexpected: list[Finding] = field(default_factory=list)
    duplicated: list[Finding] = field(default_factory=list)
    out_of_order: list[Finding] = field(default_factory=list)
    realtime: list[Finding] = field(default_factory=list)
    # closed rooms whose event an operator discarded (reaper outbox discard): a
    # decision on the record, not a failure
    discarded: list[Finding] = field(default_factory=list)
    by_end_reason: dict[str, Counter[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(getattr(self, name) for name in CATEGORIES)

    def counts(self) -> dict[str, int]:
        counts = {name: len(getattr(self, name)) for name in CATEGORIES}
        counts.update(
            closings=self.closings,
            on_kafka=self.on_kafka,
            pending=self.pending,
            redelivered=self.redelivered,
            discarded=len(self.discarded),
            records=self.records,
        )
        return counts

    def examples(self, category: str, n: int = EXAMPLES) -> list[Finding]:
        found: list[Finding] = getattr(self, category)
        return found[:n]

    def to_json(self) -> dict[str, Any]:
        return {
            "since": rfc3339(self.since),
            "until": rfc3339(self.until),
            "ok": self.ok,
            "counts": self.counts(),
            "by_end_reason": {
                reason: dict(sorted(counts.items()))
                for reason, counts in sorted(self.by_end_reason.items())
            },
            "examples": {
                name: [f.to_json() for f in self.examples(name)]
                for name in (*CATEGORIES, "discarded")
            },
        }

    def summary(self) -> list[str]:
        """Human lines: the window, per end reason, the categories, first examples."""
        lines = [
            f"rooms closed from {rfc3339(self.since)} to {rfc3339(self.until)}: "
            f"{self.closings}; {self.records} records read from Kafka"
        ]
        for reason, c in sorted(self.by_end_reason.items()):
            lines.append(
                f"  {reason:<13} closed {c['closed']}, on Kafka {c['on_kafka']}, "
                f"pending {c['pending']}, lost {c['lost']}, duplicated {c['duplicated']}, "
                f"unexpected {c['unexpected']}, discarded {c['discarded']}, "
                f"realtime {c['realtime']}"
            )
        lines.append(
            f"lost {len(self.lost)}, unexpected {len(self.unexpected)}, "
            f"duplicated {len(self.duplicated)}, out of order {len(self.out_of_order)}, "
            f"realtime {len(self.realtime)}; redelivered {self.redelivered} "
            f"(at-least-once, counted only), discarded {len(self.discarded)}"
        )
        for name in (*CATEGORIES, "discarded"):
            for f in self.examples(name):
                room = f"conference {f.conference_id}" if f.conference_id else "no conference"
                lines.append(
                    f"  {name}: {room} (deal {f.deal_id}, {f.end_reason}): {f.detail}"
                    + (f" [{', '.join(f.event_ids)}]" if f.event_ids else "")
                )
        lines.append("clean" if self.ok else "NOT clean")
        return lines


@dataclass(frozen=True)
class _Event:
    """An event's fields the ledger compares with its room."""

    event_id: str
    conference_id: str
    deal_id: str | None
    status: str | None
    end_reason: str | None
    ended_at: datetime | None


def _event(key: str | None, value: Mapping[str, Any] | bytes | str) -> _Event | str:
    """The event's fields, or why it cannot be read."""
    try:
        data = value if isinstance(value, Mapping) else json.loads(value)
        payload = data["payload"]
        event_id, conference_id = str(data["eventId"]), str(payload["conferenceId"])
    except (ValueError, TypeError, KeyError) as exc:
        return f"unreadable event ({type(exc).__name__}: {exc})"
    ended = payload.get("endedAt")
    try:
        ended_at = parse_time(ended) if ended else None
    except ValueError:
        ended_at = None
    return _Event(
        event_id,
        conference_id,
        key,
        payload.get("status"),
        payload.get("endReason"),
        ended_at,
    )


def _moment(value: datetime | None) -> str | None:
    return None if value is None else rfc3339(value)


def _mismatch(event: _Event, room: Closing) -> str | None:
    """Why the event does not say what happened to the room (None: it does)."""
    if room.status != "Ended":
        return f"the room is {room.status}/{room.end_reason}: it has no conference-ended event"
    if event.deal_id != room.deal_id:
        return f"its key {event.deal_id} is not the room's deal"
    said = (event.status, event.end_reason, event.ended_at)
    was = (room.status, room.end_reason, room.ended_at)
    if said != was:
        return (
            f"it says {event.status}/{event.end_reason} at {_moment(event.ended_at)}, "
            f"the room was closed {room.status}/{room.end_reason} at {_moment(room.ended_at)}"
        )
    return None


def judge(
    closings: Iterable[Closing],
    pending: Iterable[Pending],
    pushes: Iterable[Push],
    records: Iterable[Record],
    *,
    since: datetime,
    until: datetime,
    rooms: Iterable[Closing] = (),
    discarded: Collection[str] = (),
    republished: Collection[str] = (),
) -> Verdict:
    """The verdict on the rooms closed in [since, until) (``closings``).

    ``rooms``: the rooms of events (on Kafka or pending) whose room is not among
    ``closings``, as PostgreSQL has them now: an event of a room closed outside
    the window, as its event says, is out of scope; of a room not closed, closed
    otherwise, or unknown, unexpected. ``discarded``: the conference ids whose
    event an operator discarded. ``republished``: event ids an operator put
    back (messenger.outbox_republishes): such an event follows its deal's later
    events by construction, so it is left out of the order check.
    """
    verdict = Verdict(since=since, until=until)
    scope = {c.conference_id: c for c in closings}
    verdict.closings = len(scope)
    elsewhere = {r.conference_id: r for r in rooms}
    on_kafka: dict[str, set[str]] = defaultdict(set)
    in_outbox: dict[str, set[str]] = defaultdict(set)
    # per deal: (partition, offset, ended_at, event id, conference) of each first copy
    sequence: dict[str, list[tuple[int, int, datetime, str, str]]] = defaultdict(list)
    seen: set[str] = set()
    reasons: dict[str, Counter[str]] = defaultdict(Counter)

    def unexpected(event: _Event | None, detail: str, key: str | None) -> None:
        reason = event.end_reason if event else None
        verdict.unexpected.append(
            Finding(
                "unexpected",
                event.conference_id if event else None,
                key,
                reason,
                detail,
                (event.event_id,) if event else (),
            )
        )
        reasons[str(reason)]["unexpected"] += 1

    def place(event: _Event, where: str) -> bool:
        """True when the event is a closing's in scope, as the room was closed."""
        room = scope.get(event.conference_id)
        if room is None:
            other = elsewhere.get(event.conference_id)
            if other is None:
                unexpected(event, f"{where}: no such room", event.deal_id)
            elif (why := _mismatch(event, other)) is not None:
                unexpected(event, f"{where}: {why}", event.deal_id)
            return False  # closed as it says, outside the window: not judged here
        if (why := _mismatch(event, room)) is not None:
            unexpected(event, f"{where}: {why}", event.deal_id)
            return False
        return True

    ordered = sorted(records, key=lambda r: (r.partition, r.offset))
    verdict.records = len(ordered)
    for record in ordered:
        event = _event(record.key, record.value)
        if isinstance(event, str):
            unexpected(None, f"on Kafka p{record.partition}@{record.offset}: {event}", record.key)
            continue
        if event.event_id in seen:
            verdict.redelivered += 1
            continue
        seen.add(event.event_id)
        if place(event, "on Kafka"):
            on_kafka[event.conference_id].add(event.event_id)
            room = scope[event.conference_id]
            if event.event_id not in republished and room.ended_at is not None:
                sequence[room.deal_id].append(
                    (
                        record.partition,
                        record.offset,
                        room.ended_at,
                        event.event_id,
                        room.conference_id,
                    )
                )
    for row in pending:
        event = _event(row.message_key, row.value)
        if isinstance(event, str):
            unexpected(None, f"in the outbox: {event}", row.message_key)
            continue
        if event.event_id in seen:
            continue  # sent, its acknowledgement not yet committed: the same event
        if place(event, "in the outbox"):
            in_outbox[event.conference_id].add(event.event_id)

    by_room: dict[str, list[str]] = defaultdict(list)
    for push in pushes:
        by_room[push.conference_id].append(push.kind)

    for room in scope.values():
        reason = reasons[str(room.end_reason)]
        reason["closed"] += 1
        sent, waiting = on_kafka[room.conference_id], in_outbox[room.conference_id]
        ids = sent | waiting
        if room.status == "Ended":
            if sent:
                verdict.on_kafka += 1
                reason["on_kafka"] += 1
            elif waiting:
                verdict.pending += 1
                reason["pending"] += 1
            if not ids:
                category = "discarded" if room.conference_id in discarded else "lost"
                detail = (
                    "its event was discarded by an operator (messenger.outbox_discards)"
                    if category == "discarded"
                    else "closed; its event is neither in the outbox nor on Kafka"
                )
                getattr(verdict, category).append(
                    Finding(category, room.conference_id, room.deal_id, room.end_reason, detail)
                )
                reason[category] += 1
            elif len(ids) > 1:
                verdict.duplicated.append(
                    Finding(
                        "duplicated",
                        room.conference_id,
                        room.deal_id,
                        room.end_reason,
                        f"one closing, {len(ids)} event ids "
                        f"({len(sent)} on Kafka, {len(waiting)} in the outbox)",
                        tuple(sorted(ids)),
                    )
                )
                reason["duplicated"] += 1
        kinds = by_room.get(room.conference_id, [])
        wanted = PUSH_KIND.get(room.status)
        if kinds != [wanted]:
            verdict.realtime.append(
                Finding(
                    "realtime",
                    room.conference_id,
                    room.deal_id,
                    room.end_reason,
                    f"push rows {sorted(kinds)}, expected exactly one {wanted}",
                )
            )
            reason["realtime"] += 1

    for deal, events in sequence.items():
        events.sort()
        for before, after in itertools.pairwise(events):
            if after[2] < before[2]:
                verdict.out_of_order.append(
                    Finding(
                        "out_of_order",
                        after[4],
                        deal,
                        scope[after[4]].end_reason,
                        f"on Kafka at p{after[0]}@{after[1]}, after the event of conference "
                        f"{before[4]} closed later ({rfc3339(before[2])} > {rfc3339(after[2])})",
                        (before[3], after[3]),
                    )
                )
    for name in ("lost", "unexpected", "duplicated", "out_of_order", "realtime", "discarded"):
        findings: list[Finding] = getattr(verdict, name)
        findings.sort(key=lambda f: (str(f.deal_id), str(f.conference_id)))
    for counts in reasons.values():
        for name in ("closed", "on_kafka", "pending", *CATEGORIES, "discarded"):
            counts.setdefault(name, 0)
    verdict.by_end_reason = dict(reasons)
    return verdict


class KafkaUnreadable(Exception):
    """The topic could not be read within its bound: no verdict on delivery."""


def consumer_config(settings: Settings) -> dict[str, Any]:
    """A consumer with the producer's connection and security settings, bounded,
    in no group (consumer groups do not deliver on every broker we run against;
    the ledger assigns partitions itself and commits nothing)."""
    produced = producer_config(settings)
    timeout_ms = int(settings.kafka_timeout.total_seconds() * 1000)
    config = {
        k: v
        for k, v in produced.items()
        if k in ("bootstrap_servers", "security_protocol") or k.startswith(("sasl_", "ssl_"))
    }
    config.update(
        client_id="conference-room-reaper-ledger",
        group_id=None,
        enable_auto_commit=False,
        request_timeout_ms=max(timeout_ms, 1000),
        bootstrap_timeout_ms=max(500, timeout_ms // 2),
        reconnect_backoff_max_ms=1000,
        max_partition_fetch_bytes=settings.kafka_max_request_size * 2,
    )
    return config


def connect(settings: Settings, consumer_type: Any, error_type: type[Exception]) -> Any:
    """The ledger's consumer, bootstrapped within budgets.LEDGER_KAFKA_CONNECTS tries."""
    tries = 1
    while True:
        try:
            return consumer_type(**consumer_config(settings))
        except error_type as exc:
            if tries >= budgets.LEDGER_KAFKA_CONNECTS:
                raise KafkaUnreadable(f"Kafka {settings.kafka_bootstrap_servers}: {exc}") from exc
        tries += 1
        time.sleep(budgets.LEDGER_POLL.total_seconds())


def read_topic(settings: Settings, topic: str, since: datetime) -> list[Record]:
    """Every record of ``topic`` with a timestamp from ``since`` up to the end
    offsets the read began with, within budgets.ledger_kafka_read."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import KafkaError

    deadline = time.monotonic() + budgets.ledger_kafka_read(settings).total_seconds()
    since_ms = int(since.timestamp() * 1000)
    consumer = connect(settings, KafkaConsumer, KafkaError)
    try:
        partitions = None
        while partitions is None:
            partitions = consumer.partitions_for_topic(topic)
            if partitions is None:
                if time.monotonic() > deadline:
                    raise KafkaUnreadable(f"topic {topic} not found (no metadata) in time")
                time.sleep(budgets.LEDGER_POLL.total_seconds())
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        ends = consumer.end_offsets(tps)
        firsts = consumer.beginning_offsets(tps)
        starts = consumer.offsets_for_times(dict.fromkeys(tps, since_ms))
        for tp in tps:
            found = starts.get(tp)
            # None: no record at or after the timestamp. Tansu answers an offset
            # (with timestamp -1) even then: the timestamps are checked below too.
            consumer.seek(tp, max(firsts[tp], found.offset) if found else ends[tp])
        records: list[Record] = []
        # Read up to the end offsets the read began with, then a few polls more
        # until one comes back empty: Tansu reports an end offset one short of
        # its last record's (seen: 1 for records at 0 and 1), so the end is
        # confirmed by an empty poll; on a busy topic the extra polls are bounded.
        extra = LEDGER_EXTRA_POLLS
        while extra > 0:
            if time.monotonic() > deadline:
                raise KafkaUnreadable(
                    f"topic {topic}: {len(records)} records read, the end not reached within "
                    f"{budgets.ledger_kafka_read(settings)} (budgets.ledger_kafka_read)"
                )
            polled = consumer.poll(timeout_ms=int(budgets.LEDGER_POLL.total_seconds() * 1000))
            for tp, batch in polled.items():
                records.extend(
                    Record(
                        r.key.decode() if r.key is not None else None,
                        r.value,
                        tp.partition,
                        r.offset,
                        r.timestamp,
                    )
                    for r in batch
                    if r.timestamp >= since_ms
                )
            if all((consumer.position(tp) or 0) >= ends[tp] for tp in tps):
                extra = 0 if not polled else extra - 1
        return records
    except KafkaError as exc:
        raise KafkaUnreadable(f"topic {topic}: {type(exc).__name__}: {exc}") from exc
    finally:
        consumer.close(autocommit=False)


class Ledger:
    """The ledger against the real services: PostgreSQL through named queries,
    Kafka with a fresh consumer (``kafka=False``: the topic is not read, for a
    deployment, or a test, whose relay never ran: every event must then be
    pending)."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        *,
        kafka: bool = True,
        exclude: Collection[str] = (),
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.kafka = kafka
        self.exclude = frozenset(exclude)  # conference ids left out (seeded already closed)

    def check(self, since: datetime, until: datetime) -> Verdict:
        budget = budgets.ledger_read(self.settings)
        # PostgreSQL first, Kafka after: an event acknowledged meanwhile is on the
        # topic by then; read the other way round it would be in neither.
        with transaction(self.engine, budget) as queries:
            closings = [
                Closing(r.conference_id, r.deal_id, r.status, r.end_reason, r.ended_at)
                # this release's phases: a newer release's phase is its own ledger's
                for r in queries.ledger_closings(IN_ORDER, since, until)
                if r.conference_id not in self.exclude
            ]
            pending = [
                Pending(r.event_id, r.message_key, r.payload, r.parked)
                for r in queries.ledger_pending()
            ]
            pushes = [
                Push(r.conference_id, r.kind) for r in queries.ledger_pushes(IN_ORDER, since, until)
            ]
            discarded = set(queries.ledger_discarded(since, until))
            republished = set(queries.ledger_republished(since, until))
        records = (
            read_topic(
                self.settings,
                self.settings.conference_ended_topic,
                since - budgets.LEDGER_KAFKA_SLACK,
            )
            if self.kafka
            else []
        )
        known = {c.conference_id for c in closings} | self.exclude
        others = sorted(
            {
                e.conference_id
                for e in (_event(r.key, r.value) for r in records)
                if not isinstance(e, str)
            }
            | {
                e.conference_id
                for e in (_event(p.message_key, p.value) for p in pending)
                if not isinstance(e, str)
            }
            - known
        )
        rooms: list[Closing] = []
        if others:
            with transaction(self.engine, budget) as queries:
                rooms = [
                    Closing(r.conference_id, r.deal_id, r.status, r.end_reason, r.ended_at)
                    for r in queries.ledger_rooms(others)
                ]
        return judge(
            closings,
            [p for p in pending if _conference(p) not in self.exclude] if self.exclude else pending,
            pushes,
            [r for r in records if _conference(r) not in self.exclude] if self.exclude else records,
            since=since,
            until=until,
            rooms=rooms,
            discarded=discarded,
            republished=republished,
        )


def _conference(item: Pending | Record) -> str | None:
    key = item.message_key if isinstance(item, Pending) else item.key
    event = _event(key, item.value)
    return None if isinstance(event, str) else event.conference_id


def lost_rooms(verdict: Verdict) -> Sequence[Finding]:
    """The rooms whose event ``reaper reconcile --republish`` puts back: those
    the reaper ended (a Failed room has no event to lose)."""
    return [f for f in verdict.lost if f.end_reason in REPUBLISHED_REASONS]


REPUBLISHED_REASONS = ("EmptyTimeout", "Timeout")
_AGO = re.compile(r"^(?:(?P<d>\d+)d)?(?:(?P<h>\d+)h)?(?:(?P<m>\d+)m)?(?:(?P<s>\d+)s)?$")


def parse_moment(value: str) -> datetime | timedelta:
    """``--since`` / ``--until``: an RFC 3339 moment (UTC without an offset) or a
    duration ago (``2h``, ``30m``, ``1d``, ``1h30m``); ValueError says why in one line."""
    text = value.strip()
    match = _AGO.match(text)
    if text and match:
        parts = {k: int(v) for k, v in match.groupdict().items() if v}
        ago = timedelta(
            days=parts.get("d", 0),
            hours=parts.get("h", 0),
            minutes=parts.get("m", 0),
            seconds=parts.get("s", 0),
        )
        if ago <= timedelta(0):
            raise ValueError(f"{value!r} is no time ago: give a positive duration such as 2h")
        return ago
    try:
        return parse_time(text)
    except ValueError:
        raise ValueError(
            f"{value!r} is neither a moment (RFC 3339, e.g. 2026-12-02T10:00:00Z) nor a "
            "duration ago (e.g. 2h, 30m, 1d)"
        ) from None


def moment(value: datetime | timedelta, now: datetime) -> datetime:
    """A parsed ``--since``/``--until`` as a moment: a duration is that long before
    ``now`` (the database's clock)."""
    return now - value if isinstance(value, timedelta) else value
