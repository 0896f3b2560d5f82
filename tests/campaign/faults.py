"""The faults, all real, each injected as the suite's fault tests inject it and
undone by its ``heal`` (docs/campaign.md#what-it-injects).

``inject`` returns what it did (a line for the action log), or raises
:class:`Missed` when there was nothing to hit at that moment (no lock held);
``heal`` undoes it and must succeed even after a failed run: the runner calls
it in a ``finally`` for every fault injected.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, text

from tests.campaign.environment import World
from tests.support.processes import children

RUN_LOCK = "messenger.conference-room-reaper"
RELAY_LOCK = "messenger.conference-room-reaper.relay"
# How long a fault looks for its target (a lock holder, a pool child) before it misses.
FIND_S = 8.0
# how long a relay pass sends into dropped answers before it is killed: long
# enough for a batch to reach the broker (milliseconds), short of the Kafka
# timeout (3 s), after which the pass would give up on its own
RELAY_SENDS_S = 1.0

HOLDER = text(
    """
    SELECT l.pid, a.client_port FROM pg_locks l
    JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.classid::bigint = ((hashtextextended(:k, 0) >> 32) & 4294967295)
      AND l.objid::bigint = (hashtextextended(:k, 0) & 4294967295)
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    """
)


class Missed(Exception):
    """Nothing to hit: the fault did not land (counted, never a pass by default)."""


@dataclass
class Injected:
    """A fault in force: what ``heal`` needs to undo it."""

    kind: str
    target: str
    detail: str
    state: dict[str, Any] = field(default_factory=dict)


# -- finding the target ----------------------------------------------------------------


def worker_pid(world: World, name: str) -> int:
    proc = world.workers[name].proc
    if proc is None or proc.poll() is not None:
        raise Missed(f"worker {name} is not running")
    return proc.pid


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _opened(pid: int) -> list[str]:
    found = []
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                found.append(os.readlink(fd))
    return found


def beat_pid(world: World, name: str) -> int | None:
    """The embedded beat: the worker's child whose title says beat, or which
    holds the beat's schedule file open."""
    for pid in children(worker_pid(world, name)):
        if "beat" in _cmdline(pid).lower() or "beat" in _comm(pid).lower():
            return pid
        if any("beat-schedule" in path for path in _opened(pid)):
            return pid
    return None


def pool_pids(world: World, name: str) -> list[int]:
    beat = beat_pid(world, name)
    return [p for p in children(worker_pid(world, name)) if p != beat]


def _tcp_inode(port: int) -> str | None:
    """The socket inode of the local TCP endpoint 127.0.0.1:``port``."""
    want = f"0100007F:{port:04X}"
    for table in ("/proc/net/tcp",):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1] == want:
                return fields[9]
    return None


def pid_of_client(world: World, proxy: str, service_port: int) -> int | None:
    """The worker process whose connection reaches the service through the
    proxy as ``service_port`` (as pg_stat_activity's client_port shows it)."""
    link = next(
        (lk for lk in world.proxies[proxy].open_links() if lk.service_port == service_port),
        None,
    )
    if link is None:
        return None
    try:
        client_port = link.client.getpeername()[1]
    except OSError:
        return None
    inode = _tcp_inode(client_port)
    if inode is None:
        return None
    wanted = f"socket:[{inode}]"
    for worker in world.workers.values():
        if worker.proc is None:
            continue
        for pid in [worker.proc.pid, *children(worker.proc.pid)]:
            with contextlib.suppress(OSError):
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    with contextlib.suppress(OSError):
                        if os.readlink(fd) == wanted:
                            return pid
    return None


def lock_holder(world: World, key: str) -> tuple[int, int] | None:
    """(backend pid, worker pid) of the lock ``key``'s holder, when a worker holds it."""
    assert world.engine is not None
    with world.engine.connect() as conn:
        row = conn.execute(HOLDER, {"k": key}).first()
    if row is None or row.client_port is None:
        return None
    pid = pid_of_client(world, "postgres", row.client_port)
    return (row.pid, pid) if pid is not None else None


