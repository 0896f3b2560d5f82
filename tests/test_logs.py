"""The JSON log line: what the log pipeline and the tests read."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

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
