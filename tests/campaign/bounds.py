"""The campaign's fault kinds and the recovery bound of each (docs/campaign.md).

Recovery is measured after every episode's last heal: from that heal until a
probe room written at that moment (eligible at once, with a running
recording) is closed, its event acknowledged by Kafka and its recorder stop
signal taken. The bound of an episode is the largest of its kinds' bounds.

The bounds follow from the campaign's configuration (ENV in environment.py:
polling interval 1 s, REAPER_RUN_LEASE 3 s, REAPER_LOCK_TTL 8 s, database and
broker TCP bounds 4 s, Kafka timeout 3 s, relay back-off at most 2 s) plus
what the fault itself leaves to redo:
"""

from __future__ import annotations

# kind -> seconds from the heal to the probe's room closed, published, stopped
RECOVERY_BOUNDS: dict[str, float] = {
    # a worker restarted by the heal needs its start (about 5 s on a busy
    # machine), then a tick; a run it owned is taken over one lease later
    "kill_parent": 20.0,
    "kill_beat": 20.0,
    "roll_worker": 20.0,
    # the pool replaces the child at once; the run it held is taken over one
    # lease after its lock session ended
    "kill_child": 12.0,
    # woken, the owner finds its lock gone and stops; meanwhile the other
    # replica took over one lease after the freeze
    "stop_lock_holder": 12.0,
    "stop_relay": 12.0,
    # connections cut silently: each side gives up within the TCP bound (4 s)
    # and connects anew; a run whose lock session died is taken over
    "cut_postgres": 15.0,
    "cut_redis": 15.0,
    "cut_kafka": 15.0,
    # the broker's answers dropped (a one-way partition): the records land,
    # the relay never hears so, and sends them again once the answers pass
    "drop_kafka_answers": 15.0,
    # a relay pass killed while its acknowledgements were dropped: its lock
    # session dies with it, the answers pass again, the next pass (a tick of
    # beat, or a cycle's request) sends its rows again
    "kill_relay": 15.0,
    # a crash of the server: every session gone, the pools reconnect
    "restart_postgres": 15.0,
    "restart_redis": 15.0,
    # the lock's session ended by the server: the run is taken over
    "terminate_lock_session": 12.0,
    # a long transaction or held rows: nothing to redo once it ends
    "held_snapshot": 10.0,
    "rows_held": 10.0,
    # the recorder back: the signals due are retried within their back-off
    "recorder_refuse": 15.0,
    "recorder_trickle": 15.0,
}

# The kinds drawn by default: every kind with a bound above.
KINDS: tuple[str, ...] = tuple(RECOVERY_BOUNDS)

# Kinds that start last in their episode, by rank (the rest: 0). A fault that
# takes a whole process down makes the episode's others impossible to inject
# after it, so they go in first and it goes down under them:
# - a worker killed or rolled (1): its pool children and its beat are gone
#   until the heal starts it again (seen: kill_beat of worker a after
#   kill_parent of a, "no beat of worker a");
# - PostgreSQL restarted (2, the very last): the campaign finds every other
#   fault's target (the lock holder, a run under way) and holds its rows and
#   snapshots through it (seen in the first hour: rows_held, kill_child and
#   terminate_lock_session after restart_postgres in their episode failed to
#   go in, and one seed's verdict was unknown).
LAST_IN_EPISODE: dict[str, int] = {"kill_parent": 1, "roll_worker": 1, "restart_postgres": 2}

# Kinds aimed at one of the two workers (the plan names which).
WORKER_KINDS = frozenset({"kill_parent", "kill_child", "kill_beat", "roll_worker"})

# The recovery paths a campaign must have seen at least once, or its verdict
# is "unknown" (invariants.py says how each is recognized).
RECOVERY_PATHS = ("takeover", "relay_retry", "duplicate_publish", "rescued_chain")