def wait_for(find: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + FIND_S
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            found = find()
            if found:
                return found
        time.sleep(0.01)  # a relay pass holds its lock for tens of milliseconds
    raise Missed(f"no {what} within {FIND_S:g}s")


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


# -- the kinds -------------------------------------------------------------------------


def inject(world: World, kind: str, target: str) -> Injected:
    return INJECT[kind](world, target)


def heal(world: World, fault: Injected) -> None:
    HEAL[fault.kind](world, fault)


def aim(world: World, moment: str) -> str:
    """Wait (within FIND_S) for the moment a fault hurts most: ``cycle``, a run
    open in messenger.reaper_runs (its chain is under way: a worker or the
    broker lost now may lose it); ``relay``, a relay pass holding its lock
    (its sends in flight). Then the fault goes in either way; the action log
    says whether it was aimed."""
    assert world.engine is not None
    sql = {
        "cycle": "SELECT EXISTS (SELECT FROM messenger.reaper_runs WHERE finished_at IS NULL)",
        "relay": "SELECT EXISTS (SELECT FROM pg_locks l WHERE l.locktype = 'advisory'"
        " AND l.granted AND l.objsubid = 1 AND l.objid::bigint ="
        f" (hashtextextended('{RELAY_LOCK}', 0) & 4294967295))",
    }[moment]

    def now() -> bool:
        assert world.engine is not None
        with world.engine.connect() as conn:
            return bool(conn.execute(text(sql)).scalar())

    try:
        wait_for(now, moment)
    except Missed:
        return f"not aimed (no {moment} under way)"
    return f"aimed at a {moment} under way"


def _kill_parent(world: World, target: str) -> Injected:
    pid = worker_pid(world, target)
    aimed = aim(world, "cycle")
    _signal(pid, signal.SIGKILL)
    return Injected("kill_parent", target, f"SIGKILL worker {target} parent {pid}, {aimed}")


def _kill_child(world: World, target: str) -> Injected:
    # a child that is working when there is one: the one holding the run lock
    held = lock_holder(world, RUN_LOCK)
    pool = wait_for(lambda: pool_pids(world, target), f"pool child of worker {target}")
    pid = held[1] if held is not None and held[1] in pool else pool[0]
    _signal(pid, signal.SIGKILL)
    return Injected("kill_child", target, f"SIGKILL pool child {pid} of worker {target}")


def _kill_beat(world: World, target: str) -> Injected:
    pid = wait_for(lambda: beat_pid(world, target), f"beat of worker {target}")
    _signal(pid, signal.SIGKILL)
    return Injected("kill_beat", target, f"SIGKILL embedded beat {pid} of worker {target}")


def _restart_worker(world: World, fault: Injected) -> None:
    """The heal of a killed or rolled worker: whatever is left of it ends, and it
    starts again (as its supervisor would)."""
    world.workers[fault.target].stop(signal.SIGKILL, timeout=10)
    world.start_worker(fault.target, wait_ready=False)


def _roll_worker(world: World, target: str) -> Injected:
    """A deploy's first half: SIGTERM, a warm shutdown (the tasks under way
    finish). Not waited for here: the schedule goes on meanwhile."""
    pid = worker_pid(world, target)
    aimed = aim(world, "cycle")
    _signal(pid, signal.SIGTERM)
    return Injected("roll_worker", target, f"SIGTERM worker {target} ({pid}), {aimed}")


def _rolled(world: World, fault: Injected) -> None:
    """The deploy's second half: once the old worker has exited (SIGKILL after
    30 s, as an orchestrator's grace period), the new one starts."""
    world.workers[fault.target].stop(signal.SIGTERM, timeout=30)
    world.start_worker(fault.target, wait_ready=False)


def _stop_holder(kind: str, key: str, what: str) -> Callable[[World, str], Injected]:
    def stop(world: World, target: str) -> Injected:
        backend, pid = wait_for(lambda: lock_holder(world, key), what)
        _signal(pid, signal.SIGSTOP)
        return Injected(kind, "", f"SIGSTOP {what} {pid} (backend {backend})", {"pid": pid})

    return stop


def _cont(world: World, fault: Injected) -> None:
    _signal(fault.state["pid"], signal.SIGCONT)


def _cut(service: str) -> Callable[[World, str], Injected]:
    def cut(world: World, target: str) -> Injected:
        aimed = aim(world, "relay" if service == "kafka" else "cycle")
        n = world.proxies[service].cut()
        return Injected(
            f"cut_{service}", "", f"iptables DROP on {n} open {service} connections, {aimed}"
        )

    return cut


def _uncut(world: World, fault: Injected) -> None:
    world.proxies[fault.kind.removeprefix("cut_")].heal()


def _drop_kafka_answers(world: World, target: str) -> Injected:
    aimed = aim(world, "relay")
    n = world.proxies["kafka"].drop_answers()
    return Injected(
        "drop_kafka_answers",
        "",
        f"iptables DROP of the broker's answers on {n} open connections, {aimed}",
    )


def _undrop_kafka_answers(world: World, fault: Injected) -> None:
    world.proxies["kafka"].heal()


def pending_relay(world: World) -> tuple[int, int] | None:
    """The relay lock's holder, while conference-ended events wait in the outbox."""
    assert world.engine is not None
    with world.engine.connect() as conn:
        pending = conn.execute(
            text("SELECT EXISTS (SELECT FROM messenger.integration_outbox)")
        ).scalar()
    return lock_holder(world, RELAY_LOCK) if pending else None


def _kill_relay(world: World, target: str) -> Injected:
    """A relay pass dies after the broker wrote its records and before their
    acknowledgements reached it (a node lost mid-pass): the broker's answers
    are dropped, the pass that holds the relay lock sends into that silence for
    RELAY_SENDS_S, and is killed. Its outbox rows were never deleted, so the
    next pass sends them again: the duplicate publish that consumers, idempotent
    per conference, must absorb (the relay's own producer cannot deduplicate a
    process it did not survive)."""
    n = world.proxies["kafka"].drop_answers()
    # a pass with rows to send: killed idle, it would leave nothing to send again
    try:
        backend, pid = wait_for(lambda: pending_relay(world), "relay pass with rows to send")
        aimed = "with rows to send"
    except Missed:
        try:
            backend, pid = wait_for(lambda: lock_holder(world, RELAY_LOCK), "relay pass")
        except Missed:  # no pass at all: the answers pass again, the fault missed
            world.proxies["kafka"].heal()
            raise
        aimed = "with no rows to send"
    time.sleep(RELAY_SENDS_S)
    _signal(pid, signal.SIGKILL)
    # a pass runs in a pool child, which the pool replaces; were it a worker
    # itself, the heal starts that worker again
    parent = [name for name, w in world.workers.items() if w.proc is not None and w.proc.pid == pid]
    return Injected(
        "kill_relay",
        parent[0] if parent else "",
        f"SIGKILL relay pass {pid} (backend {backend}) {aimed}, {RELAY_SENDS_S:g}s after "
        f"the broker's answers were dropped on {n} connections",
    )


def _relay_killed(world: World, fault: Injected) -> None:
    world.proxies["kafka"].heal()
    if fault.target:
        _restart_worker(world, fault)


def _restart_postgres(world: World, target: str) -> Injected:
    assert world.pg is not None
    world.pg.stop("immediate")  # a crash: no goodbye to any client
    return Injected("restart_postgres", "", "PostgreSQL stopped (immediate)")


def _start_postgres(world: World, fault: Injected) -> None:
    assert world.pg is not None
    with contextlib.suppress(Exception):  # already running: a heal twice
        world.pg.start()


def _restart_redis(world: World, target: str) -> Injected:
    assert world.redis is not None
    aimed = aim(world, "cycle")
    world.redis.stop()  # SIGKILL; no persistence: the queues are gone
    return Injected("restart_redis", "", f"Redis killed (its queues lost), {aimed}")


def _start_redis(world: World, fault: Injected) -> None:
    assert world.redis is not None
    if world.redis.proc is None:
        world.redis.start()


def _terminate_lock_session(world: World, target: str) -> Injected:
    assert world.engine is not None
    backend, pid = wait_for(lambda: lock_holder(world, RUN_LOCK), "run lock holder")
    with world.engine.connect() as conn:
        done = conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": backend}).scalar()
    return Injected(
        "terminate_lock_session", "", f"pg_terminate_backend({backend}) of worker pid {pid}: {done}"
    )


def _nothing(world: World, fault: Injected) -> None:
    pass


def _held(kind: str, statement: str, what: str) -> Callable[[World, str], Injected]:
    def hold(world: World, target: str) -> Injected:
        assert world.engine is not None
        conn: Connection = world.engine.connect()
        try:
            tx = conn.begin()
            if kind == "held_snapshot":  # the transaction's first statement
                conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
            conn.execute(text("SET LOCAL application_name = 'campaign-fault'"))
            n = len(conn.execute(text(statement)).all())
        except BaseException:
            conn.close()
            raise
        return Injected(kind, "", f"{what}: {n} rows", {"conn": conn, "tx": tx})

    return hold


def _release(world: World, fault: Injected) -> None:
    conn: Connection = fault.state["conn"]
    with contextlib.suppress(Exception):  # the server may have ended it already
        fault.state["tx"].rollback()
    with contextlib.suppress(Exception):
        conn.close()


def _recorder(mode: str) -> Callable[[World, str], Injected]:
    def spoil(world: World, target: str) -> Injected:
        assert world.recorder is not None
        world.recorder.mode = mode
        return Injected(f"recorder_{mode}", "", f"recorder answers: {mode}")

    return spoil


def _recorder_ok(world: World, fault: Injected) -> None:
    assert world.recorder is not None
    world.recorder.mode = "ok"


INJECT: dict[str, Callable[[World, str], Injected]] = {
    "kill_parent": _kill_parent,
    "kill_child": _kill_child,
    "kill_beat": _kill_beat,
    "roll_worker": _roll_worker,
    "stop_lock_holder": _stop_holder("stop_lock_holder", RUN_LOCK, "run lock holder"),
    "stop_relay": _stop_holder("stop_relay", RELAY_LOCK, "relay pass"),
    "cut_postgres": _cut("postgres"),
    "cut_redis": _cut("redis"),
    "cut_kafka": _cut("kafka"),
    "drop_kafka_answers": _drop_kafka_answers,
    "kill_relay": _kill_relay,
    "restart_postgres": _restart_postgres,
    "restart_redis": _restart_redis,
    "terminate_lock_session": _terminate_lock_session,
    "held_snapshot": _held(
        "held_snapshot",
        "SELECT id FROM messenger.conference_sessions WHERE status IN ('Active', 'Provisioning')",
        "a REPEATABLE READ snapshot held",
    ),
    "rows_held": _held(
        "rows_held",
        "SELECT id FROM messenger.conference_sessions WHERE status IN ('Active', 'Provisioning')"
        " ORDER BY last_activity_at LIMIT 5 FOR UPDATE",
        "rows held FOR UPDATE by a command",
    ),
    "recorder_refuse": _recorder("refuse"),
    "recorder_trickle": _recorder("trickle"),
}
HEAL: dict[str, Callable[[World, Injected], None]] = {
    "kill_parent": _restart_worker,
    "kill_child": _nothing,  # the pool replaces its child
    "kill_beat": _restart_worker,
    "roll_worker": _rolled,
    "stop_lock_holder": _cont,
    "stop_relay": _cont,
    "cut_postgres": _uncut,
    "cut_redis": _uncut,
    "cut_kafka": _uncut,
    "drop_kafka_answers": _undrop_kafka_answers,
    "kill_relay": _relay_killed,
    "restart_postgres": _start_postgres,
    "restart_redis": _start_redis,
    "terminate_lock_session": _nothing,
    "held_snapshot": _release,
    "rows_held": _release,
    "recorder_refuse": _recorder_ok,
    "recorder_trickle": _recorder_ok,
}
