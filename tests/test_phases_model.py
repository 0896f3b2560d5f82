"""The three phases against a reference model (docs/design.md#the-three-phases).

Random rooms (status, participants, last activity, age, tenant), random tenant
windows and paused phases; a real cycle on the session's PostgreSQL must close
exactly the rooms the model says, each with the model's status and reason:

- ``empty_room``: Active, no participant, idle for at least its tenant's grace
  (90 s by default) -> Ended / EmptyTimeout;
- ``provision_timeout``: Provisioning for at least its tenant's timeout (2 min)
  -> Failed / Error;
- ``stale_live``: Active, idle for at least its tenant's timeout (4 h) whatever
  the participants -> Ended / Timeout;

in that order, a room closed by one phase being out of reach of the next, and
a paused phase closing nothing. At most 12 rooms, so the mass-closure guard
(a floor of 20) never acts here; tests/test_reliability_guard.py has it. The examples
are few and the rows are reset before each: a few seconds in all.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from reaper.config import Settings
from reaper.control import Controls
from reaper.cycle import Reaper
from reaper.db import engine_for
from reaper.events import Bus
from reaper.phases import ORDER
from tests.conftest import TABLES
from tests.support import factory as f
from tests.support.factory import T0

TENANTS = ("00000000-0000-0000-0000-00000000000a", "00000000-0000-0000-0000-00000000000b")
DEFAULTS = Settings()
DEFAULT_WINDOWS = (
    DEFAULTS.empty_room_grace,
    DEFAULTS.provision_timeout,
    DEFAULTS.stale_live_timeout,
)


ENDED_BEFORE = "Normal"  # the end_reason of a room ended before the cycle


@dataclass(frozen=True)
class Room:
    status: str  # Active, Provisioning or Ended
    participants: int
    idle: timedelta  # from last activity to as_of
    age: timedelta  # from created_at to as_of
    tenant: str


@dataclass(frozen=True)
class Policy:
    """A tenant's windows; None keeps the default."""

    grace: timedelta | None
    provision: timedelta | None
    stale: timedelta | None

    def windows(self) -> tuple[timedelta, timedelta, timedelta]:
        grace, provision, stale = DEFAULT_WINDOWS
        return (self.grace or grace, self.provision or provision, self.stale or stale)


policies = st.builds(
    Policy,
    grace=st.sampled_from([None, timedelta(seconds=60), timedelta(seconds=300)]),
    provision=st.sampled_from([None, timedelta(seconds=60), timedelta(seconds=600)]),
    stale=st.sampled_from([None, timedelta(hours=1), timedelta(hours=6)]),
)
OFF_EDGE = st.sampled_from([0, -1, 1]).map(lambda s: timedelta(seconds=s))
ANYWHERE = st.integers(0, 8 * 3600).map(lambda s: timedelta(seconds=s))


@st.composite
def room(draw: st.DrawFn, policy: Policy | None) -> Room:
    """A room whose idle time and age lie on an edge of its tenant's windows (on
    it, or a second either side: where a predicate's < and <= differ) or
    anywhere up to 8 h."""
    tenant = draw(st.sampled_from(TENANTS))
    grace, provision, stale = windows(policy if tenant == TENANTS[0] else None)
    idle = draw(st.sampled_from([grace, stale, None]))
    age = draw(st.sampled_from([provision, None]))
    return Room(
        status=draw(st.sampled_from(["Active", "Provisioning", "Active", "Ended"])),
        participants=draw(st.sampled_from([0, 1, 2])),
        idle=draw(ANYWHERE) if idle is None else idle + draw(OFF_EDGE),
        age=draw(ANYWHERE) if age is None else age + draw(OFF_EDGE),
        tenant=tenant,
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Policy | None, frozenset[str], list[Room]]:
    """The first tenant's policy (the second keeps the defaults), the paused
    phases, and the rooms."""
    policy = draw(st.one_of(st.none(), policies))
    paused = draw(st.frozensets(st.sampled_from(ORDER), max_size=2))
    return policy, paused, draw(st.lists(room(policy), min_size=1, max_size=12))


def windows(policy: Policy | None) -> tuple[timedelta, timedelta, timedelta]:
    return (policy or Policy(None, None, None)).windows()


def model(room: Room, policy: Policy | None, paused: frozenset[str]) -> tuple[str, str | None]:
    """What the cycle leaves of the room: (status, end_reason)."""
    grace, provision, stale = windows(policy)
    active = room.status == "Active"
    if "empty_room" not in paused and active and room.participants == 0 and room.idle >= grace:
        return "Ended", "EmptyTimeout"
    provisioning = room.status == "Provisioning"
    if "provision_timeout" not in paused and provisioning and room.age >= provision:
        return "Failed", "Error"
    if "stale_live" not in paused and active and room.idle >= stale:
        return "Ended", "Timeout"
    return room.status, ENDED_BEFORE if room.status == "Ended" else None


def ended(room: Room) -> dict[str, Any]:
    """An ended room says why and when (the table's check)."""
    if room.status != "Ended":
        return {}
    return {"end_reason": ENDED_BEFORE, "ended_at": T0 - room.idle}


@settings(
    max_examples=50,
    deadline=None,
    database=None,  # no .hypothesis directory in the work tree
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(scenario=scenarios())
def test_a_cycle_closes_exactly_what_the_three_predicates_select(
    database_url: str, scenario: tuple[Policy | None, frozenset[str], list[Room]]
) -> None:
    policy, paused, drawn = scenario
    engine = engine_for(database_url)
    config = Settings(database_url=database_url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
    controls = Controls(engine, config, bus=Bus())
    if policy is not None and policy != Policy(None, None, None):
        # the first tenant's; the second keeps the defaults
        controls.set_policy(
            TENANTS[0],
            empty_room_grace=policy.grace,
            provision_timeout=policy.provision,
            stale_live_timeout=policy.stale,
        )
    if paused:
        controls.pause(sorted(paused), "the model's pause")
    with engine.begin() as conn:
        ids = [
            f.conference(
                conn,
                status=room.status,
                participants=room.participants,
                idle=room.idle,
                age=room.age,
                tenant_id=room.tenant,
                **ended(room),
            )["id"]
            for room in drawn
        ]
    Reaper(config, engine=engine, bus=Bus()).run_cycle(T0)
    with engine.connect() as conn:
        found = f.statuses(conn)
    expected = {
        room_id: model(room, policy if room.tenant == TENANTS[0] else None, paused)
        for room_id, room in zip(ids, drawn, strict=True)
    }
    assert found == expected
