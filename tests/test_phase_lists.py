"""What lists the phases' end reasons and statuses is held to the phases
(reaper/phases.py): the conference's check constraints, the partial index the
recorder's claim walks (ix_conf_reaped, migration 0007) and the claim itself.
A phase whose end reason one of them misses would have its rooms refused by
the check, or its recordings' stop signals never claimed (the claim composed
from the phases, the index not matching it)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from sqlalchemy import Engine, text

from reaper.phases import EMPTY_ROOM, IN_ORDER
from reaper.queries import statement


def quoted(definition: str) -> set[str]:
    """The string constants of a constraint's or an index's definition."""
    return set(re.findall(r"'([^']*)'", definition))


def definitions(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        checks = conn.execute(
            text(
                "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint"
                " WHERE conrelid = CAST('messenger.conference_sessions' AS regclass)"
                " AND contype = 'c'"
            )
        ).all()
        index = conn.execute(
            text("SELECT pg_get_indexdef(CAST('messenger.ix_conf_reaped' AS regclass))")
        ).scalar_one()
    return {name: definition for name, definition in checks} | {"ix_conf_reaped": index}


def test_the_checks_and_the_recorders_index_admit_every_phases_end_reason_and_status(engine):
    found = definitions(engine)
    reasons = {phase.end_reason for phase in IN_ORDER}
    statuses = {phase.status for phase in IN_ORDER}
    assert reasons <= quoted(found["ck_conf_end_reason"]), found["ck_conf_end_reason"]
    assert reasons <= quoted(found["ix_conf_reaped"]), found["ix_conf_reaped"]
    assert statuses <= quoted(found["ck_conf_status"]), found["ck_conf_status"]


@pytest.mark.parametrize("name", ["claim_stops_due", "ledger_closings", "ledger_pushes"])
def test_the_statements_of_the_reapers_rooms_list_exactly_the_phases_end_reasons(name):
    """Composed from the phases (sql/queries.sql ``phase_end_reason``): the rooms
    of every phase, and no others (a room ended by a person is not the reaper's):
    the recorder's claim, and the ledger's closings and their push rows. Written
    for this release's phases and a stand-in phase with an end reason of its own,
    which a list written by hand would miss."""
    stand_in = replace(EMPTY_ROOM, name="test_only_phase", end_reason="TestOnlyEnd")
    for order in (IN_ORDER, (*IN_ORDER, stand_in)):
        written = statement(name, None, order).text
        [listed] = re.findall(r"s\.end_reason IN \(([^)]*)\)", written)
        assert quoted(listed) == {phase.end_reason for phase in order}, written
