"""The two roles (migration 0009, docs/design.md#roles): ``reaper_worker`` runs
cycles, the relay, the stop signals and retention, reads the operator's
controls and never writes them, deletes only published outbox rows past the
retention; ``reaper_operator`` runs pause, resume, policy, outbox parked,
requeue and discard, status and plan, and cannot change a conference. Every command of
both is run as a real login."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import DBAPIError

from reaper import budgets
from reaper.cycle import Reaper
from reaper.db import transaction
from reaper.errors import sqlstate
from reaper.queries import Queries
from tests.support import factory as f
from tests.support.docs import ROOT, names, table
from tests.support.processes import run_cli
from tests.support.roles import function_grants, login

WORKER = "reaper_worker"
OPERATOR = "reaper_operator"
TABLES = (
    "conference_sessions",
    "conference_participants",
    "call_recordings",
    "integration_outbox",
    "realtime_outbox",
    "reaper_runs",
    "reaper_pauses",
    "reaper_tenant_windows",
    "reaper_migrations",
    "outbox_discards",
    "outbox_republishes",
)
PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
OPERATOR_TABLE_PRIVILEGES: dict[str, set[str]] = {
    "conference_sessions": {"SELECT"},
    "conference_participants": set(),
    "call_recordings": set(),
    "integration_outbox": {"SELECT"},
    # the ledger of reaper reconcile checks each closing's push row (0014)
    "realtime_outbox": {"SELECT"},
    "reaper_runs": {"SELECT"},
    "reaper_pauses": {"SELECT", "INSERT", "UPDATE", "DELETE"},
    "reaper_tenant_windows": {"SELECT", "INSERT", "UPDATE", "DELETE"},
    # the schema's record, read by the check every command makes first (0010)
    "reaper_migrations": {"SELECT"},
    # reaper outbox discard writes it through messenger.discard_outbox (0013) alone
    "outbox_discards": {"SELECT"},
    # reaper reconcile --republish writes it through messenger.republish_outbox (0014) alone
    "outbox_republishes": {"SELECT"},
}
OPERATOR_UPDATE_COLUMNS = {"integration_outbox": {"parked_at", "attempts", "next_attempt_at"}}
RETENTION_FUNCTION = "messenger.delete_published_outbox(interval, int)"
TENANT = "aaaaaaaa-0000-4000-8000-000000000001"


def table_privileges(conn: Any, role: str, table: str) -> set[str]:
    return {
        p
        for p in PRIVILEGES
        if conn.execute(
            text("SELECT has_table_privilege(:r, :t, :p)"),
            {"r": role, "t": f"messenger.{table}", "p": p},
        ).scalar()
    }


def update_columns(conn: Any, role: str, table: str) -> set[str]:
    return set(
        conn.execute(
            text(
                "SELECT column_name FROM information_schema.column_privileges"
                " WHERE grantee = :r AND table_schema = 'messenger'"
                " AND table_name = :t AND privilege_type = 'UPDATE'"
            ),
            {"r": role, "t": table},
        ).scalars()
    )


def test_operator_role_has_exactly_what_its_commands_need(engine):
    with engine.connect() as conn:
        role = conn.execute(
            text(
                "SELECT rolcanlogin, rolsuper, rolcreaterole, rolcreatedb, rolbypassrls"
                " FROM pg_roles WHERE rolname = :r"
            ),
            {"r": OPERATOR},
        ).one()
        assert tuple(role) == (False, False, False, False, False)
        for table in TABLES:
            assert table_privileges(conn, OPERATOR, table) == OPERATOR_TABLE_PRIVILEGES[table], (
                table
            )
            if "UPDATE" not in OPERATOR_TABLE_PRIVILEGES[table]:  # else every column is listed
                assert update_columns(conn, OPERATOR, table) == OPERATOR_UPDATE_COLUMNS.get(
                    table, set()
                ), table
        assert {
            p
            for p in PRIVILEGES
            if conn.execute(
                text("SELECT has_table_privilege(:r, 'public.alembic_version', :p)"),
                {"r": OPERATOR, "p": p},
            ).scalar()
        } == {"SELECT"}  # the revision, for the same check
        for what, sql in {
            "CREATE on schema messenger": "SELECT has_schema_privilege(:r, 'messenger', 'CREATE')",
            "CREATE on schema public": "SELECT has_schema_privilege(:r, 'public', 'CREATE')",
            "CREATE on the database": (
                "SELECT has_database_privilege(:r, current_database(), 'CREATE')"
            ),
            "EXECUTE of the retention function": (
                f"SELECT has_function_privilege(:r, '{RETENTION_FUNCTION}', 'EXECUTE')"
            ),
        }.items():
            assert conn.execute(text(sql), {"r": OPERATOR}).scalar() is False, what
        # neither role is a member of the other: a login gets one set of rights
        memberships = conn.execute(
            text("SELECT pg_has_role(:a, :b, 'MEMBER'), pg_has_role(:b, :a, 'MEMBER')"),
            {"a": WORKER, "b": OPERATOR},
        ).one()
        assert tuple(memberships) == (False, False)


@pytest.mark.parametrize(
    "function",
    [
        RETENTION_FUNCTION,
        # the relay's acknowledgement and the snapshot gauge (migration 0012)
        "messenger.acknowledge_outbox(bigint[])",
        "messenger.oldest_snapshot_age_seconds()",
    ],
)
def test_only_the_worker_role_may_run_its_functions_and_each_is_pinned(engine, function):
    worker, operator, public, definer, config = function_grants(engine, function)
    assert (worker, operator, public, definer) == (True, False, False, True)
    assert config == ["search_path=pg_catalog, pg_temp"]


def test_the_acknowledgement_deletes_only_pending_rows_it_is_named(engine, worker_engine):
    """As the worker's login: the named pending rows go; a parked row, a published
    one (a 0.3.0 relay's, for retention) and a row not named stay."""
    with engine.begin() as conn:
        ids = (
            conn.execute(
                text(
                    "INSERT INTO messenger.integration_outbox"
                    " (event_id, topic, message_key, payload, published_at, parked_at)"
                    " SELECT gen_random_uuid(), 't', 'k' || g, '{}',"
                    "        CASE WHEN g = 2 THEN now() END, CASE WHEN g = 3 THEN now() END"
                    " FROM generate_series(1, 4) g RETURNING id"
                )
            )
            .scalars()
            .all()
        )
    pending, published, parked, other = ids
    with worker_engine.begin() as conn:
        deleted = Queries(conn).acknowledge_outbox([pending, published, parked])
    assert deleted == 1
    with engine.connect() as conn:
        left = (
            conn.execute(text("SELECT id FROM messenger.integration_outbox ORDER BY id"))
            .scalars()
            .all()
        )
    assert left == [published, parked, other]


@pytest.fixture
def worker_engine(database_url: str, engine: Engine) -> Iterator[Engine]:
    with login(engine, database_url, WORKER) as url:
        role_engine = create_engine(url)
        yield role_engine
        role_engine.dispose()


@pytest.fixture
def operator_engine(database_url: str, engine: Engine) -> Iterator[Engine]:
    with login(engine, database_url, OPERATOR, prefix="reaper_oper") as url:
        role_engine = create_engine(url)
        yield role_engine
        role_engine.dispose()


def outbox_row(conn: Any, *, published_ago: timedelta | None, parked: bool = False) -> str:
    """An integration_outbox row created 30 days ago: published that long ago
    (None: not published), or parked."""
    event_id = str(uuid.uuid4())
    conn.execute(
        text(
            "INSERT INTO messenger.integration_outbox"
            " (event_id, topic, message_key, payload, created_at, published_at, parked_at,"
            "  attempts, last_error)"
            " VALUES (:e, 't', :e, '{}', now() - interval '30 days',"
            "         now() - CAST(:ago AS interval), CASE WHEN :parked THEN now() END,"
            "         CASE WHEN :parked THEN 20 ELSE 0 END,"
            "         CASE WHEN :parked THEN 'refused' END)"
        ),
        {"e": event_id, "ago": published_ago, "parked": parked},
    )
    return event_id


def outbox_ids(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return set(
            conn.execute(text("SELECT event_id::text FROM messenger.integration_outbox")).scalars()
        )


def test_the_worker_deletes_only_published_rows_past_the_retention(settings, engine, worker_engine):
    with engine.begin() as conn:
        old = outbox_row(conn, published_ago=timedelta(hours=3))
        recent = outbox_row(conn, published_ago=timedelta(minutes=30))
        pending = outbox_row(conn, published_ago=None)
        parked = outbox_row(conn, published_ago=None, parked=True)
    with transaction(worker_engine, budgets.quick(settings)) as queries:
        assert queries.delete_published_outbox(timedelta(hours=1), 1000) == 1
    assert outbox_ids(engine) == {recent, pending, parked}
    assert old not in outbox_ids(engine)
    # a retention under the floor is refused, whoever asks; nothing deleted
    for retention in (timedelta(minutes=59), timedelta(0)):
        with (
            pytest.raises(DBAPIError, match="kept at least an hour") as refused,
            transaction(worker_engine, budgets.quick(settings)) as queries,
        ):
            queries.delete_published_outbox(retention, 1000)
        assert sqlstate(refused.value) == "42501"
    # and the table itself refuses the worker a DELETE, of any row
    for where in ("", f" WHERE event_id = '{pending}'", f" WHERE event_id = '{recent}'"):
        with (
            pytest.raises(DBAPIError, match="permission denied") as refused,
            worker_engine.begin() as conn,
        ):
            conn.exec_driver_sql(f"DELETE FROM messenger.integration_outbox{where}")
        assert sqlstate(refused.value) == "42501"
    assert outbox_ids(engine) == {recent, pending, parked}


def test_the_stop_pass_claims_and_marks_as_a_worker_login(settings, engine, worker_engine):
    """The stop pass's lock, lease (FOR UPDATE ... SKIP LOCKED), back-off and
    release run with the worker role's column grants on call_recordings."""
    from reaper.recorder import StopPass
    from tests.support.ports import free_port

    now = f.db_now(engine)
    with engine.begin() as conn:
        room = f.conference(conn, as_of=now, idle=timedelta(minutes=5))
        recording = f.recording(conn, room["id"], status="Recording")
    Reaper(settings, engine=engine).run_cycle()
    refusing = settings.model_copy(update={"recorder_url": f"http://127.0.0.1:{free_port()}"})
    sent = StopPass(refusing, engine=worker_engine).run()
    assert (sent.requested, sent.taken, sent.skipped) == (1, 0, False)
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT stop_attempts, stop_next_attempt_at FROM messenger.call_recordings"
                " WHERE id = :id"
            ),
            {"id": recording["id"]},
        ).one()
    assert row.stop_attempts == 1 and row.stop_next_attempt_at is not None


