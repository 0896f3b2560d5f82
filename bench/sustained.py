"""The relay sustained: incident after incident through one outbox (issue 24).

    .venv/bin/python bench/run.py --sustained            # 9 incidents of 50,000 rooms
    .venv/bin/python bench/run.py --sustained --quick    # of 5,000 rooms
    .venv/bin/python bench/run.py --sustained --rooms N  # of N rooms
    .venv/bin/python bench/run.py --sustained --tiny --incidents 2 --held 1  # a smoke run

Its own database (``<--database>_sustained``: dropped, re-created, migrated)
holds the bench's eligible rooms (bench/seed.py). Each incident puts them back
and closes them with the reaper's own cycles (``Reaper.run_cycle``, in this
process, at the default batch size): each closing writes its outbox row in its
batch's statement, as in production. Then ``reaper relay --once`` sends the
backlog to a private Tansu broker and deletes each row at its acknowledgement
(``messenger.acknowledge_outbox``). The outbox is never truncated, vacuumed or
analyzed by the bench between incidents (only with ``--vacuum-between``, a
variant reported as such), so whatever the deletes leave behind stays for
the next incident, as it would on a cluster where nothing vacuums in time.

Six incidents one after another, then three more while another session of the
same database holds a ``REPEATABLE READ`` snapshot open (its horizon keeps every
deleted row version, and their index entries, alive). Per incident: the relay's
rate (events over the pass's own ``duration_ms``), its ratio to the first
incident's, the outbox's size (``pg_total_relation_size``) and its dead tuples
(``pg_stat_user_tables.n_dead_tup``), the WAL written while the relay ran and
the checkpoints started during the incident. Beside each relay pass, just before
and just after it, kafka-python alone sends the same incident's records
(``bench.kafka_alone``, in its own process, to a topic of its own): a pass is a
few seconds, and this machine's speed moves by a tenth or more from one to the
next (kafka-python alone ran at 16,452 and 22,043 events/s on the two sides of
one pass); the relay's rate over that baseline, against the first incident's,
says what the outbox's state costs apart from the machine's. The records are
those of one drain made before the first incident and kept aside
(``bench.outbox_written``); the outbox is truncated after it. The goals, each
printed PASS or FAIL (the relay's own rate against the first's is printed
beside them, INFO):

* the sixth incident's rate over its baseline >= 0.9x the first's;
* each held-snapshot incident's rate over its baseline >= 0.7x the first's;
* the outbox after six incidents <= 369 MiB: half of 739 MiB, the outbox of
  release 0.3.0's marking relay after six incidents of 50,000 rooms (a run
  with fewer rooms is held to it in proportion: its size times 50,000 / rooms).

Whether autovacuum runs on the cluster is printed too: where it is off (CI's
cluster), the deleted rows' versions stay until a VACUUM, and the size is what
the deletes cost with no vacuum at all.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg2

from bench import charts, drain, seed
from bench import relay as bench_kafka
from bench.broker import Tansu, create_topic
from bench.seed import connect, execute, one, one_row
from reaper.config import Settings

INCIDENTS = 6
POLICIES = 1000  # as bench/run.py's default
HELD_INCIDENTS = 3
SIXTH_FLOOR = 0.9
HELD_FLOOR = 0.7
# half of 0.3.0's outbox after six incidents of 50,000 rooms (739 MiB)
SIZE_LIMIT_MIB = 369.0
SIZE_ROOMS = 50_000

# The eligible rooms put back as seeded (bench/seed.py's copy in the bench schema);
# unlike seed.RESET_ELIGIBLE, the integration outbox is left as the last relay
# pass left it: the point of the run.
PUT_BACK = (
    seed.TAKE_OUT.format(outboxes="messenger.realtime_outbox") + seed.PUT_IN + seed.TRIGGERS_BACK
)

# every seeded table but the integration outbox
ROOM_TABLES = tuple(t for t in seed.TABLES if t != "messenger.integration_outbox")

OUTBOX_STATE = """
SELECT pg_total_relation_size('messenger.integration_outbox'),
       (SELECT n_dead_tup FROM pg_stat_user_tables
         WHERE relid = 'messenger.integration_outbox'::regclass),
       (SELECT count(*) FROM messenger.integration_outbox
         WHERE published_at IS NULL AND parked_at IS NULL)
