"""The JSON log line: what the log pipeline and the tests read."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from reaper import eventlog, events
from reaper.logs import JsonFormatter, get_logger, log
from tests.support.facts import fields, log_records


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("reaper")
    before = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(before[0])
    logger.propagate = before[1]


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_line_carries_its_event_level_logger_and_fields(captured: io.StringIO) -> None:
    when = datetime(2026, 12, 3, 6, 7, 8, 90, tzinfo=UTC)
    log(
        get_logger("cycle"),
        "conference.reaped",
        conference_id="c1",
        duration_seconds=None,
        ended_at=when,
        count=3,
    )
    [line] = lines(captured)
    assert line.pop("ts")
    assert line == {
        "level": "INFO",
        "logger": "reaper.cycle",
        "event": "conference.reaped",
        "conference_id": "c1",
        "duration_seconds": None,
        "ended_at": when.isoformat(),
        "count": 3,
    }


def test_the_timestamp_is_the_records_moment_in_utc_with_microseconds() -> None:
    formatter = JsonFormatter()
    moments = (1_764_741_600.0, 1_764_741_600.000_001, 1_764_741_600.5, 1_764_741_601.999_999_7)
    for created in moments:
        record = logging.makeLogRecord({"created": created, "msg": "x"})
        stamp = json.loads(formatter.format(record))["ts"]
        expected = datetime.fromtimestamp(created, UTC)
        parsed = datetime.fromisoformat(stamp)
        assert parsed.utcoffset() == timedelta(0)
        assert abs((parsed - expected).total_seconds()) <= 1e-6, (created, stamp)


def test_the_second_is_formatted_again_when_it_changes() -> None:
    formatter = JsonFormatter()
    stamps = [
        json.loads(formatter.format(logging.makeLogRecord({"created": t, "msg": "x"})))["ts"]
        for t in (100.25, 100.75, 101.5, 100.5)
    ]
    assert stamps == [
        "1970-01-01T00:01:40.250000+00:00",
        "1970-01-01T00:01:40.750000+00:00",
        "1970-01-01T00:01:41.500000+00:00",
        "1970-01-01T00:01:40.500000+00:00",
    ]


def test_a_record_of_another_library_is_rendered_by_its_message(captured: io.StringIO) -> None:
    logging.getLogger("reaper.other").warning("plain %s", "text")
    [line] = lines(captured)
    assert (line["event"], line["level"]) == ("plain text", "WARNING")


def test_an_exception_is_rendered_with_its_traceback(captured: io.StringIO) -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("reaper.other").error("failed", exc_info=sys.exc_info())
    [line] = lines(captured)
    assert "ValueError: boom" in line["exception"]


def test_a_value_json_cannot_hold_is_written_as_its_text(captured: io.StringIO) -> None:
    class Odd:
        def __str__(self) -> str:
            return "odd"

    log(get_logger("cycle"), "x.y", value=Odd())
    assert lines(captured)[0]["value"] == "odd"


def test_a_mapping_with_keys_that_are_not_text_is_still_written(captured: io.StringIO) -> None:
    log(get_logger("cycle"), "x.y", per_phase={1: "a", "b": 2})
    assert lines(captured)[0]["per_phase"] == {"1": "a", "b": 2}


def test_the_plain_message_names_the_event_and_its_fields(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="reaper"):
        log(get_logger("cycle"), "phase.completed", phase="empty_room", reaped=2)
    [record] = log_records(caplog, "phase.completed")
    assert record.getMessage() == "phase.completed phase=empty_room reaped=2"
    assert fields(record) == {"phase": "empty_room", "reaped": 2}


def test_a_disabled_level_builds_no_record(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="reaper"):
        log(get_logger("cycle"), "conference.reaped", conference_id="c1")
    assert not log_records(caplog, "conference.reaped")


# -- facts declared with @logged -----------------------------------------------

WHEN = datetime(2026, 12, 6, 3, 0, 0, 123456, tzinfo=UTC)

# One of each fact declared with @logged: a fact declared without one here fails
# the test below, so each declaration is held to the line it writes.
DECLARED_SAMPLES: tuple[object, ...] = (
    events.CycleSkipped(run_id="r1", reason="held", holder_pid=7, owner_run_id="r0"),
    events.PhaseUnknown(run_id="r1", phase="never_joined", known=("empty_room", "stale_live")),
    events.ConferenceReaped(
        run_id="r1",
        phase="empty_room",
        conference_id="c1",
        chat_id="ch1",
        deal_id="d1",
        tenant_id="t1",
        status="Ended",
        end_reason="EmptyTimeout",
        duration_seconds=42,
        lateness_seconds=1.5,
    ),
    events.ItemFailed(run_id="r1", phase="stale_live", conference_id="c2", error="refused"),
    events.ConferenceAnomaly(run_id="r1", phase="stale_live", conference_id="c3", problem="p"),
    events.LockLost(run_id="r1", phase="empty_room", error="gone"),
    events.ControlResumed(phase="empty_room", reason="why", resumed_by="ops"),
    events.OutboxRequeued(count=2, event_id="e1", requeued_by="ops"),
    events.OutboxDiscarded(
        event_id="e2",
        message_key="deal-1",
        topic="conf.ended",
        reason="refused for good",
        discarded_by="ops",
        discarded_login="reaper_operator",
    ),
    events.RelayKafkaUnavailable(bootstrap_servers="k:9092", error="down", rows=4, cause="tls"),
    events.RelayDbFailed(error="db"),
    events.RelayCloseFailed(error="close"),
    events.RelayRetentionDeleted(count=5, cutoff=WHEN),
)


def test_every_declared_fact_has_a_sample_here() -> None:
    assert {type(f) for f in DECLARED_SAMPLES} == set(events.LOGGED)


@pytest.mark.parametrize("fact", DECLARED_SAMPLES, ids=lambda f: type(f).__name__)
def test_a_declared_fact_logs_its_declared_event_level_logger_and_fields(
    fact: object, caplog: pytest.LogCaptureFixture
) -> None:
    declared = events.LOGGED[type(fact)]
    bus = events.Bus()
    eventlog.subscribe(bus)
    with caplog.at_level(logging.DEBUG, logger="reaper"):
        bus.emit(fact)
    [record] = [r for r in caplog.records if getattr(r, "event", None)]
    assert (record.name, record.event, record.levelno) == (  # type: ignore[attr-defined]
        f"reaper.{declared.logger}",
        declared.event,
        declared.level,
    )
    # every declared field, in the declared order, as the fact holds it
    assert list(fields(record).items()) == [(name, getattr(fact, name)) for name in declared.fields]


def test_a_declaration_naming_no_field_of_its_fact_is_refused() -> None:
    with pytest.raises(TypeError, match="no field 'nope'"):

        @events.logged("x.y", fields=("nope",), logger="cycle")
        @dataclass(frozen=True)
        class Fact:
            run_id: str