def test_the_operator_cannot_change_a_conference_nor_run_the_worker(engine, operator_engine):
    with engine.begin() as conn:
        room = f.conference(conn, idle=timedelta(minutes=5))
        f.participant(conn, room["id"], joined_at=f.T0 - timedelta(minutes=20))
        f.recording(conn, room["id"], status="Recording", created_at=f.T0)
        outbox_row(conn, published_ago=timedelta(days=30))
    denied = [
        f"UPDATE messenger.conference_sessions SET status = 'Ended' WHERE id = '{room['id']}'",
        "UPDATE messenger.conference_sessions SET last_activity_at = now()",
        "DELETE FROM messenger.conference_sessions",
        "INSERT INTO messenger.conference_sessions (id) VALUES (gen_random_uuid())",
        "UPDATE messenger.conference_participants SET left_at = now()",
        "SELECT * FROM messenger.conference_participants",
        "UPDATE messenger.call_recordings SET stop_requested_at = now()",
        "INSERT INTO messenger.realtime_outbox (kind) VALUES ('ConferenceEnded')",
        "INSERT INTO messenger.integration_outbox (event_id) VALUES (gen_random_uuid())",
        "UPDATE messenger.integration_outbox SET payload = '{}'",
        "UPDATE messenger.integration_outbox SET published_at = now()",
        "DELETE FROM messenger.integration_outbox",
        "SELECT messenger.delete_published_outbox(interval '1 day', 10)",
        "INSERT INTO messenger.reaper_runs (run_id) VALUES ('x')",
        "UPDATE messenger.reaper_runs SET errors = 1",
        "TRUNCATE messenger.reaper_pauses",
        "CREATE TABLE messenger.x (id int)",
    ]
    for statement in denied:
        with (
            pytest.raises(DBAPIError, match="permission denied") as refused,
            operator_engine.begin() as conn,
        ):
            conn.exec_driver_sql(statement)
        assert sqlstate(refused.value) == "42501", (statement, refused.value)
    with engine.connect() as conn:
        assert f.statuses(conn)[room["id"]] == ("Active", None)
        assert conn.execute(text("SELECT count(*) FROM messenger.integration_outbox")).scalar() == 1