"""

# Checkpoints started so far, by server version (17 moved them to pg_stat_checkpointer)
CHECKPOINTS = {
    True: "SELECT num_timed + num_requested FROM pg_stat_checkpointer",
    False: "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter",
}

# the rows still to send (the marking baseline's sent rows stay, marked)
PENDING = """
SELECT count(*) FROM messenger.integration_outbox WHERE published_at IS NULL AND parked_at IS NULL
"""


@dataclass
class Incident:
    number: int
    held_snapshot: bool
    rooms: int
    events: int
    drain_s: float
    relay_pass_s: float
    relay_per_s: float
    outbox_bytes: int
    dead_tuples: int
    rows_left: int
    # kafka-python alone on the same records, just before and just after the relay
    alone_before_per_s: float = 0.0
    alone_after_per_s: float = 0.0
    relay_wal_bytes: int = 0  # WAL written while the relay ran (its deletes' above all)
    checkpoints: int = 0  # checkpoints started from the incident's drain to its relay's end
    vacuumed_after: bool = False
    ratio: float = 0.0
    ratio_to_alone: float = 0.0

    @property
    def alone_per_s(self) -> float:
        """The client's limit while the relay ran: the mean of the two beside it."""
        return (self.alone_before_per_s + self.alone_after_per_s) / 2

    @property
    def to_alone(self) -> float:
        """The relay's rate against the client's limit measured beside it."""
        return self.relay_per_s / self.alone_per_s


@dataclass
class Goal:
    text: str
    value: str
    passed: bool

    def line(self) -> str:
        return f"GOAL {self.text}: {self.value} {'PASS' if self.passed else 'FAIL'}"


def keep_records(url: str, rooms: int, as_of: datetime, batch_size: int) -> int:
    """One incident's events kept aside for kafka-python alone (``bench.outbox_written``,
    what ``bench.kafka_alone`` sends): the rooms closed once before the first incident,
    their outbox rows copied, the outbox truncated, so the first incident meets an outbox
    as empty and unread as before."""
    put_back(url)
    counts, _ = drain.reaper_drain(url, as_of, batch_size, rooms)
    if sum(counts.values()) != rooms:
        raise RuntimeError(f"the baseline's drain closed {sum(counts.values())} of {rooms} rooms")
    conn = connect(url)
    with conn, conn.cursor() as cur:
        kept = bench_kafka.keep_written(cur)
        cur.execute("TRUNCATE messenger.integration_outbox RESTART IDENTITY")
    conn.close()
    return int(kept)


def wal_state(url: str) -> tuple[str, int]:
    """Where the WAL is, and how many checkpoints have started."""
    lsn, newer = one(
        url,
        "SELECT pg_current_wal_lsn()::text, current_setting('server_version_num')::int >= 170000",
    )
    return str(lsn), int(one(url, CHECKPOINTS[bool(newer)])[0])


def wal_since(url: str, lsn: str) -> int:
    return int(one(url, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (lsn,))[0])


def put_back(url: str) -> None:
    """The eligible rooms as seeded again; the room tables vacuumed and analyzed (never
    the outbox)."""
    execute(url, PUT_BACK)
    seed.vacuum(url, ROOM_TABLES)


def outbox_state(url: str) -> tuple[int, int, int]:
    """The outbox's size in bytes, its dead tuples and its pending rows. The relay's process
    has exited, so its statistics are flushed; a short wait lets them land."""
    time.sleep(0.5)
    # this session's own counts flushed, and the statistics read fresh, not cached
    size, dead, rows = one(
        url, f"SELECT pg_stat_force_next_flush(); SELECT pg_stat_clear_snapshot(); {OUTBOX_STATE}"
    )
    return int(size), int(dead or 0), int(rows)


def hold_snapshot(url: str) -> psycopg2.extensions.connection:
    """A second session with a REPEATABLE READ snapshot taken and kept: until it is
    closed, no row version deleted after it can be removed (a report or a backup
    in the same database would do this)."""
    conn = connect(url)
    conn.autocommit = True  # the BEGIN below is ours, not psycopg2's
    with conn.cursor() as cur:
        cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        cur.execute("SELECT 1")  # the snapshot is taken at the first statement
        pid = conn.get_backend_pid()
    # seen from another session: the holder's snapshot is what holds the horizon back
    check = connect(url)
    with check, check.cursor() as cur:
        cur.execute("SELECT backend_xmin IS NOT NULL FROM pg_stat_activity WHERE pid = %s", (pid,))
        (holds,) = one_row(cur)
    check.close()
    if not holds:
        conn.close()
        raise RuntimeError("the second session holds no snapshot")
    return conn


