"""The previous release beside this one (docs/design.md#releases-and-the-schema).

The previous release is the newest CHANGELOG.md entry with a commit; its tree
comes from this repository's history (``git archive``, once per session) and
runs with this project's virtualenv, its cwd and PYTHONPATH in that tree, so
``celery -A reaper`` and ``python -m reaper.cli`` load its package. On one
database and one broker: its own ``reaper migrate``, its worker, this release's
``reaper migrate`` under it, this release's worker beside it, tasks and chains
sent by each release's code to the other's worker, then the contract step.
Every worker logs in as a member of reaper_worker, as a deployment's does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import DBAPIError

from reaper.errors import sqlstate
from reaper.release import EXIT_SCHEMA, SCHEMA_KNOWN, SCHEMA_NEEDED, version
from tests.conftest import BIN, PG_URL, ROOT
from tests.support import factory as f
from tests.support import releases
from tests.support.figures import figure
from tests.support.kafka import create_topic, read_topic
from tests.support.processes import Worker, wait_until
from tests.support.roles import login

pytestmark = pytest.mark.process

# Every wait below: a cycle every second, the relay every second.
CLOSED_WITHIN = 30.0
CALL_TIMEOUT = 60.0
# This release's range as its lines name it (reaper/release.py).
RANGE = f"release {version()} runs on {SCHEMA_NEEDED} to {SCHEMA_KNOWN}"


def previous_head() -> str:
    """The schema the previous release's own ``reaper migrate`` leaves on a new
    database: the whole chain it knows (CHANGELOG.md, its migrations)."""
    return max(releases.previous().migrations)


@pytest.fixture(scope="session")
def previous_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's tree, extracted once per session."""
    previous = releases.previous()
    assert previous.commit is not None
    return releases.extract(previous.commit, tmp_path_factory.mktemp(f"release-{previous.version}"))