# -- every command, as a real login ---------------------------------------------------


def cli(url: str, *args: str) -> Any:
    return run_cli(*args, env={"REAPER_DATABASE_URL": url, "REAPER_OPERATOR": "tester"})


def refused_for_permission(done: Any) -> bool:
    """Exit 1 and one line naming the refusal, without a traceback."""
    lines = done.stderr.strip().splitlines()
    return (
        done.returncode == 1
        and "permission denied" in lines[-1]
        and lines[-1].startswith("reaper: database ")
        and "Traceback" not in done.stderr
    )


def stderr_events(stderr: str, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return [line for line in lines if line["event"] == name]


def seed_for_commands(engine: Engine) -> dict[str, Any]:
    with engine.begin() as conn:
        now = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        room = f.conference(conn, as_of=now, idle=timedelta(minutes=5))
        parked = outbox_row(conn, published_ago=None, parked=True)
        never = outbox_row(conn, published_ago=None, parked=True)  # Kafka will never take it
    return {"room": room, "parked": parked, "never": never}


def pauses(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT phase FROM messenger.reaper_pauses")).scalars())


def tenant_policies(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT DISTINCT tenant_id::text FROM messenger.reaper_tenant_windows")
            ).scalars()
        )


def discarded(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(text("SELECT event_id::text FROM messenger.outbox_discards")).scalars()
        )


def parked_at(engine: Engine, event_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT parked_at FROM messenger.integration_outbox WHERE event_id = :e"),
            {"e": event_id},
        ).scalar_one()


@pytest.mark.process
def test_every_operator_command_runs_as_an_operator_login(database_url, engine):
    seeded = seed_for_commands(engine)
    room, parked = seeded["room"], seeded["parked"]
    with login(engine, database_url, OPERATOR, prefix="reaper_oper") as url:
        done = cli(url, "status", "--json")
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        assert status["outbox"]["parked"] == 2, status
        done = cli(url, "plan", "--json")
        assert done.returncode == 0, done.stderr
        assert room["id"] in done.stdout

        done = cli(url, "pause", "--phase", "stale_live", "--reason", "presence outage")
        assert done.returncode == 0, done.stderr
        assert pauses(engine) == ["stale_live"]
        done = cli(url, "resume")
        assert done.returncode == 0, done.stderr
        assert pauses(engine) == []

        done = cli(url, "policy", "set", "--tenant", TENANT, "--stale-live-timeout", "PT6H")
        assert done.returncode == 0, done.stderr
        done = cli(url, "policy", "list", "--json")
        assert done.returncode == 0, done.stderr
        assert [p["tenant_id"] for p in json.loads(done.stdout)] == [TENANT]
        done = cli(url, "policy", "unset", "--tenant", TENANT)
        assert done.returncode == 0, done.stderr
        assert tenant_policies(engine) == []

        done = cli(url, "outbox", "parked", "--json")
        assert done.returncode == 0, done.stderr
        assert {r["event_id"] for r in json.loads(done.stdout)} == {parked, seeded["never"]}
        done = cli(url, "outbox", "requeue", "--event-id", parked)
        assert done.returncode == 0, done.stderr
        assert parked_at(engine, parked) is None
        done = cli(url, "outbox", "discard", "--event-id", seeded["never"], "--reason", "too big")
        assert done.returncode == 0, done.stderr
        assert discarded(engine) == [seeded["never"]]

        # the worker's command is not the operator's: no conference changes
        done = cli(url, "reap", "--once", "--json")
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert json.loads(done.stdout)["empty_timeout_count"] == 0
        [completed] = stderr_events(done.stderr, "cycle.completed")
        assert completed["errors"] == 1
        assert "permission denied for table reaper_runs" in completed["error"]
        # the schema is the owner's
        assert refused_for_permission(cli(url, "migrate"))
    with engine.connect() as conn:
        assert f.statuses(conn)[room["id"]] == ("Active", None)


@pytest.mark.process
def test_every_worker_command_runs_or_is_refused_as_a_worker_login(database_url, engine):
    seeded = seed_for_commands(engine)
    room, parked = seeded["room"], seeded["parked"]
    with engine.begin() as conn:  # as the owner: a pause and a policy the worker must not change
        conn.execute(
            text(
                "INSERT INTO messenger.reaper_pauses (phase, reason, paused_at, paused_by)"
                " VALUES ('stale_live', 'kept', clock_timestamp(), 'owner')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO messenger.reaper_tenant_windows"
                " (tenant_id, phase, window_length, updated_at, updated_by)"
                " VALUES (CAST(:t AS uuid), 'stale_live', interval '6 hours', clock_timestamp(),"
                " 'owner')"
            ),
            {"t": TENANT},
        )
    with login(engine, database_url, WORKER) as url:
        # what the worker runs: a whole cycle (its pause is read and honoured)
        done = cli(url, "reap", "--once", "--json")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert (result["empty_timeout_count"], result["paused"]) == (1, ["stale_live"])
        # what it may read
        for args in (["status"], ["plan"], ["policy", "list"], ["outbox", "parked"]):
            done = cli(url, *args)
            assert done.returncode == 0, (args, done.stderr)
        # what only an operator may do
        for args in (
            ["pause", "--phase", "empty_room", "--reason", "steering"],
            ["resume"],
            ["policy", "set", "--tenant", TENANT, "--stale-live-timeout", "PT1H"],
            ["policy", "unset", "--tenant", TENANT],
            # a worker credential must not drop an event unseen (migration 0013)
            ["outbox", "discard", "--event-id", seeded["never"], "--reason", "steering"],
        ):
            done = cli(url, *args)
            assert refused_for_permission(done), (args, done.returncode, done.stderr)
        # Requeue writes only columns the relay itself writes (parked_at, attempts,
        # next_attempt_at): column rights cannot tell the two apart, so a worker
        # login can requeue (docs/design.md#roles). It steers nothing: the row is
        # sent again, once, and parked again if Kafka still refuses it.
        done = cli(url, "outbox", "requeue", "--event-id", parked)
        assert done.returncode == 0, done.stderr
        assert refused_for_permission(cli(url, "migrate"))
    with engine.connect() as conn:
        assert f.statuses(conn)[room["id"]] == ("Ended", "EmptyTimeout")
    assert pauses(engine) == ["stale_live"]
    assert tenant_policies(engine) == [TENANT]
    assert parked_at(engine, parked) is None
    assert parked_at(engine, seeded["never"]) is not None and discarded(engine) == []


def documented(cell: str) -> set[str]:
    """The table privileges a cell of docs/design.md's roles table names: an
    UPDATE of named columns is an UPDATE, ``no DELETE`` names none."""
    cell = re.sub(r"\bno (SELECT|INSERT|UPDATE|DELETE)\b", "", cell)
    return set(re.findall(r"\b(SELECT|INSERT|UPDATE|DELETE)\b", cell))


def test_the_roles_table_of_the_design_is_the_grants(engine):
    """Each table's row of docs/design.md#roles says what each role may do to
    it, as the database grants it; every table either role can read is there."""
    rows = {
        name: cells
        for cells in table(ROOT / "docs" / "design.md", "Roles")
        for name in names(cells[0])
        if cells[0] not in ("runs", "functions")
    }
    assert set(rows) == {*TABLES, "public.alembic_version"}, sorted(rows)
    wrong = {}
    with engine.connect() as conn:
        for name, cells in rows.items():
            qualified = name if "." in name else f"messenger.{name}"
            for role, cell in ((WORKER, cells[1]), (OPERATOR, cells[2])):
                granted = {
                    p
                    for p in ("SELECT", "INSERT", "UPDATE", "DELETE")
                    if conn.execute(
                        text("SELECT has_table_privilege(:r, :t, :p)"),
                        {"r": role, "t": qualified, "p": p},
                    ).scalar()
                }
                if "." not in name and update_columns(conn, role, name):
                    granted.add("UPDATE")  # of some columns only
                if documented(cell) != granted:
                    wrong[f"{role} on {name}"] = (sorted(documented(cell)), sorted(granted))
    assert not wrong, f"(documented, granted): {wrong}"