def one_incident(
    url: str,
    number: int,
    rooms: int,
    as_of: datetime,
    bootstrap: str,
    topic: str,
    held: bool,
    batch_size: int,
    alone_topic: str,
    marking: bool = False,
) -> Incident:
    put_back(url)
    _, checkpoints_before = wal_state(url)
    counts, drain_s = drain.reaper_drain(url, as_of, batch_size, rooms)
    closed = sum(counts.values())
    if closed != rooms:
        raise RuntimeError(f"incident {number}: {closed} of {rooms} rooms closed")
    (events,) = one(url, PENDING)
    command = [sys.executable, "-m", "bench.marking_relay"] if marking else None
    # The client's limit on each side of the relay's pass, on the same machine a few
    # seconds apart: what the machine's own speed does to an incident's rate is in
    # both, what the outbox's state does only in the relay's.
    before = bench_kafka.kafka_alone(url, bootstrap, alone_topic, int(events))
    lsn, _ = wal_state(url)
    ours = bench_kafka.relay_once(url, bootstrap, topic, int(events), command)
    relay_wal = wal_since(url, lsn)
    _, checkpoints_after = wal_state(url)
    after = bench_kafka.kafka_alone(url, bootstrap, alone_topic, int(events))
    size, dead, left = outbox_state(url)
    if left:
        raise RuntimeError(f"incident {number}: {left} outbox rows pending after the relay")
    return Incident(
        number=number,
        held_snapshot=held,
        rooms=closed,
        events=int(events),
        drain_s=drain_s,
        relay_pass_s=ours["pass_s"],
        relay_per_s=int(events) / ours["pass_s"],
        outbox_bytes=size,
        dead_tuples=dead,
        rows_left=left,
        alone_before_per_s=before,
        alone_after_per_s=after,
        relay_wal_bytes=relay_wal,
        checkpoints=checkpoints_after - checkpoints_before,
    )


def goals(incidents: list[Incident], rooms: int, normal: int = INCIDENTS) -> list[Goal]:
    """The rate goals on the relay's rate over kafka-python alone's beside it: one pass
    of a few seconds held to another moves by a tenth or more with the machine's own
    speed (so does kafka-python alone, with no database at all), which the baseline
    takes out. ``normal``: the incidents before the held ones (six, but in a smoke run)."""
    first = incidents[0].to_alone
    sixth = incidents[normal - 1]
    over = "'s relay rate over kafka-python alone's beside it"
    out = [
        Goal(
            f"incident {normal}{over} >= {SIXTH_FLOOR:g}x the first's",
            f"{sixth.to_alone / first:.2f}x",
            sixth.to_alone / first >= SIXTH_FLOOR,
        )
    ]
    for inc in incidents[normal:]:
        out.append(
            Goal(
                f"incident {inc.number} (held snapshot){over} >= {HELD_FLOOR:g}x the first's",
                f"{inc.to_alone / first:.2f}x",
                inc.to_alone / first >= HELD_FLOOR,
            )
        )
    mib = sixth.outbox_bytes / 2**20
    # The limit is 0.3.0's figure after six incidents of 50,000 rooms; a smaller run is
    # held to it in proportion (with nothing vacuumed, the table grows with its events).
    scale = SIZE_ROOMS / rooms * INCIDENTS / normal
    value = f"{mib:.1f} MiB" if scale == 1 else f"{mib:.1f} MiB, x{scale:g} = {mib * scale:.0f} MiB"
    out.append(
        Goal(
            f"outbox after {normal} incidents <= {SIZE_LIMIT_MIB:g} MiB"
            f" at {SIZE_ROOMS:,} rooms an incident (half of 0.3.0's 739 MiB)",
            value,
            mib * scale <= SIZE_LIMIT_MIB,
        )
    )
    return out