@contextmanager
def scratch_database() -> Iterator[tuple[str, Engine]]:
    """A database of its own (dropped at the end): its URL and the owner's engine."""
    name = f"reaper_deploy_{uuid.uuid4().hex[:8]}"
    url = f"{PG_URL}/{name}"
    admin = create_engine(f"{PG_URL}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    owner = create_engine(url)
    try:
        yield url, owner
    finally:
        owner.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def this_release(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``reaper ARGS`` of this release."""
    return subprocess.run(
        [str(BIN / "reaper"), *args],
        cwd=ROOT,
        env=_env(env, None),
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT,
    )


def previous_release(
    tree: Path, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with the previous release's package (``-m reaper.cli ...``)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=tree,
        env=_env(env, tree),
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT,
    )


def _env(env: dict[str, str], tree: Path | None) -> dict[str, str]:
    full = {**os.environ, **env}
    full.pop("PYTHONPATH", None)
    if tree is not None:
        full["PYTHONPATH"] = str(tree)
    return full


def revision(owner: Engine) -> str:
    with owner.connect() as conn:
        return str(conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one())


def seed(owner: Engine, count: int) -> list[str]:
    """Empty rooms idle for 10 s: past the 2 s grace of the workers below."""
    now = datetime.now(UTC)
    with owner.begin() as conn:
        return [
            f.conference(conn, as_of=now, idle=timedelta(seconds=10))["id"] for _ in range(count)
        ]


def closed_and_published(owner: Engine, rooms: list[str]) -> bool:
    """Every room ended and its event sent: its row (written in the transaction
    that ended the room) marked published by the previous release's relay, or
    deleted at its acknowledgement by this one's. The caller reads Kafka."""
    with owner.connect() as conn:
        done = conn.execute(
            text(
                "SELECT count(*) FROM messenger.conference_sessions s"
                " LEFT JOIN messenger.integration_outbox o"
                "   ON o.payload->'payload'->>'conferenceId' = s.id::text"
                " WHERE s.id = ANY(CAST(:ids AS uuid[])) AND s.status = 'Ended'"
                "   AND (o.id IS NULL OR o.published_at IS NOT NULL)"
            ),
            {"ids": rooms},
        ).scalar_one()
    return done == len(rooms)


ERROR_LINE = re.compile(r'"level":\s*"(?:ERROR|CRITICAL)"|\b(?:ERROR|CRITICAL)/|Traceback')


def logged(output: str, event: str) -> list[dict]:
    """The JSON log lines of ``event``."""
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == event]


def errors(output: str) -> list[str]:
    """Lines logged at ERROR or above (JSON or Celery's own), and tracebacks."""
    return [line for line in output.splitlines() if ERROR_LINE.search(line)]


# A cycle's head and its chain (reaper/tasks.py: reap_phase(phase, of_run=...) per
# phase, then reap(finish=...)), built and sent by the code of the release that
# runs this, while only the other release's worker consumes.
SEND_CHAIN = """
import json, time
from celery import chain
from reaper.phases import ORDER
from reaper.tasks import get_reaper, reap, reap_phase

for _ in range(50):  # a beat tick of the consuming worker may own the run for an instant
    cycle = get_reaper().start(None)
    if cycle.owns_run:
        break
    time.sleep(0.2)
assert cycle.owns_run, "the run stayed another cycle's"
links = [reap_phase.si(name, of_run=cycle.run_id) for name in ORDER]
result = chain(*links, reap.si(finish=cycle.run_id)).apply_async(expires=60)
print(json.dumps({"run_id": cycle.run_id, "task_id": result.id, "phases": list(ORDER)}))
"""


def _has(text_: str) -> Callable[[str], bool]:
    return lambda output: text_ in output


def run_outcome(owner: Engine, run_id: str) -> str | None:
    with owner.connect() as conn:
        return conn.execute(
            text("SELECT outcome FROM messenger.reaper_runs WHERE run_id = :r"), {"r": run_id}
        ).scalar_one_or_none()


def sent_by_one_executed_by_other(
    owner: Engine, consumer: Worker, sender: Path | None, env: dict[str, str]
) -> list[str]:
    """A chain and a plain ``reaper.reap``, sent by the release whose tree is
    ``sender`` (None: this one); ``consumer`` runs them. Their task ids."""
    command = [sys.executable, "-c", SEND_CHAIN]
    sent = subprocess.run(
        command,
        cwd=sender or ROOT,
        env=_env(env, sender),
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT,
    )
    assert sent.returncode == 0, sent.stderr
    chained = json.loads(sent.stdout.strip().splitlines()[-1])
    wait_until(
        lambda: run_outcome(owner, chained["run_id"]) == "completed",
        CLOSED_WITHIN,
        "the chain's run completed",
    )
    called = subprocess.run(
        [str(BIN / "celery"), "-A", "reaper", "call", "reaper.reap", "--expires", "60"],
        cwd=sender or ROOT,
        env=_env(env, sender),
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT,
    )
    assert called.returncode == 0, called.stderr
    task_ids = [chained["task_id"], called.stdout.strip()]
    for task_id in task_ids:
        succeeded = f"reaper.reap[{task_id}] succeeded"
        consumer.wait_for(
            _has(succeeded),
            CLOSED_WITHIN,
            f"reaper.reap[{task_id}] on the other release's worker",
        )
    # each phase of the chain ran there, with the run id it was given
    phases = re.findall(r'"event":\s*"phase\.completed"[^\n]*', consumer.output())
    assert sum(chained["run_id"] in line for line in phases) == len(chained["phases"]), phases[-6:]
    return task_ids


def test_the_previous_release_runs_beside_this_one_across_the_migration(
    previous_tree, kafka_broker, tmp_path
):
    previous = releases.previous()
    topic = f"deploy.conference-ended.{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker, topic)
    started = time.monotonic()
    figures: dict[str, float] = {}
    with scratch_database() as (url, owner), login(owner, url, "reaper_worker") as worker_url:
        common = {
            "REAPER_BROKER_KEY_PREFIX": f"reaper-deploy-{uuid.uuid4().hex[:8]}:",
            "REAPER_POLLING_INTERVAL": "1",
            "REAPER_EMPTY_ROOM_GRACE": "2",
            "REAPER_KAFKA_BOOTSTRAP_SERVERS": kafka_broker,
            "REAPER_CONFERENCE_ENDED_TOPIC": topic,
            "REAPER_KAFKA_TIMEOUT": "4",
            "REAPER_RELAY_INTERVAL": "1",
        }
        as_owner = {**common, "REAPER_DATABASE_URL": url}
        as_worker = {**common, "REAPER_DATABASE_URL": worker_url}
        old = Worker(
            tmp_path,
            {**as_worker, "PYTHONPATH": str(previous_tree)},
            name="previous",
            cwd=previous_tree,
        )
        new = Worker(tmp_path, as_worker, name="current")
        rooms: list[str] = []
        try:
            # the previous release's own migrate: its head
            done = previous_release(previous_tree, "-m", "reaper.cli", "migrate", env=as_owner)
            assert done.returncode == 0, done.stderr
            assert revision(owner) == previous_head()
            old.start()
            rooms += seed(owner, 5)
            wait_until(
                lambda: closed_and_published(owner, rooms),
                CLOSED_WITHIN,
                f"closed, {previous_head()}",
            )
            # this release's tasks, run by the previous release's worker alone
            sent_by_one_executed_by_other(owner, old, None, as_worker)

            # this release's migrate, under the previous release's worker
            mark = time.monotonic()
            migrated = this_release("migrate", env=as_owner)
            figures["migrate"] = time.monotonic() - mark
            assert migrated.returncode == 0, migrated.stderr
            assert migrated.stdout.startswith(f"schema at {SCHEMA_NEEDED}: "), migrated.stdout
            assert revision(owner) == SCHEMA_NEEDED
            rooms += seed(owner, 5)
            wait_until(
                lambda: closed_and_published(owner, rooms),
                CLOSED_WITHIN,
                f"closed, {SCHEMA_NEEDED}",
            )

            # this release's worker joins; both reap and relay
            new.start()
            new.wait_for(lambda out: '"schema.checked"' in out, 10, "schema.checked")
            for _ in range(4):
                rooms += seed(owner, 3)
                time.sleep(0.7)  # over several ticks of both beats
            wait_until(lambda: closed_and_published(owner, rooms), CLOSED_WITHIN, "closed, both")
            assert old.stop() == 0

            # the previous release's tasks, run by this release's worker alone
            sent_by_one_executed_by_other(owner, new, previous_tree, as_worker)

            # the contract step once the previous release is gone; this one goes on
            contracted = this_release("migrate", "--contract", env=as_owner)
            assert contracted.returncode == 0, contracted.stderr
            assert contracted.stdout.startswith(f"schema at {SCHEMA_KNOWN}: "), contracted.stdout
            rooms += seed(owner, 5)
            wait_until(
                lambda: closed_and_published(owner, rooms),
                CLOSED_WITHIN,
                f"closed, {SCHEMA_KNOWN}",
            )
            # the relay's retention, as the worker's login, after the contract
            time.sleep(2)
        finally:
            old.stop()
            new.stop()
        records = read_topic(kafka_broker, topic, expect=len(rooms))
        with owner.connect() as conn:
            outbox = f.outbox(conn)
            statuses = f.statuses(conn)
    old_out, new_out = old.output(), new.output()
    assert not errors(old_out), errors(old_out)
    assert not errors(new_out), errors(new_out)
    # every room closed once, its one event published once: on Kafka once, and its
    # row gone at its acknowledgement (both releases delete it then)
    assert all(statuses[room] == ("Ended", "EmptyTimeout") for room in rooms)
    assert outbox == [], "every row deleted at its acknowledgement"
    on_kafka = Counter(r.value["payload"]["conferenceId"] for r in records)
    assert on_kafka == Counter(set(rooms)), "every event on Kafka, once"
    # each worker ran its own release's package: its check at start names its range
    [old_check] = logged(old_out, "schema.checked")
    [new_check] = logged(new_out, "schema.checked")
    assert (old_check["revision"], old_check["knows"]) == (previous_head(), previous_head())
    assert (new_check["needs"], new_check["knows"]) == (SCHEMA_NEEDED, SCHEMA_KNOWN)
    # both releases reaped while both ran (their own log lines)
    assert '"conference.reaped"' in old_out and '"conference.reaped"' in new_out
    assert '"relay.published"' in old_out and '"relay.published"' in new_out
    figure(
        f"previous release {previous.version} ({previous.commit}) beside this"
        f" one: {len(rooms)} rooms closed once and on Kafka once, 0 ERROR lines in either"
        f" worker's log; this release's migrate under the running worker"
        f" {figures['migrate']:.1f} s; whole test {time.monotonic() - started:.1f} s"
    )


def test_this_release_refuses_the_previous_release_s_schema_in_one_line(previous_tree, tmp_path):
    """Rolled before `reaper migrate` ran: the CLI and the worker refuse, one line
    and exit 3, no traceback; as the owner and as the roles' logins (the
    previous release's schema has the record of 0010: they read the revision)."""
    with scratch_database() as (url, owner):
        done = previous_release(
            previous_tree, "-m", "reaper.cli", "migrate", env={"REAPER_DATABASE_URL": url}
        )
        assert done.returncode == 0, done.stderr
        older = (
            f"schema {previous_head()} is older than this release needs ({RANGE}):"
            " run reaper migrate"
        )
        for command in (["status"], ["reap", "--once"], ["relay", "--once"], ["plan"]):
            refused = this_release(*command, env={"REAPER_DATABASE_URL": url})
            assert (refused.returncode, refused.stderr, refused.stdout) == (
                EXIT_SCHEMA,
                f"reaper: {older}\n",
                "",
            ), command
        with (
            login(owner, url, "reaper_operator") as operator_url,
            login(owner, url, "reaper_worker") as worker_url,
        ):
            refused = this_release("status", env={"REAPER_DATABASE_URL": operator_url})
            assert (refused.returncode, refused.stderr) == (EXIT_SCHEMA, f"reaper: {older}\n")
            worker = Worker(tmp_path, {"REAPER_DATABASE_URL": worker_url}, name="too-early")
            try:
                with pytest.raises(RuntimeError, match=r"worker exited \(3\)"):
                    worker.start(ready_timeout=30)
            finally:
                worker.stop()
            # celery beat on its own, as the owner: the same refusal, the revision named
            beat = subprocess.run(
                [str(BIN / "celery"), "-A", "reaper", "beat", "-s", str(tmp_path / "beat")],
                cwd=ROOT,
                env=_env({"REAPER_DATABASE_URL": url}, None),
                capture_output=True,
                text=True,
                timeout=CALL_TIMEOUT,
            )
        for process, out, message in (
            ("worker", worker.output(), older),
            ("beat", beat.stdout + beat.stderr, older),
        ):
            ours = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            assert [(line["event"], line["level"]) for line in ours] == [
                ("schema.refused", "ERROR")
            ], out
            assert (ours[0]["message"], ours[0]["process"]) == (message, process)
            assert "Traceback" not in out and " ready." not in out
        assert beat.returncode == EXIT_SCHEMA
        with owner.connect() as conn:  # nothing was read into or changed
            assert conn.execute(text("SELECT count(*) FROM messenger.reaper_runs")).scalar() == 0


def test_an_earlier_release_s_contract_is_applied_by_this_release_s_migrate():
    """Release 0.1.0's retention deletes outbox rows itself, as reaper_worker; 0.3.0's
    expand step (0010) kept that right and its contract migration 0011 takes it.
    From 0010, this release's `reaper migrate --contract` refuses to run before its
    expand step, and `reaper migrate` applies 0011 with its own expand migrations
    (0.3.0's workers, the last that needed the right, are gone by then)."""
    delete = (
        "DELETE FROM messenger.integration_outbox WHERE published_at < now() - interval '7 days'"
    )
    with scratch_database() as (url, owner):
        env = {"REAPER_DATABASE_URL": url}
        from reaper.db import migrate

        migrate(url, "0010")  # where release 0.3.0's `reaper migrate` left it
        with login(owner, url, "reaper_worker") as worker_url:
            worker = create_engine(worker_url)
            try:
                with worker.begin() as conn:
                    conn.exec_driver_sql(delete)  # 0.1.0's retention: allowed
                early = this_release("migrate", "--contract", env=env)
                assert early.returncode == EXIT_SCHEMA and revision(owner) == "0010", early.stderr
                assert f"run reaper migrate, roll every worker to {version()}" in early.stderr
                expanded = this_release("migrate", env=env)
                assert expanded.returncode == 0, expanded.stderr
                assert revision(owner) == SCHEMA_NEEDED
                with pytest.raises(DBAPIError) as refused, worker.begin() as conn:
                    conn.exec_driver_sql(delete)
                assert sqlstate(refused.value) == "42501"  # insufficient_privilege
                contracted = this_release("migrate", "--contract", env=env)
                assert contracted.returncode == 0, contracted.stderr
                assert revision(owner) == SCHEMA_KNOWN
            finally:
                worker.dispose()


def test_a_newer_schema_runs_when_compatible_and_is_refused_when_breaking():
    """A later release migrated the database (its rows in the record, as its
    migrations would write them): this release's commands go on beside a
    compatible one, with schema.newer, and refuse a breaking one in one line."""
    with scratch_database() as (url, owner):
        env = {"REAPER_DATABASE_URL": url}
        from reaper.db import migrate

        migrate(url)  # this release's head
        later = (
            "INSERT INTO messenger.reaper_migrations (revision, kind, release, compatible_from)"
            " VALUES (:r, :k, '9.9.9', :c)"
        )
        head = "UPDATE alembic_version SET version_num = :v"
        k1, k2 = (f"{int(SCHEMA_KNOWN) + n:04d}" for n in (1, 2))
        with owner.begin() as conn:
            conn.execute(text(later), {"r": k1, "k": "expand", "c": SCHEMA_KNOWN})
            conn.execute(text(head), {"v": k1})
        runs = this_release("status", "--json", env=env)
        assert runs.returncode == 0, runs.stderr
        assert json.loads(runs.stdout)["schema"]["state"] == "newer_compatible"
        [warning] = [json.loads(line) for line in runs.stderr.splitlines()]
        assert (warning["event"], warning["level"], warning["revision"]) == (
            "schema.newer",
            "WARNING",
            k1,
        )
        with owner.begin() as conn:
            conn.execute(text(later), {"r": k2, "k": "contract", "c": k1})
            conn.execute(text(head), {"v": k2})
        refused = this_release("status", env=env)
        assert (refused.returncode, refused.stdout) == (EXIT_SCHEMA, "")
        assert refused.stderr == (
            f"reaper: schema {k2} is newer than this release knows ({RANGE})"
            f" and {k2} breaks it: run a release that knows {k2}\n"
        )
        # and migrate leaves a later release's schema alone
        left = this_release("migrate", env=env)
        assert (left.returncode, left.stdout) == (0, f"schema at {k2}: nothing to apply\n")
