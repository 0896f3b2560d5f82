"""The campaign's workload: rooms written throughout the run with seeded
timings, as the messenger's commands would leave them (docs/campaign.md).

Kinds of rooms (``ROOM_KINDS``, in the order of ``Workload.mix``):

- ``empty``: active, nobody in it; closes as EmptyTimeout after the grace.
  Every other one has a running recording, whose stop signal is due.
- ``provisioning``: never started; fails (Error) after the provision timeout.
- ``stale``: active with a participant, its last activity close to the stale
  timeout already; closes as Timeout.
- ``live``: active with a participant whose activity the workload keeps
  fresh: it must never close.
- ``racing_join``: empty, and a participant joins about when its grace runs
  out; if the join commits the room must never close (a join commits only on
  a room still active, as the messenger's command does).
- ``command_end``: empty, ended by the messenger's own command (Normal) a
  moment before or after its grace runs out; the reaper must leave it alone.

Every statement uses the database's clock. A failed statement (a fault on
the server) is retried a little later: the workload is the world, not the
subject, and goes on through faults.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from tests.campaign.environment import GRACE_S, STALE_S
from tests.campaign.plan import Workload

ROOM_KINDS = ("empty", "provisioning", "stale", "live", "racing_join", "command_end")
# How often a live room shows activity (far below the stale timeout).
HEARTBEAT_S = 5.0
RETRY_S = 0.5

# A transaction's work; what it returns runs once the transaction committed.
Action = Callable[[Connection], Callable[[], None] | None]

INSERT_ROOM = text(
    """
    INSERT INTO messenger.conference_sessions
      (id, chat_id, deal_id, tenant_id, media_type, status, started_by_user_id,
       created_at, started_at, last_activity_at, updated_at,
       active_participant_count, peak_participant_count)
    SELECT gen_random_uuid(), gen_random_uuid(), CAST(:deal AS uuid), gen_random_uuid(),
           'Video', :status, gen_random_uuid(), t,
           CASE WHEN :status = 'Active' THEN t END,
           t - make_interval(secs => :idle_s), t, :count, greatest(:count, 1)
    FROM (SELECT clock_timestamp() AS t) now
    RETURNING id::text
    """
)
JOIN = text(
    """
    WITH joined AS (
        UPDATE messenger.conference_sessions
        SET active_participant_count = active_participant_count + 1,
            peak_participant_count = greatest(peak_participant_count,
                                              active_participant_count + 1),
            last_activity_at = clock_timestamp(), updated_at = clock_timestamp()
        WHERE id = CAST(:id AS uuid) AND status = 'Active'
        RETURNING id
    )
    INSERT INTO messenger.conference_participants (conference_id, user_id, joined_at)
    SELECT id, gen_random_uuid(), clock_timestamp() FROM joined
    RETURNING conference_id
    """
)
HEARTBEAT = text(
    """
    UPDATE messenger.conference_sessions
    SET last_activity_at = clock_timestamp(), updated_at = clock_timestamp()
    WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'Active'
    """
)
COMMAND_END = text(
    """
    UPDATE messenger.conference_sessions
    SET status = 'Ended', end_reason = 'Normal', ended_at = clock_timestamp(),
        updated_at = clock_timestamp(), active_participant_count = 0,
        duration_seconds = floor(extract(epoch FROM clock_timestamp() - started_at))::int
    WHERE id = CAST(:id AS uuid) AND status = 'Active'
    RETURNING id
    """
)
RECORDING = text(
    """
    INSERT INTO messenger.call_recordings (id, conference_id, status, created_at, updated_at)
    VALUES (gen_random_uuid(), CAST(:id AS uuid), 'Recording', clock_timestamp(),
            clock_timestamp())
    """
)
PARTICIPANT = text(
    """
    INSERT INTO messenger.conference_participants (conference_id, user_id, joined_at)
    VALUES (CAST(:id AS uuid), gen_random_uuid(), clock_timestamp())
    """
)


@dataclass
class Rooms:
    """What the workload wrote: each room's kind, and what its commands did."""

    kind: dict[str, str] = field(default_factory=dict)
    recorded: set[str] = field(default_factory=set)
    joined: set[str] = field(default_factory=set)  # a join committed while active
    join_refused: set[str] = field(default_factory=set)  # the room was closed first
    ended_by_command: set[str] = field(default_factory=set)
    command_refused: set[str] = field(default_factory=set)
    errors: int = 0

    def of(self, kind: str) -> list[str]:
        return [room for room, k in self.kind.items() if k == kind]