def report(
    incidents: list[Incident],
    found: list[Goal],
    rooms: int,
    autovacuum: str,
    vacuum: bool,
    normal: int = INCIDENTS,
) -> str:
    lines = [
        f"sustained relay: {len(incidents)} incidents of {rooms:,} rooms through one outbox"
        f" (cluster autovacuum: {autovacuum})",
    ]
    if vacuum:
        lines.append(
            "VARIANT --vacuum-between: a plain VACUUM of the outbox after each incident's"
            " figures (not the reaper's own behaviour)"
        )
    header = (
        "incident",
        "snapshot",
        "events",
        "relay events/s",
        "vs first",
        "alone events/s",
        "relay/alone",
        "vs first",
        "outbox",
        "dead tup",
        "relay WAL",
        "ckpts",
    )
    body = [
        (
            str(inc.number),
            "held" if inc.held_snapshot else "-",
            f"{inc.events:,}",
            f"{inc.relay_per_s:,.0f}",
            f"{inc.ratio:.2f}x",
            f"{inc.alone_before_per_s:,.0f}-{inc.alone_after_per_s:,.0f}",
            f"{inc.to_alone:.2f}x",
            f"{inc.ratio_to_alone:.2f}x",
            f"{inc.outbox_bytes / 2**20:.1f} MiB",
            f"{inc.dead_tuples:,}",
            f"{inc.relay_wal_bytes / 2**20:.1f} MiB",
            str(inc.checkpoints),
        )
        for inc in incidents
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines.append(" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    lines += [goal.line() for goal in found]
    lines += [
        f"INFO incident {inc.number}'s relay rate on its own, against the first's:"
        f" {inc.ratio:.2f}x (one pass against one, the machine's drift in it)"
        for inc in incidents[normal - 1 :]
    ]
    if autovacuum != "on" and not vacuum:
        lines.append(
            "note: autovacuum is off on this cluster: the deleted rows' versions stay until a"
            " VACUUM, so the outbox's size and dead tuples are what no vacuum at all leaves"
            " (0012's thresholds for the outbox apply where autovacuum is on)"
        )
    return "\n".join(lines)


def series(
    url: str,
    rooms: int,
    as_of: datetime,
    *,
    vacuum_between: bool,
    drop: bool,
    say: Any,
    marking: bool = False,
    normal: int = INCIDENTS,
    held_count: int = HELD_INCIDENTS,
) -> tuple[list[Incident], str]:
    """Nine incidents on a database of their own: the incidents, the cluster's autovacuum."""
    batch_size = Settings(database_url=url).batch_size  # the reaper's default
    seed.recreate(url)
    # healthy live rooms beside them, as bench/run.py seeds: the mass-closure guard
    # weighs the stale live rooms against every Active one
    seed.seed_live(url, max(rooms // 2, 100), as_of)
    seed.seed_eligible(url, rooms, as_of)
    # the bench's tenant policies: with them every seeded room is eligible at as_of
    # (bench/seed.py POLICIES), the stuck provisioning ones included
    seed.seed_policies(url, POLICIES)
    autovacuum = str(one(url, "SHOW autovacuum")[0])
    broker = Tansu().start()
    topic = f"bench.sustained.{uuid.uuid4().hex[:8]}"
    alone_topic = f"{topic}.alone"  # kafka-python alone's records beside the relay's
    incidents: list[Incident] = []
    holder: psycopg2.extensions.connection | None = None
    label = "marking baseline" if marking else "sustained"
    try:
        create_topic(broker.bootstrap, topic)
        create_topic(broker.bootstrap, alone_topic)
        kept = keep_records(url, rooms, as_of, batch_size)
        # one pass over the empty outbox first: the broker's topic, the database's
        # catalogs and the relay's statements are warm for the first incident, whose
        # rate every other incident is held to
        bench_kafka.relay_once(url, broker.bootstrap, topic, 0)
        # and kafka-python alone's topic, as that pass warms the relay's
        bench_kafka.kafka_alone(url, broker.bootstrap, alone_topic, min(kept, 1000))
        for number in range(1, normal + held_count + 1):
            held = number > normal
            if held and holder is None:
                holder = hold_snapshot(url)
            inc = one_incident(
                url,
                number,
                rooms,
                as_of,
                broker.bootstrap,
                topic,
                held,
                batch_size,
                alone_topic,
                marking,
            )
            if inc.events != kept:
                raise RuntimeError(f"incident {number}: {inc.events} events, {kept} kept")
            first = incidents[0] if incidents else inc
            inc.ratio = inc.relay_per_s / first.relay_per_s
            inc.ratio_to_alone = inc.to_alone / first.to_alone
            if vacuum_between:
                # after the figures: the next incident meets it vacuumed
                execute(url, "VACUUM messenger.integration_outbox", autocommit=True)
                inc.vacuumed_after = True
            incidents.append(inc)
            say(
                f"{label} incident {number}{' (held snapshot)' if held else ''}:"
                f" {inc.events:,} events, relay {inc.relay_per_s:,.0f}/s ({inc.ratio:.2f}x),"
                f" kafka-python alone {inc.alone_before_per_s:,.0f}/s before,"
                f" {inc.alone_after_per_s:,.0f}/s after ({inc.ratio_to_alone:.2f}x against it),"
                f" outbox {inc.outbox_bytes / 2**20:.1f} MiB, {inc.dead_tuples:,} dead tuples"
            )
    finally:
        if holder is not None:
            holder.close()
        broker.stop()
        if drop:
            seed.drop(url)
    return incidents, autovacuum


def run(
    url: str,
    rooms: int,
    as_of: datetime,
    workdir: Path,
    *,
    charts_dir: Path | None = None,
    json_path: Path | None = None,
    vacuum_between: bool = False,
    baseline_marking: bool = False,
    drop: bool = False,
    say: Any = print,
    normal: int = INCIDENTS,
    held: int = HELD_INCIDENTS,
) -> list[Goal]:
    """The whole sustained run; prints its table and goals, returns the goals. With
    ``baseline_marking`` the same incidents again on a second database
    (``<url>_marking``) with 0.3.0's marking relay, printed after, as a baseline.
    ``normal`` and ``held``: fewer incidents than six and three, for a smoke run
    (tests/test_bench_smoke.py); the figures are the default's."""
    drain.log_to(workdir / "reaper-sustained.log")
    incidents, autovacuum = series(
        url,
        rooms,
        as_of,
        vacuum_between=vacuum_between,
        drop=drop,
        say=say,
        normal=normal,
        held_count=held,
    )
    found = goals(incidents, rooms, normal)
    print(report(incidents, found, rooms, autovacuum, vacuum_between, normal))
    marked: list[Incident] = []
    if baseline_marking:
        marked, _ = series(
            f"{url}_marking",
            rooms,
            as_of,
            vacuum_between=vacuum_between,
            drop=drop,
            say=say,
            marking=True,
            normal=normal,
            held_count=held,
        )
        print(baseline_report(incidents, marked))
    if charts_dir is not None:
        charts_dir.mkdir(parents=True, exist_ok=True)
        path = charts.sustained_chart(
            charts_dir / "sustained.png",
            [inc.relay_per_s for inc in incidents],
            [inc.held_snapshot for inc in incidents],
            f"relay per incident, {rooms:,} rooms each, one outbox"
            + (" (VACUUM between)" if vacuum_between else ""),
            baseline=[inc.relay_per_s for inc in marked],
        )
        print(f"chart: {path}")
    if json_path is not None:
        json_path.write_text(
            json.dumps(
                {
                    "rooms": rooms,
                    "autovacuum": autovacuum,
                    "vacuum_between": vacuum_between,
                    "incidents": [asdict(inc) for inc in incidents],
                    "goals": [asdict(goal) for goal in found],
                    "marking_baseline": [asdict(inc) for inc in marked],
                },
                indent=2,
            )
        )
    return found


def baseline_report(deleting: list[Incident], marking: list[Incident]) -> str:
    """The deleting relay (this release) against 0.3.0's marking one, incident by incident."""
    lines = [
        "BASELINE: the same incidents with 0.3.0's marking relay (UPDATE published_at;"
        " bench/marking_relay.py), on a database of its own",
        "incident | delete events/s | mark events/s | delete/mark | delete outbox"
        " | mark outbox | delete/mark",
    ]
    for d, m in zip(deleting, marking, strict=True):
        lines.append(
            f"{d.number}{' held' if d.held_snapshot else ''} | {d.relay_per_s:,.0f}"
            f" | {m.relay_per_s:,.0f} | {d.relay_per_s / m.relay_per_s:.2f}x"
            f" | {d.outbox_bytes / 2**20:.1f} MiB | {m.outbox_bytes / 2**20:.1f} MiB"
            f" | {d.outbox_bytes / m.outbox_bytes:.2f}x"
        )
    return "\n".join(lines)
