"""Checks shared by the fault and race tests: nothing lost, nothing twice."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Connection, Engine, text

from reaper.runs import holder

# Every terminal conference has exactly its outbox rows, and every outbox row
# its transition: Ended (by anyone) -> 1 integration + 1 ConferenceEnded;
# Failed -> 0 integration + 1 ConferenceSignal; live -> none. Rows that the
# test seeded as already terminal carry no outbox rows and are left out.
VIOLATIONS = text(
    """
    WITH integ AS (
        SELECT (payload->'payload'->>'conferenceId')::uuid AS id, count(*) AS n,
               count(DISTINCT event_id) AS events
        FROM messenger.integration_outbox GROUP BY 1
    ), rt AS (
        SELECT conference_id AS id, count(*) AS n,
               count(*) FILTER (WHERE kind = 'ConferenceEnded') AS ended,
               count(*) FILTER (WHERE kind = 'ConferenceSignal') AS signal
        FROM messenger.realtime_outbox GROUP BY 1
    )
    SELECT s.id, s.status, s.end_reason, coalesce(i.n, 0) AS integration,
           coalesce(r.ended, 0) AS rt_ended, coalesce(r.signal, 0) AS rt_signal
    FROM messenger.conference_sessions s
    LEFT JOIN integ i ON i.id = s.id
    LEFT JOIN rt r ON r.id = s.id
    WHERE s.id <> ALL (CAST(:preterminal AS uuid[])) AND NOT (
        (s.status = 'Ended' AND i.n = 1 AND i.events = 1 AND r.ended = 1 AND r.n = 1)
        OR (s.status = 'Failed' AND i.n IS NULL AND r.signal = 1 AND r.n = 1)
        OR (s.status IN ('Active', 'Provisioning') AND i.n IS NULL AND r.n IS NULL))
    UNION ALL
    SELECT i.id, 'orphan-integration', NULL, i.n, 0, 0
    FROM integ i WHERE NOT EXISTS (SELECT 1 FROM messenger.conference_sessions s WHERE s.id = i.id)
    UNION ALL
    SELECT r.id, 'orphan-realtime', NULL, 0, r.ended, r.signal
    FROM rt r WHERE NOT EXISTS (SELECT 1 FROM messenger.conference_sessions s WHERE s.id = r.id)
    """
)

TALLY = text(
    """
    SELECT count(*) FILTER (WHERE status IN ('Active', 'Provisioning')) AS live,
           count(*) FILTER (WHERE status = 'Ended') AS ended,
           count(*) FILTER (WHERE status = 'Failed') AS failed,
           (SELECT count(*) FROM messenger.integration_outbox) AS integration,
           (SELECT count(*) FROM messenger.realtime_outbox) AS realtime
    FROM messenger.conference_sessions
    """
)


@dataclass
class Audit:
    live: int
    ended: int
    failed: int
    integration: int
    realtime: int
    violations: list[dict] = field(default_factory=list)

    def assert_clean(self) -> None:
        assert self.violations == [], f"{len(self.violations)} violations: {self.violations[:5]}"


def audit(conn: Connection, preterminal: list[str] | None = None) -> Audit:
    tally = conn.execute(TALLY).one()
    bad = conn.execute(VIOLATIONS, {"preterminal": preterminal or []}).mappings().all()
    return Audit(**tally._mapping, violations=[dict(r) for r in bad])


def audit_engine(engine: Engine, preterminal: list[str] | None = None) -> Audit:
    with engine.connect() as conn:
        return audit(conn, preterminal)


def lock_free(engine: Engine) -> bool:
    return holder(engine) is None