class WorkloadThread(threading.Thread):
    """Writes rooms until ``stop_writing`` is set; keeps live rooms alive until
    ``stop`` is set. A statement that fails is retried RETRY_S later."""

    def __init__(self, engine: Engine, workload: Workload, deals: int = 40) -> None:
        super().__init__(name="campaign-workload", daemon=True)
        self.engine = engine
        self.rng = random.Random(workload.seed)
        self.workload = workload
        # a few deals shared by many rooms: the per-deal order of events is tested
        self.deals = [f"00000000-0000-4000-8000-{i:012d}" for i in range(deals)]
        self.rooms = Rooms()
        self.stop_writing = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._due: list[tuple[float, int, Action]] = []
        self._n = 0

    def later(self, delay: float, action: Action) -> None:
        self._n += 1
        heapq.heappush(self._due, (time.monotonic() + delay, self._n, action))

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the runner reports it
            self.error = exc

    def _loop(self) -> None:
        next_room = time.monotonic()
        self.later(HEARTBEAT_S, self._heartbeat)
        while not self.stop.is_set():
            now = time.monotonic()
            if not self.stop_writing.is_set() and now >= next_room:
                self._attempt(self._new_room)
                next_room = now + self.rng.expovariate(1 / self.workload.gap_s)
            while self._due and self._due[0][0] <= time.monotonic():
                _, _, action = heapq.heappop(self._due)
                self._attempt(action)
            time.sleep(0.02)

    def _attempt(self, action: Action) -> None:
        """One transaction; what it did is noted only once it committed."""
        try:
            with self.engine.begin() as conn:
                committed = action(conn)
        except DBAPIError:
            self.rooms.errors += 1
            if action != self._new_room:
                self.later(RETRY_S, action)
            return
        if committed is not None:
            committed()

    # -- what it does ----------------------------------------------------------------

    def _new_room(self, conn: Connection) -> Callable[[], None]:
        kind = self.rng.choices(ROOM_KINDS, weights=self.workload.mix)[0]
        deal = self.rng.choice(self.deals)
        status, idle, count = "Active", 0.0, 0
        if kind == "provisioning":
            status = "Provisioning"
        elif kind == "stale":
            idle, count = STALE_S - self.rng.uniform(1, 5), 1
        elif kind == "live":
            count = 1
        room = conn.execute(
            INSERT_ROOM, {"deal": deal, "status": status, "idle_s": idle, "count": count}
        ).scalar_one()
        if count:
            conn.execute(PARTICIPANT, {"id": room})
        recorded = kind == "empty" and self.rng.random() < 0.5
        if recorded:
            conn.execute(RECORDING, {"id": room})
        delay = GRACE_S + self.rng.uniform(-0.7, 0.7)
        if kind == "command_end":
            delay = GRACE_S + self.rng.uniform(-1.5, 1.0)

        def committed() -> None:
            self.rooms.kind[room] = kind
            if recorded:
                self.rooms.recorded.add(room)
            if kind == "racing_join":
                self.later(delay, self._join(room))
            elif kind == "command_end":
                self.later(delay, self._end(room))

        return committed

    def _join(self, room: str) -> Action:
        def join(conn: Connection) -> Callable[[], None]:
            done = conn.execute(JOIN, {"id": room}).first() is not None
            return lambda: (self.rooms.joined if done else self.rooms.join_refused).add(room)

        return join

    def _end(self, room: str) -> Action:
        def end(conn: Connection) -> Callable[[], None]:
            done = conn.execute(COMMAND_END, {"id": room}).first() is not None
            return lambda: (
                self.rooms.ended_by_command if done else self.rooms.command_refused
            ).add(room)

        return end

    def _heartbeat(self, conn: Connection) -> Callable[[], None]:
        alive = self.rooms.of("live") + sorted(self.rooms.joined)
        conn.execute(HEARTBEAT, {"ids": alive})
        return lambda: self.later(HEARTBEAT_S, self._heartbeat)
