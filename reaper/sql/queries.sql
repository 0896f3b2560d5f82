-- Named queries of the reaper. Each block starts with a "-- name: <name>" line;
-- reaper/queries.py loads them once and exposes one method per query.
-- A "-- fragment: <name>" block is SQL written once, which "-- include: <name>"
-- stands for (reaper/queries.py Source says how includes, arguments and the
-- phases' statements are written).
--
-- The phases are data (reaper/phases.py): each writes here one fragment,
-- <phase>_selects, its predicate (alias s: the room). Every statement about
-- phases is composed from it and from the phase's values ({phase}, {since}: the
-- column its lateness counts from, {status}, {end_reason}): the claims, the
-- batch candidates and the mass-closure count ("-- for each phase": one
-- statement per phase, holding that phase's predicate and no other, so the
-- server parses and plans only what runs), the census and reaper plan ("--
-- include each phase": one statement over the phases, in their order, each
-- room counted in the first phase that selects it: "-- include each earlier
-- phase" leaves out the rooms of the phases before).
--
-- The phase statements are set-based: one round trip claims a batch with
-- FOR UPDATE SKIP LOCKED, applies the guarded transition, closes the roster,
-- writes the outbox rows and reports back. Data-modifying CTEs all see the
-- statement's snapshot, so payloads are built from the rows as they were
-- before the roster update (an open roster row is reported with leftAt = as_of).
--
-- Result rows of a phase statement, in one shape:
--   kind            'reaped' | 'poison' | 'locked' | 'held' (claimed, but a
--                   command holds one of its open roster rows: left for a later
--                   cycle) | 'stop' | 'fenced' (the run is no longer the
--                   batch's to change: nothing changed)
--   conference_id, chat_id, deal_id, duration_seconds
--   detail          poison: why; stop: the recording id; otherwise null
--   tenant_id, lateness_seconds   reaped (tenant also poison); otherwise null
--
-- Windows per tenant (docs/design.md#windows-per-tenant): a conference's window
-- for a phase is its tenant's row for that phase in
-- messenger.reaper_tenant_windows when there is one, else the default
-- (:<phase>_cutoff = :as_of - the default window, phases.bounds). A phase's
-- rooms are written in two forms: phase_rooms for the claims, the batch
-- candidates and reaper plan, and a count's form (phase_counted: the census
-- and the mass-closure count). Each has two parts:
--   the index range, to the WIDEST cutoff (:<phase>_range): :as_of minus the
--     shortest of the default window and every tenant's (tenant_window_bounds,
--     read once at the start of each phase, cycle.Reaper._drain;
--     phases.Phase.range_cutoff).
--     A constant, so the planner estimates the range from the statistics.
--     (Computed in the statement, as an InitPlan, the bound is unknown when
--     planning: with no policy at all the claim of a 1000-row batch becomes a
--     bitmap scan of every candidate and a sort.)
--   the row's own cutoff (phase_cutoff): coalesce(:as_of - (SELECT
--     w.window_length ... WHERE w.tenant_id = s.tenant_id AND w.phase =
--     '{phase}'), :<phase>_cutoff), a primary-key probe per row of the range,
--     which keeps the claim in index order. (The counts join the windows
--     instead: see eligible_census.)
-- A room is eligible when it passes both; the range alone only bounds the scan.
-- A window made longer applies to every statement that starts after the change;
-- one made shorter during a phase, from the next phase (the range is read then).

-- Advisory locks (docs/design.md#the-single-runner-lock), all held until the end
-- of a transaction. Each lock's key is a fragment, written once here; taking a
-- lock, waiting for it, and asking pg_locks whether a backend holds it are each
-- one fragment that takes the key. The run lock, the relay's and the stop
-- pass's differ in their keys only.

-- fragment: run_lock
-- The single-runner lock (its key is fixed by the interface).
hashtextextended('messenger.conference-room-reaper', 0)

-- fragment: relay_lock
-- One relay pass at a time (try_relay_lock).
hashtextextended('messenger.conference-room-reaper.relay', 0)

-- fragment: relay_marks
-- The gate of a relay pass's marks (relay_marks_fence).
hashtextextended('messenger.conference-room-reaper.relay.marks', 0)

-- fragment: stop_lock
-- One stop-signal pass at a time (try_stop_lock).
hashtextextended('messenger.conference-room-reaper.recorder', 0)

-- fragment: stop_marks
-- The gate of a stop pass's marks (stop_marks_fence).
hashtextextended('messenger.conference-room-reaper.recorder.marks', 0)

-- fragment: try_lock(key)
-- The lock, taken without waiting: this session's backend pid when taken (what
-- the statements of the phase or pass that holds it are fenced on), else NULL.
SELECT CASE WHEN pg_try_advisory_xact_lock({key}) THEN pg_backend_pid() END AS holder_pid;

-- fragment: wait_lock(key)
-- The lock, waited for within the transaction's lock_timeout.
SELECT pg_advisory_xact_lock({key});

-- fragment: lock_row(key)
-- The row l of pg_locks is the lock, granted, in this database (a bigint key is
-- split into classid, its high 32 bits, and objid, its low 32; objsubid 1).
l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
AND l.classid::bigint = (({key} >> 32) & 4294967295)
AND l.objid::bigint = ({key} & 4294967295)

-- fragment: lock_held(key)
-- The fence of a phase's or a pass's statements: the lock is still held by the
-- backend :holder_pid (their lock session; else the server or the network ended
-- that session, and the lock is free or another's), as pg_locks sees it.
EXISTS (
    SELECT FROM pg_locks l
    WHERE l.pid = :holder_pid AND
        -- include: lock_row(key)
)

-- fragment: marks_fence(lock, gate)
-- The fence of a pass's marks (reaper/lease.py), the first statement of their
-- transaction: true while the pass's lock session (:holder_pid) still holds the
-- lock. It first takes the gate of the marks, shared, until the transaction
-- ends; a pass that takes the lock over waits for every gate held (wait_lock of
-- the gate) before it begins. So marks that passed the fence commit before a
-- successor begins, and marks after it find the lock gone. The gate is tried,
-- not waited for: only a successor takes it exclusively, and then this pass has
-- lost the lock anyway. The check is correlated with the gate's row, so it is
-- evaluated after the gate is taken.
WITH gate AS MATERIALIZED (
    SELECT pg_try_advisory_xact_lock_shared({gate}) AS open
)
SELECT g.open AND EXISTS (
    SELECT FROM pg_locks l
    WHERE g.open AND l.pid = :holder_pid AND
        -- include: lock_row(lock)
) AS held
FROM gate g;

-- name: try_run_lock
-- The single-runner lock.
-- include: try_lock(run_lock)

-- name: wait_run_lock
-- The same lock for the phase of a cycle that owns the run: another session
-- holds it only for an instant (a tick looking whether the run is free), so
-- wait for it.
-- include: wait_lock(run_lock)

-- name: bound
-- A transaction's time budget (budgets.py), for this transaction only: a
-- session-level setting would outlive it and, behind a pooler in transaction
-- mode, land on another client. A stuck holder is ended by the server, which
-- frees its locks; so is one whose client stopped acknowledging (tcp_user_timeout
-- while data is in flight, keepalives while the backend waits on the client).
SELECT set_config('idle_in_transaction_session_timeout', :idle_ms, true),
       set_config('statement_timeout', :statement_ms, true),
       set_config('lock_timeout', :statement_ms, true),
       set_config('tcp_user_timeout', :silence_ms, true),
       set_config('tcp_keepalives_idle', :keepalive_idle_s, true),
       set_config('tcp_keepalives_interval', :keepalive_interval_s, true),
       set_config('tcp_keepalives_count', :keepalive_count, true);

-- name: database_clock
-- The reference clock of every comparison (docs/design.md#time).
SELECT clock_timestamp() AS now;

-- name: open_run
-- The run's current owner, if any (at most one row is open: ux_reaper_runs_one_open),
-- locked for the caller's transaction.
SELECT run_id, lease_expires_at, lease_expires_at > clock_timestamp() AS live
FROM messenger.reaper_runs
WHERE finished_at IS NULL
FOR UPDATE;

-- name: close_run
-- The end of a run: by its own cycle (completed, or failed when a phase
-- failed), or by a cycle that takes it over (taken_over).
UPDATE messenger.reaper_runs
SET finished_at = clock_timestamp(),
    outcome = coalesce(CAST(:outcome AS text),
                       CASE WHEN errors > 0 THEN 'failed' ELSE 'completed' END)
WHERE run_id = :run_id AND finished_at IS NULL
RETURNING run_id, as_of, started_at, counts, blocked, paused, errors, outcome,
          finished_at, finished_at - started_at AS took;

-- name: insert_run
INSERT INTO messenger.reaper_runs
    (run_id, as_of, started_at, deadline, lease_expires_at, owner)
VALUES (:run_id, :as_of, :started_at,
        CAST(:started_at AS timestamptz) + make_interval(secs => :max_run_s),
        clock_timestamp() + make_interval(secs => :lease_s), :owner)
ON CONFLICT (run_id) DO NOTHING
RETURNING run_id;

-- name: run_for_phase
-- A phase of the cycle that owns the run, under the run lock: its state, and
-- the backend that holds the lock for it (the fence of its batches). The lease
-- needs no renewal here: while the phase holds the lock no cycle can take the
-- run; its release renews it.
UPDATE messenger.reaper_runs
SET phase = :phase
WHERE run_id = :run_id AND finished_at IS NULL
RETURNING run_id, as_of, deadline, counts, excluded, blocked, paused, errors,
          clock_timestamp() AS now, pg_backend_pid() AS holder_pid;

-- name: run_heartbeat
-- The phase's lock session speaks (runs.Heartbeat), so the server's idle bound
-- of REAPER_RUN_LEASE ends only a silent owner's session.
SELECT 1;

-- name: run_state
SELECT run_id, as_of, started_at, counts, blocked, paused, errors, outcome, finished_at,
       coalesce(finished_at, clock_timestamp()) - started_at AS took
FROM messenger.reaper_runs
WHERE run_id = :run_id;

-- name: save_run
-- What a phase adds to the cycle's totals, as it releases the lock: the lease
-- runs from now again, so the cycle's next phase has a lease to reach it.
UPDATE messenger.reaper_runs
SET counts = CAST(:counts AS jsonb),
    excluded = CAST(:excluded AS uuid[]),
    blocked = CAST(:blocked AS text[]),
    paused = CAST(:paused AS text[]),
    errors = :errors,
    lease_expires_at = clock_timestamp() + make_interval(secs => :lease_s)
WHERE run_id = :run_id AND finished_at IS NULL;

-- name: save_run_totals
-- The same totals when the phase's lock session was gone before its release:
-- what its batches committed is counted even when the run was taken over
-- meanwhile; the lease is not renewed (nothing proves the owner alive).
UPDATE messenger.reaper_runs
SET counts = CAST(:counts AS jsonb),
    excluded = CAST(:excluded AS uuid[]),
    blocked = CAST(:blocked AS text[]),
    paused = CAST(:paused AS text[]),
    errors = :errors
WHERE run_id = :run_id;

-- name: record_unknown_phase
-- A phase the run's chain named that this worker does not know (a newer
-- release's, in a rolling deploy): the worker went on without it. Once per
-- phase in the run's row.
UPDATE messenger.reaper_runs
SET unknown_phases = array_append(unknown_phases, CAST(:phase AS text))
WHERE run_id = :run_id AND NOT (CAST(:phase AS text) = ANY (unknown_phases));

-- name: count_run_error
UPDATE messenger.reaper_runs SET errors = errors + 1
WHERE run_id = :run_id AND finished_at IS NULL;

-- name: delete_old_runs
DELETE FROM messenger.reaper_runs
WHERE finished_at < clock_timestamp() - make_interval(secs => :keep_s);

-- name: last_runs
-- reaper status: the open run and the last finished one.
SELECT run_id, as_of, started_at, phase, lease_expires_at, owner, finished_at, outcome, counts,
       errors
FROM messenger.reaper_runs
WHERE finished_at IS NULL
   OR run_id = (SELECT run_id FROM messenger.reaper_runs
                WHERE finished_at IS NOT NULL ORDER BY finished_at DESC LIMIT 1);

-- fragment: empty_room_selects
-- The phases' predicates, one per phase (reaper/phases.py). empty_room: an
-- Active room nobody is in.
s.status = 'Active' AND s.active_participant_count = 0

-- fragment: provision_timeout_selects
-- provision_timeout: a room still being provisioned.
s.status = 'Provisioning'

-- fragment: stale_live_selects
-- stale_live: any Active room (the empty ones its window reaches are
-- empty_room's: that phase runs first, and the counts leave them out).
s.status = 'Active'

-- fragment: phase_window_join
-- A phase's rooms written for a count (eligible_census says why): the
-- tenants' windows for the phase joined as w_<phase> (alias s: the room).
LEFT JOIN messenger.reaper_tenant_windows w_{phase}
    ON w_{phase}.tenant_id = s.tenant_id AND w_{phase}.phase = '{phase}'

-- fragment: phase_counted_own
-- A counted room's own cutoff: its tenant's window (phase_window_join), else
-- the default.
-- include: {phase}_selects
AND s.{since} <= coalesce(CAST(:as_of AS timestamptz) - w_{phase}.window_length,
                          CAST(:{phase}_cutoff AS timestamptz))

-- fragment: phase_counted
-- The phase's rooms for a count: the range bound computed here, then each
-- room's own cutoff.
s.{since} <= greatest(CAST(:{phase}_cutoff AS timestamptz),
        CAST(:as_of AS timestamptz)
        - (SELECT min(q.window_length) FROM messenger.reaper_tenant_windows q
           WHERE q.phase = '{phase}'))
AND
    -- include: phase_counted_own

-- name: guard_eligible
-- for each phase
-- The mass-closure guard's first input (a guarded phase): the conferences the
-- phase would end now, each by its own tenant's window (else the default). A
-- range of the phase's partial index to the widest cutoff, so a quiet cycle
-- costs what the rooms in that range cost, not what the live ones do
-- (docs/reliability.md#the-mass-closure-guard). Written for a count, as
-- eligible_census is.
SELECT count(*)
FROM messenger.conference_sessions s
-- include: phase_window_join
WHERE
    -- include: phase_counted
    AND s.id <> ALL (CAST(:excluded AS uuid[]));

-- name: active_count
-- All Active conferences: the guard's second input, counted only when the
-- first one is above the floor (an incident, not every cycle), and reaper plan's.
SELECT count(*) FROM messenger.conference_sessions WHERE status = 'Active';

-- fragment: fence
-- The fence (docs/design.md#the-single-runner-lock): a batch claims rows only
-- while its cycle owns the run and its phase's lock session still holds the
-- single-runner lock (else the server or the network ended that session, and no
-- batch of the phase may commit without it). The run row is held FOR KEY SHARE
-- until the commit: open_run's FOR UPDATE (a cycle taking the run over) waits
-- for this batch, and every later batch of the old owner finds the run closed;
-- the phase's own updates of its run row (no key changes) do not wait for it.
fence AS (
    SELECT r.run_id
    FROM messenger.reaper_runs r
    WHERE r.run_id = :run_id AND r.finished_at IS NULL
      AND
          -- include: lock_held(run_lock)
    FOR KEY SHARE OF r
),

-- fragment: roster_locks
-- Open roster rows of the claimed rooms, locked without waiting. A room one of
-- whose open rows a command holds (a "leave" locks its row, then updates the
-- room) is left out of the batch, reported 'held', and closed by a later
-- cycle: the batch never waits on a command's row and so can never deadlock
-- with one, whatever order the command locks in (docs/design.md#lock-order).
roster_claimed AS (
    SELECT p.id, p.conference_id
    FROM messenger.conference_participants p
    WHERE p.conference_id = ANY (ARRAY(SELECT c.id FROM claimed c)) AND p.left_at IS NULL
    FOR UPDATE SKIP LOCKED
),
held AS (
    SELECT DISTINCT p.conference_id AS id
    FROM messenger.conference_participants p
    WHERE p.conference_id = ANY (ARRAY(SELECT c.id FROM claimed c)) AND p.left_at IS NULL
      AND p.id NOT IN (SELECT r.id FROM roster_claimed r)
),

-- fragment: phase_cutoff
-- The rooms' own cutoffs (docs/design.md#windows-per-tenant): :as_of minus the
-- tenant's window for the phase, else the phase's default cutoff. One probe of
-- the windows' primary key per row (alias s: the room), which keeps a claim in
-- index order. Expressions: a phase's rooms are compared with them, and the
-- lateness of a closed room is measured from them.
coalesce(CAST(:as_of AS timestamptz)
         - (SELECT w.window_length
            FROM messenger.reaper_tenant_windows w
            WHERE w.tenant_id = s.tenant_id AND w.phase = '{phase}'),
         CAST(:{phase}_cutoff AS timestamptz))

-- fragment: phase_rooms
-- A phase's rooms (alias s), written once for its claims, its batch candidates
-- and reaper plan: its predicate, the index range to the widest cutoff (the
-- header; :<phase>_range), then the room's own cutoff. (A later phase's claim
-- needs no exclusion: the phases run in order, and an earlier one's rooms are
-- closed by then; a census and reaper plan leave them out themselves.)
-- include: {phase}_selects
AND s.{since} <= CAST(:{phase}_range AS timestamptz)
AND s.{since} <=
    -- include: phase_cutoff

-- fragment: phase_rooms_earlier
-- Not a room an earlier phase selects (the census and reaper plan: precedence
-- follows ORDER). The earlier phase's window is probed only for the rooms its
-- predicate selects.
AND (
    -- include: {phase}_selects
    AND s.{since} <=
        -- include: phase_cutoff
) IS NOT TRUE

-- fragment: batch_rooms
-- The rooms of a phase's batch: the phase's own (the statement is written once
-- per phase, so it holds that phase's predicate and no other), less the ones
-- left out (:excluded), and when isolating a poison row, these ids only
-- (:only; NULL: any).
-- include: phase_rooms
AND s.id <> ALL (CAST(:excluded AS uuid[]))
AND (CAST(:only AS uuid[]) IS NULL OR s.id = ANY (CAST(:only AS uuid[])))

-- fragment: claim
-- A phase's batch (both phase statements): the rooms it would claim, the fence,
-- the claim itself and the roster locks. visible is the same range without
-- locks, for the rows a command holds (the 'locked' report). Both in the order
-- of the phase's partial index.
visible AS (
    SELECT s.id
    FROM messenger.conference_sessions s
    WHERE
        -- include: batch_rooms
    ORDER BY s.{since}
    LIMIT :batch_size
),
-- include: fence
claimed AS (
    SELECT s.id, s.status, s.started_at, s.chat_id, s.deal_id, s.tenant_id
    FROM messenger.conference_sessions s
    WHERE
        -- include: batch_rooms
        AND EXISTS (SELECT FROM fence)
    ORDER BY s.{since}
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
-- include: roster_locks

-- fragment: no_duration
-- Why a room closed at :as_of gets no duration (docs/design.md#anomalies), or
-- NULL: its started_at is missing, later than as_of, or so old (or infinite)
-- the seconds do not fit an int. Such a room is still stuck, and closed like
-- any other (alias s: the room).
CASE WHEN s.started_at IS NULL THEN 'started_at is missing'
     WHEN s.started_at > :as_of THEN 'started_at is later than as_of'
     WHEN NOT isfinite(s.started_at)
          OR s.started_at < CAST(:as_of AS timestamptz) - interval '2147483647 seconds'
         THEN 'started_at too far in the past (duration out of range)'
END

-- fragment: close_roster
-- The closed rooms' open roster rows (those roster_claimed locked: this update
-- waits on no one) leave at as_of. Both phase statements; closed: their
-- transition's CTE.
roster AS (
    -- the rows roster_claimed locked: this update waits on no one
    UPDATE messenger.conference_participants p
    SET left_at = greatest(CAST(:as_of AS timestamptz), p.joined_at)
    WHERE p.id = ANY (ARRAY(SELECT r.id FROM roster_claimed r
                            -- "IS TRUE" keeps the IN a hashed subplan: a bare IN becomes
                            -- a join, which the planner, blind to a CTE's size, makes a
                            -- nested loop over closed, quadratic in the batch (39 of a
                            -- 1000-room batch's 123 ms)
                            WHERE (r.conference_id IN (SELECT x.id FROM closed x)) IS TRUE))
),

-- fragment: batch_report
-- The rest of a phase statement's result rows, after its 'reaped' rows (closed:
-- its transition's CTE).
UNION ALL
-- claimed, yet the status guard refused the transition
SELECT 'poison', c.id::text, c.chat_id::text, c.deal_id::text, NULL,
       'refused by the status guard', c.tenant_id::text, NULL
-- the claimed copy (the locked row's latest version): no second visit to the table
FROM claimed c
-- NOT IN (CTE): a hashed subplan; NOT EXISTS becomes a nested loop, quadratic in the batch
WHERE c.id NOT IN (SELECT e.id FROM closed e)
  AND c.id NOT IN (SELECT h.id FROM held h)
UNION ALL
-- claimed, but a command holds one of its open roster rows (skipped, not poison)
SELECT 'held', h.id::text, NULL, NULL, NULL, NULL, NULL, NULL
FROM held h
UNION ALL
SELECT 'locked', v.id::text, NULL, NULL, NULL, NULL, NULL, NULL
FROM visible v
-- Only a batch that comes back short looks for rows a command holds (the rows a
-- phase leaves for the next cycle): while there is more to claim, the next batch
-- meets them again. A one-time filter: a full batch never scans visible.
WHERE (SELECT count(*) FROM claimed) < :batch_size
  AND EXISTS (SELECT FROM fence)
  AND v.id NOT IN (SELECT c.id FROM claimed c)
UNION ALL
-- fenced off: the batch changed nothing (runs.RunLost)
SELECT 'fenced', NULL, NULL, NULL, NULL, NULL, NULL, NULL
WHERE NOT EXISTS (SELECT FROM fence)

-- name: end_active_batch
-- for each phase becoming Ended
WITH
-- include: claim
closed AS (
    UPDATE messenger.conference_sessions s
    SET status = '{status}',
        end_reason = '{end_reason}',
        ended_at = :as_of,
        updated_at = :as_of,
        -- NULL when started_at cannot give one (the fragment no_duration)
        duration_seconds = CASE WHEN (
                -- include: no_duration
            ) IS NULL
            THEN floor(extract(epoch FROM CAST(:as_of AS timestamptz) - s.started_at))::int
        END,
        active_participant_count = 0
    -- The claim locked each row and checked the phase's conditions on its latest
    -- version. The rows are reached by key from an array: joined to the CTE, the
    -- planner (which cannot estimate a CTE) picks a hash join over every
    -- candidate, or a nested loop quadratic in the batch. tests/test_query_plans.py
    -- holds this.
    WHERE s.id = ANY (ARRAY(SELECT c.id FROM claimed c
                            WHERE c.id NOT IN (SELECT h.id FROM held h)))
      -- the status guard: the phase's predicate, on the row's latest version
      AND
          -- include: {phase}_selects
    -- why it has no duration; its own cutoff (the lateness below)
    RETURNING s.*,
              -- include: no_duration
              AS anomaly,
              -- include: phase_cutoff
              AS own_cutoff
),
-- include: close_roster
-- Each ended room's recordings, read once (one probe of ix_recordings_conference):
-- the latest one names the event's recording, the running ones get a stop signal.
-- Referenced twice, so computed once. The volatile id in this CTE's target list:
-- one new id per row (a LATERAL without outer references may be evaluated once
-- for the whole batch).
ended_recordings AS (
    SELECT e.*, gen_random_uuid() AS event_id, rec.latest_id, rec.running_ids
    FROM closed e
    LEFT JOIN LATERAL (
        SELECT (array_agg(r.id ORDER BY r.created_at DESC, r.id DESC))[1] AS latest_id,
               array_agg(r.id) FILTER (
                   WHERE r.status IN ('Pending', 'Recording', 'Uploading')
                     AND r.stop_requested_at IS NULL) AS running_ids
        FROM messenger.call_recordings r
        WHERE r.conference_id = e.id
    ) rec ON true
),
integration AS (
    INSERT INTO messenger.integration_outbox (event_id, topic, message_key, payload, created_at)
    SELECT e.event_id, :topic, e.deal_id::text,
           jsonb_build_object(
               'eventId', e.event_id,
               'eventType', 'pin.messenger.conference-ended.v1',
               'occurredAt', messenger.rfc3339(:as_of),
               'correlationId', CAST(:run_id AS text),
               'aggregateId', e.deal_id,
               'payload', jsonb_build_object(
                   'conferenceId', e.id,
                   'chatId', e.chat_id,
                   'dealId', e.deal_id,
                   'tenantId', e.tenant_id,
                   'mediaType', e.media_type,
                   'status', e.status,
                   'endReason', e.end_reason,
                   'startedByUserId', e.started_by_user_id,
                   'startedAt', messenger.rfc3339(e.started_at),
                   'endedAt', messenger.rfc3339(e.ended_at),
                   'durationSeconds', e.duration_seconds,
                   'peakParticipantCount', e.peak_participant_count,
                   'participants', coalesce(roster.list, '[]'::jsonb),
                   'participantsOmitted', coalesce(roster.omitted, 0),
                   'wasRecorded', e.latest_id IS NOT NULL,
                   'recordingId', e.latest_id)),
           now()
    FROM ended_recordings e
    -- The event lists at most the first 20000 roster rows by joinedAt and says how
    -- many it left out: an unbounded roster would make a record some limit refuses
    -- (docs/design.md#the-kafka-event); 20000 rows fit the broker's default 1 MiB
    -- compressed with zstd, with a third to spare (docs/performance.md#compression).
    LEFT JOIN LATERAL (
        SELECT jsonb_agg(jsonb_build_object(
                   'userId', p.user_id,
                   'joinedAt', messenger.rfc3339(p.joined_at),
                   'leftAt', messenger.rfc3339(coalesce(p.left_at, greatest(CAST(:as_of AS timestamptz), p.joined_at))))
               ORDER BY p.joined_at, p.id) FILTER (WHERE p.n <= 20000) AS list,
               greatest(count(*) - 20000, 0) AS omitted
        FROM (SELECT p.*, row_number() OVER (ORDER BY p.joined_at, p.id) AS n
              FROM messenger.conference_participants p
              WHERE p.conference_id = e.id) p
    ) roster ON true
    ORDER BY e.ended_at, e.last_activity_at
),
realtime AS (
    INSERT INTO messenger.realtime_outbox
        (kind, target_kind, chat_id, session_kind, conference_id, payload, created_at)
    SELECT 'ConferenceEnded', 'ChatGroup', e.chat_id, 'Conference', e.id,
           jsonb_build_object(
               'conferenceId', e.id, 'chatId', e.chat_id, 'status', e.status,
               'endReason', e.end_reason, 'signal', 'Ended'),
           now()
    FROM closed e
)
-- lateness_seconds: from the moment the room became eligible ({since}
-- + its own window, as_of - own_cutoff: its tenant's, else the default) to this
-- statement, which commits right after: a queue wait or a late phase shows in
-- it (the SLO's measure).
-- ids as text: parsing them into uuid.UUID and back costs a tenth of the Python per room
SELECT 'reaped' AS kind, e.id::text AS conference_id, e.chat_id::text AS chat_id,
       e.deal_id::text AS deal_id, e.duration_seconds,
       -- an anomaly: why there is no duration (conference.anomaly)
       e.anomaly AS detail,
       e.tenant_id::text AS tenant_id,
       CASE WHEN isfinite(e.{since})
            THEN extract(epoch FROM clock_timestamp() - e.{since}
                                    - (CAST(:as_of AS timestamptz) - e.own_cutoff))::float8
       END AS lateness_seconds
FROM closed e
-- include: batch_report
UNION ALL
SELECT 'stop', e.id::text, NULL, NULL, NULL, running.id::text, NULL, NULL
FROM ended_recordings e
CROSS JOIN LATERAL unnest(e.running_ids) AS running(id);

-- name: fail_provisioning_batch
-- for each phase not becoming Ended
WITH
-- A phase whose rooms do not become Ended (provision_timeout's fail): a
-- realtime signal, no event.
-- include: claim
closed AS (
    UPDATE messenger.conference_sessions s
    SET status = '{status}',
        end_reason = '{end_reason}',
        ended_at = :as_of,
        updated_at = :as_of,
        active_participant_count = 0
    -- as in end_active_batch: by key, the claim checked the rest
    WHERE s.id = ANY (ARRAY(SELECT c.id FROM claimed c
                            WHERE c.id NOT IN (SELECT h.id FROM held h)))
      AND
          -- include: {phase}_selects
    -- its own cutoff (the lateness below)
    RETURNING s.*,
              -- include: phase_cutoff
              AS own_cutoff
),
-- include: close_roster
realtime AS (
    INSERT INTO messenger.realtime_outbox
        (kind, target_kind, chat_id, session_kind, conference_id, payload, created_at)
    SELECT 'ConferenceSignal', 'ChatGroup', f.chat_id, 'Conference', f.id,
           jsonb_build_object(
               'conferenceId', f.id, 'chatId', f.chat_id, 'status', f.status,
               'endReason', f.end_reason, 'signal', f.status),
           now()
    FROM closed f
)
-- ids as text: parsing them into uuid.UUID and back costs a tenth of the Python per room
SELECT 'reaped' AS kind, f.id::text AS conference_id, f.chat_id::text AS chat_id,
       f.deal_id::text AS deal_id, f.duration_seconds, NULL::text AS detail,
       f.tenant_id::text AS tenant_id,
       -- from {since} + its own window to this statement (see end_active_batch)
       CASE WHEN isfinite(f.{since})
            THEN extract(epoch FROM clock_timestamp() - f.{since}
                                    - (CAST(:as_of AS timestamptz) - f.own_cutoff))::float8
       END AS lateness_seconds
FROM closed f
-- include: batch_report
UNION ALL
SELECT 'stop', f.id::text, NULL, NULL, NULL, r.id::text, NULL, NULL
FROM closed f
-- OFFSET 0 keeps it a per-room lookup on ix_recordings_conference: flattened
-- into a join, the planner may scan every recording for each batch
CROSS JOIN LATERAL (
    SELECT r.id
    FROM messenger.call_recordings r
    WHERE r.conference_id = f.id
      AND r.status IN ('Pending', 'Recording', 'Uploading') AND r.stop_requested_at IS NULL
    OFFSET 0
) r;

-- name: batch_candidates
-- for each phase
-- The rows a phase's next batch would claim (its visible CTE: the same rooms),
-- not locked: a batch the database refused is retried in halves of these,
-- until the row it refuses is alone (cycle.PhaseBatches._isolate).
SELECT s.id::text
FROM messenger.conference_sessions s
WHERE
    -- include: batch_rooms
ORDER BY s.{since}
LIMIT :batch_size;

-- name: mark_stop_requested
UPDATE messenger.call_recordings
SET stop_requested_at = clock_timestamp()
WHERE id = ANY (CAST(:recording_ids AS uuid[])) AND stop_requested_at IS NULL;

-- name: mark_stop_failed
-- A stop signal the recorder did not take: a later pass may send the next one
-- after an exponential back-off.
UPDATE messenger.call_recordings
SET stop_attempts = stop_attempts + 1,
    stop_next_attempt_at = clock_timestamp() + make_interval(secs => least(
        CAST(:backoff_max_s AS float8),
        CAST(:backoff_initial_s AS float8) * power(2, least(stop_attempts, 30))))
WHERE id = ANY (CAST(:recording_ids AS uuid[])) AND stop_requested_at IS NULL;

-- fragment: phase_end_reason
'{end_reason}'

-- name: claim_stops_due
-- The stop signals due now, claimed for one pass (reaper/recorder.py StopPass):
-- recordings still running on rooms the reaper ended within the retry window,
-- whose stop the recorder has not taken, and whose next attempt is due (never
-- tried: at once, from the close). The claim is a lease: their next attempt
-- moves to the end of the pass, so a concurrent pass skips them and a pass
-- that dies leaves them due again when the lease ends. SKIP LOCKED: a
-- recording row the media stack holds is left for the next pass, never waited
-- on.
WITH due AS (
    SELECT r.id, s.id AS conference_id, s.end_reason
    FROM messenger.conference_sessions s
    JOIN messenger.call_recordings r ON r.conference_id = s.id
    -- the end reasons of the phases (the partial index ix_conf_reaped, migration
    -- 0007, must list each: tests/test_phase_lists.py)
    WHERE s.end_reason IN (
          -- include each phase joined by ,: phase_end_reason
          )
      AND s.ended_at >= clock_timestamp() - make_interval(secs => :window_s)
      AND r.status IN ('Pending', 'Recording', 'Uploading')
      AND r.stop_requested_at IS NULL
      AND (r.stop_next_attempt_at IS NULL OR r.stop_next_attempt_at <= clock_timestamp())
      -- the fence: nothing is claimed once the pass's lock session lost the stop
      -- lock (NULL: the pass of `reaper reap --once`, which takes no lock)
      AND (CAST(:holder_pid AS integer) IS NULL OR
               -- include: lock_held(stop_lock)
          )
    ORDER BY s.ended_at, r.id
    LIMIT :limit
    FOR UPDATE OF r SKIP LOCKED
)
UPDATE messenger.call_recordings r
SET stop_next_attempt_at = clock_timestamp() + make_interval(secs => :lease_s)
FROM due
WHERE r.id = due.id
RETURNING r.id::text AS recording_id, due.conference_id::text AS conference_id,
          due.end_reason, r.stop_attempts;

-- name: release_stops
-- Claimed signals a pass had no time left to send: due again at once, with no
-- attempt counted.
UPDATE messenger.call_recordings
SET stop_next_attempt_at = clock_timestamp()
WHERE id = ANY (CAST(:recording_ids AS uuid[])) AND stop_requested_at IS NULL;

-- name: try_stop_lock
-- One stop-signal pass at a time across all workers, so passes never fill every
-- worker slot (the claim's lease would keep concurrent passes apart anyway).
-- include: try_lock(stop_lock)

-- name: stop_marks_fence
-- The fence of a stop pass's marks (docs/design.md#the-recorder-stop-signal).
-- include: marks_fence(stop_lock, stop_marks)

-- name: wait_stop_marks
-- A pass that has just taken the stop lock waits until every transaction of an
-- earlier holder that passed stop_marks_fence has ended (within lock_timeout),
-- in a savepoint that the caller rolls back, which frees the gate again.
-- include: wait_lock(stop_marks)

-- name: run_lock_holder
-- Backend pid holding the single-runner lock, if any.
SELECT l.pid
FROM pg_locks l
WHERE
    -- include: lock_row(run_lock)
LIMIT 1;

-- name: census_planner
-- The counts of the census (eligible_census, stale_live_eligible) end their
-- index range at a bound the planner only learns when the statement runs (the
-- shortest tenant window, an InitPlan). It then guesses a third of the index
-- and, on a table of a million live rooms, starts parallel workers and JIT for
-- a count of a few rows: 15-20 ms per count, the quiet cycle growing with the
-- live rooms (measured, bench "quiet cycle ... live"). These counts stay in
-- this process: for the census's transaction only.
SELECT set_config('max_parallel_workers_per_gather', '0', true), set_config('jit', 'off', true);

-- name: relay_planner
-- The claim must walk ix_integration_outbox_pending in id order and stop after
-- one batch. Right after a burst (a freshly filled table, no statistics yet)
-- the planner would rather fetch and sort the whole backlog (measured: 340 ms
-- per batch on a 50k backlog, against 10 ms), or read the parked keys with a
-- sequential scan of the whole table. So, for the relay's transaction only
-- (the claim and the marks, all reached by index): sorting and sequential
-- scans are discouraged, and JIT is off (the resulting cost estimate would
-- start a ~300 ms compilation per batch).
SELECT set_config('enable_sort', 'off', true), set_config('enable_seqscan', 'off', true),
       set_config('jit', 'off', true);

-- name: claim_outbox_batch
-- The relay's batch: pending rows due for an attempt, oldest first, locked
-- until the relay's transaction ends (a concurrent relay skips them). Per
-- message key nothing overtakes: a row is left out while an earlier row of its
-- key is backing off (in the CTE, so held-back keys never fill the batch), or
-- is pending but not ours (claimed by another relay right now). A key with a
-- parked row sends nothing until an operator requeues it
-- (docs/design.md#parked-events).
-- The pending checks are scalar subqueries on purpose: evaluated per candidate
-- as one probe of ix_integration_outbox_pending_key, the cost follows the
-- batch, not the backlog (as NOT EXISTS the planner hashed every pending row
-- per batch). The probe must use that index whatever the statistics say: right
-- after a burst (statistics of an empty table: every pending row "rare") the
-- planner rates ix_integration_outbox_pending (id) as cheap and walks every
-- earlier pending row per candidate (measured: 0.7-1.9 s per batch of 2000 on
-- 10,000 fresh rows). So the key is a range, not an equality, and the probe
-- asks for (message_key, id) order: with relay_planner's enable_sort off, only
-- the (message_key, id) index gives that order without a sort.
-- The parked keys are read once per claim (a hashed NOT IN over
-- ix_integration_outbox_parked; relay_planner rules out the sequential scan):
-- parked rows are few, each one alerts.
-- :from_id is where the walk starts: 0 walks from the oldest pending row;
-- within a pass the relay starts most claims after its last batch
-- (reaper/relay.py, ClaimFloor). Deleted rows stay in the pending index until
-- vacuum, and while another session holds a snapshot older than their
-- deletion no scan can mark them dead: a walk from the start visits each of
-- them in the heap again, every claim (measured: 52 ms before the first row
-- with 70,000 such rows). The probes below are never floored: an earlier row
-- of a key holds back its later ones wherever the walk starts.
WITH claimed AS (
    SELECT o.id, o.event_id, o.topic, o.message_key, o.payload, o.attempts
    FROM messenger.integration_outbox o
    WHERE o.published_at IS NULL AND o.parked_at IS NULL
      AND o.id >= :from_id
      AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now())
      AND (SELECT 1
           FROM messenger.integration_outbox b
           WHERE b.message_key >= o.message_key AND b.message_key <= o.message_key
             AND b.published_at IS NULL AND b.parked_at IS NULL
             AND b.id < o.id
             AND b.next_attempt_at > now()
           ORDER BY b.message_key, b.id
           LIMIT 1) IS NULL
      AND o.message_key NOT IN (SELECT p.message_key
                                FROM messenger.integration_outbox p
                                WHERE p.parked_at IS NOT NULL AND p.published_at IS NULL)
      -- the fence: nothing is claimed once the pass's lock session lost the relay lock
      AND
          -- include: lock_held(relay_lock)
    ORDER BY o.id
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
)
SELECT c.id, c.event_id::text AS event_id, c.topic, c.message_key, c.attempts,
       c.payload::text AS value,
       c.payload ->> 'eventType' AS event_type,
       c.payload ->> 'correlationId' AS correlation_id
FROM claimed c
WHERE (SELECT 1
       FROM messenger.integration_outbox b
       WHERE b.message_key >= c.message_key AND b.message_key <= c.message_key
         AND b.published_at IS NULL AND b.parked_at IS NULL
         AND b.id < c.id
         AND b.id NOT IN (SELECT id FROM claimed)
       ORDER BY b.message_key, b.id
       LIMIT 1) IS NULL
ORDER BY c.id;

-- name: acknowledge_outbox
-- Only rows whose own Kafka acknowledgement arrived: deleted, in the batch's
-- transaction, after its fence. A DELETE leaves one dead row version and no new
-- index entry, where marking published_at (a column of the pending indexes'
-- predicates, so never a HOT update) left a dead version and a new one with its
-- index entries, which retention then deleted again. The worker's role has no
-- DELETE on the table: the definer function (migration 0012) deletes only the
-- named rows that are still pending, and says how many.
SELECT messenger.acknowledge_outbox(CAST(:ids AS bigint[]));

-- name: mark_outbox_failed
-- Why, and an exponential back-off before the next try. :charged: the row's
-- own failure, one attempt more, and a row out of attempts (:max_attempts) is
-- parked instead; not charged: Kafka could not be reached, which is no fault
-- of the row, so an outage however long parks nothing (docs/design.md#parked-events).
UPDATE messenger.integration_outbox o
SET attempts = o.attempts + CASE WHEN :charged THEN 1 ELSE 0 END,
    last_error = CASE WHEN :charged AND o.attempts + 1 >= :max_attempts
                      THEN f.error || ' (parked after ' || (o.attempts + 1) || ' attempts)'
                      ELSE f.error END,
    parked_at = CASE WHEN :charged AND o.attempts + 1 >= :max_attempts
                     THEN clock_timestamp() END,
    next_attempt_at = clock_timestamp() + make_interval(secs => least(
        CAST(:backoff_max_s AS float8),
        CAST(:backoff_initial_s AS float8) * power(2, least(o.attempts, 30))))
FROM unnest(CAST(:ids AS bigint[]), CAST(:errors AS text[])) AS f(id, error)
WHERE o.id = f.id AND o.published_at IS NULL
RETURNING o.id, o.parked_at IS NOT NULL AS parked;

-- name: mark_outbox_parked
-- Refused for good (not retriable): parked at once, with why.
UPDATE messenger.integration_outbox o
SET attempts = o.attempts + 1,
    last_error = f.error,
    parked_at = clock_timestamp(),
    next_attempt_at = NULL
FROM unnest(CAST(:ids AS bigint[]), CAST(:errors AS text[])) AS f(id, error)
WHERE o.id = f.id AND o.published_at IS NULL;

-- name: outbox_pending_stats
-- messenger_outbox_pending, messenger_outbox_oldest_pending_age_seconds and
-- messenger_outbox_parked.
SELECT count(*) FILTER (WHERE parked_at IS NULL) AS pending,
       coalesce(extract(epoch FROM clock_timestamp()
                        - min(created_at) FILTER (WHERE parked_at IS NULL)), 0)
           AS oldest_age_seconds,
       (SELECT count(*) FROM messenger.integration_outbox WHERE parked_at IS NOT NULL) AS parked
FROM messenger.integration_outbox
WHERE published_at IS NULL AND parked_at IS NULL;

-- name: outbox_vacuum_stats
-- messenger_outbox_dead_rows and messenger_outbox_oldest_snapshot_age_seconds:
-- the outbox's dead row versions (as the statistics collector last counted
-- them), and the age of the oldest transaction of this database that holds a
-- snapshot, which keeps them however often vacuum runs (NULL: unknown, see
-- migration 0012; 0: none).
SELECT coalesce((SELECT s.n_dead_tup FROM pg_catalog.pg_stat_user_tables s
                 WHERE s.relid = CAST('messenger.integration_outbox' AS regclass)), 0)
           AS dead_rows,
       messenger.oldest_snapshot_age_seconds() AS oldest_snapshot_age_seconds;

-- name: parked_outbox
-- reaper outbox parked: the rows the relay gave up on, oldest first.
SELECT event_id::text AS event_id, message_key, topic, attempts, last_error, parked_at,
       created_at
FROM messenger.integration_outbox
WHERE parked_at IS NOT NULL
ORDER BY parked_at, id
LIMIT :limit;

-- name: requeue_outbox
-- reaper outbox requeue: parked rows back to pending, as new (attempts 0, due now).
UPDATE messenger.integration_outbox
SET parked_at = NULL, attempts = 0, next_attempt_at = NULL
WHERE parked_at IS NOT NULL
  AND (CAST(:event_id AS uuid) IS NULL OR event_id = CAST(:event_id AS uuid));

-- name: discard_outbox
-- reaper outbox discard: a parked row out of the outbox, kept in
-- messenger.outbox_discards with who, when and why (migration 0013). The
-- definer function refuses a pending row and an unknown id; EXECUTE is the
-- operator role's only.
SELECT d.event_id::text AS event_id, d.topic, d.message_key, d.discarded_at, d.discarded_by,
       d.discarded_login, d.reason
FROM messenger.discard_outbox(CAST(:event_id AS uuid), :reason, :operator) d;

-- name: outbox_discarded_count
-- messenger_outbox_discarded: the events an operator took out of delivery.
SELECT count(*) FROM messenger.outbox_discards;

-- name: delete_published_outbox
-- Retention, one small batch at a time: how many published rows older than
-- :retention_s (by the database's clock) were deleted. The worker's role may
-- not DELETE from the table; the definer function (migration 0009) deletes
-- only published rows, and refuses a retention under an hour.
SELECT messenger.delete_published_outbox(make_interval(secs => :retention_s), :batch_size);

-- name: try_relay_lock
-- One relay pass at a time across all workers, so relays never fill every
-- worker slot (SKIP LOCKED would keep concurrent passes correct anyway).
-- include: try_lock(relay_lock)

-- name: relay_marks_fence
-- The fence of a relay batch's marks and commit (docs/design.md#the-outbox-relay):
-- a batch that finds the lock gone commits nothing. Retention's transactions
-- begin with it too.
-- include: marks_fence(relay_lock, relay_marks)

-- name: wait_relay_marks
-- A pass that has just taken the relay lock waits until every batch of an
-- earlier holder that passed relay_marks_fence has ended (within lock_timeout),
-- in a savepoint that the caller rolls back, which frees the gate again.
-- include: wait_lock(relay_marks)

-- name: eligible_census
-- What the next cycle would select, per phase (one row each, in their order),
-- with the phases' own predicates (windows per tenant included); each
-- conference counted once, in the first phase that selects it (a terminal
-- transition hides it from the later ones: stale_live counts the occupied
-- rooms, and the empty ones their tenant's grace still keeps). The sum is
-- messenger_conf_reaper_active_backlog.
-- Each count is a range of its phase's partial index, to the widest cutoff: it
-- costs what the rooms in that range cost, never what the live ones do.
-- Written for a count (the claims need an order, a count does not):
--   the widest cutoff is computed here, greatest(default cutoff, :as_of -
--     (SELECT min(window) ...)): an InitPlan, unknown to the planner, which
--     then estimates a third of the partial index and stays on it. Given as a
--     constant that covers most live rooms (a 1 h stale-live policy), the
--     planner picks a sequential scan of the whole table instead;
--   the phase's own windows are joined (one hash of the small table) rather
--     than probed per row: a probe per row is ten times slower on a large
--     backlog;
--   an earlier phase's rooms are left out as reaper plan leaves them out
--     (phase_rooms_earlier): its predicate first, and its window probed only
--     for a room that predicate selects, which two phases of different
--     statuses never share. Joined for every earlier phase, each count planned
--     one more join per earlier phase (hash joins of the whole windows table
--     where the planner expects many rooms), whether the phases can share a
--     room or not.
-- since: when the oldest one became eligible (the column its lateness counts
-- from, plus its own window).
-- include each phase joined by UNION ALL: phase_census

-- fragment: phase_census
(SELECT '{phase}' AS phase, count(*) AS n,
        min(s.{since} + coalesce(w_{phase}.window_length,
            CAST(:as_of AS timestamptz) - CAST(:{phase}_cutoff AS timestamptz))) AS since
 FROM messenger.conference_sessions s
 -- include: phase_window_join
 WHERE
     -- include: phase_counted
     -- include each earlier phase: phase_rooms_earlier
)

-- name: plan_candidates
-- reaper plan: the conferences of eligible_census (same predicates, same
-- phase assignment), in the phases' order, each phase's oldest first, at most
-- :per_phase per phase, each from its phase's index range.
-- tenant_window: the tenant's window that applies (NULL: the default).
-- anomaly: why the room would be closed without a duration (no_duration;
-- reaper/overview.py keeps it for the phases that end rooms with one).
SELECT s.phase, s.id AS conference_id, s.chat_id, s.deal_id, s.tenant_id, s.status,
       s.created_at, s.started_at, s.last_activity_at, s.active_participant_count,
       s.tenant_window,
       -- include: no_duration
       AS anomaly
FROM (
    -- include each phase joined by UNION ALL: phase_plan
) s
ORDER BY s.rank, s.since, s.id;

-- fragment: phase_plan
(SELECT '{phase}' AS phase, s.*,
        (SELECT w.window_length FROM messenger.reaper_tenant_windows w
         WHERE w.tenant_id = s.tenant_id AND w.phase = '{phase}') AS tenant_window,
        array_position(CAST(:phases AS text[]), '{phase}') AS rank, s.{since} AS since
 FROM messenger.conference_sessions s
 WHERE
     -- include: phase_rooms
     -- include each earlier phase: phase_rooms_earlier
 ORDER BY s.{since}, s.id
 LIMIT :per_phase)

-- name: backend_activity
-- Who a backend pid is (reaper status: the lock holder).
SELECT a.pid, a.application_name, host(a.client_addr) AS client_addr, a.state,
       a.backend_start, a.xact_start,
       extract(epoch FROM clock_timestamp() - a.xact_start) AS xact_age_seconds
FROM pg_stat_activity a
WHERE a.pid = :pid;

-- name: active_pauses
-- The pauses in force: no end, or an end still to come.
SELECT phase, reason, paused_at, paused_until, paused_by
FROM messenger.reaper_pauses
WHERE paused_until IS NULL OR paused_until > clock_timestamp()
-- in the phases' order (:phases, phases.ORDER)
ORDER BY array_position(CAST(:phases AS text[]), phase);

-- name: phase_pause
-- Read by a phase under the run's lock: is it paused now, and why.
SELECT reason
FROM messenger.reaper_pauses
WHERE phase = :phase AND (paused_until IS NULL OR paused_until > clock_timestamp());

-- name: pause_phase
-- A new pause replaces the phase's earlier one (a pause that ended by itself too).
INSERT INTO messenger.reaper_pauses AS p (phase, reason, paused_at, paused_until, paused_by)
VALUES (:phase, :reason, clock_timestamp(),
        clock_timestamp() + make_interval(secs => CAST(:for_s AS float8)), :by)
ON CONFLICT (phase) DO UPDATE
SET reason = EXCLUDED.reason, paused_at = EXCLUDED.paused_at,
    paused_until = EXCLUDED.paused_until, paused_by = EXCLUDED.paused_by
RETURNING phase, reason, paused_at, paused_until, paused_by;

-- name: resume_phases
-- The pauses that were in force are the ones resumed; ended ones just go.
DELETE FROM messenger.reaper_pauses
WHERE phase = ANY (CAST(:phases AS text[]))
RETURNING phase, reason, paused_by,
          (paused_until IS NULL OR paused_until > clock_timestamp()) AS in_force;

-- name: tenant_window_bounds
-- The shortest window of each phase any tenant sets (a phase no tenant sets
-- has no row); with the defaults they give each phase's widest cutoff
-- (phases.range_cutoff). Read once per phase, and by reaper plan.
SELECT phase, min(window_length) AS shortest
FROM messenger.reaper_tenant_windows
GROUP BY phase;

-- name: set_tenant_window
-- reaper policy set: a tenant's window for one phase, replacing the one it had.
-- The row stays locked until the caller's transaction ends, which checks the
-- tenant's windows against each other (reaper/control.py) and rolls back on a
-- refusal. Windows are stored as seconds, without a day part, so that
-- as_of - window is exact in any session time zone.
INSERT INTO messenger.reaper_tenant_windows AS w
    (tenant_id, phase, window_length, updated_at, updated_by)
VALUES (CAST(:tenant_id AS uuid), :phase, make_interval(secs => CAST(:window_s AS float8)),
        clock_timestamp(), :by)
ON CONFLICT (tenant_id, phase) DO UPDATE
SET window_length = EXCLUDED.window_length,
    updated_at = EXCLUDED.updated_at,
    updated_by = EXCLUDED.updated_by;

-- name: unset_tenant_windows
-- reaper policy unset: the tenant's conferences get the defaults again; the
-- windows it had, each phase's row.
DELETE FROM messenger.reaper_tenant_windows
WHERE tenant_id = CAST(:tenant_id AS uuid)
RETURNING tenant_id::text AS tenant_id, phase, window_length, updated_at, updated_by;

-- name: tenant_windows
-- reaper policy list, and a tenant's windows (:tenant_id; NULL: every tenant's):
-- one row per tenant and phase.
SELECT tenant_id::text AS tenant_id, phase, window_length, updated_at, updated_by
FROM messenger.reaper_tenant_windows
WHERE CAST(:tenant_id AS uuid) IS NULL OR tenant_id = CAST(:tenant_id AS uuid)
ORDER BY tenant_id, phase;

-- name: tenant_policy_count
-- reaper status: the tenants with a window of their own.
SELECT count(DISTINCT tenant_id) FROM messenger.reaper_tenant_windows;

-- name: last_run_completed
-- When a run last completed, whichever replica ran it (the database's clock):
-- /healthz and messenger_conf_reaper_last_run_completed_timestamp_seconds.
-- Skipped ticks leave no row, failed and taken-over runs do not count; read
-- backwards along ix_reaper_runs_finished.
SELECT finished_at, extract(epoch FROM clock_timestamp() - finished_at) AS age_seconds
FROM messenger.reaper_runs
WHERE finished_at IS NOT NULL AND outcome = 'completed'
ORDER BY finished_at DESC
LIMIT 1;

-- name: activity_ahead_count
-- Active conferences whose last_activity_at is later than :ahead_of (the
-- database's clock plus a tolerance), +infinity included: no cut-off reaches
-- them, so no phase selects them; they are held and alerted
-- (docs/design.md#anomalies). messenger_conf_reaper_activity_ahead, reaper
-- status and reaper plan. A range of ix_conf_active from :ahead_of up, which
-- holds only such rooms: it costs what they cost, never what the live rooms
-- do. (-infinity is earlier than every cut-off: those rooms are closed.)
SELECT count(*)
FROM messenger.conference_sessions s
WHERE s.status = 'Active' AND s.last_activity_at > CAST(:ahead_of AS timestamptz);

-- name: activity_ahead
-- reaper plan: those conferences, the furthest ahead first, at most :limit.
-- ahead_seconds is NULL for +infinity (an interval cannot hold it).
SELECT s.id AS conference_id, s.chat_id, s.deal_id, s.tenant_id,
       s.active_participant_count,
       NOT isfinite(s.last_activity_at) AS infinite,
       CASE WHEN isfinite(s.last_activity_at) THEN s.last_activity_at END AS last_activity_at,
       CASE WHEN isfinite(s.last_activity_at)
            THEN extract(epoch FROM s.last_activity_at - CAST(:now AS timestamptz))
       END AS ahead_seconds
FROM messenger.conference_sessions s
WHERE s.status = 'Active' AND s.last_activity_at > CAST(:ahead_of AS timestamptz)
ORDER BY s.last_activity_at DESC, s.id
LIMIT :limit;

-- name: schema_readable
-- What of the schema's record this login may read (reaper/schema.py). Asked
-- first, apart: a statement that names a table it may not read fails whole,
-- and a database before 0010 has no record, nor a grant of alembic_version to
-- the reaper's roles. to_regclass is null for a table that does not exist.
SELECT coalesce(has_table_privilege(to_regclass('public.alembic_version'), 'SELECT'), false)
           AS revision_readable,
       coalesce(has_table_privilege(to_regclass('messenger.reaper_migrations'), 'SELECT'), false)
           AS record_readable;

-- name: schema_revision
-- The migration the database is at (Alembic's one row; none before the first).
SELECT version_num FROM public.alembic_version;

-- name: schema_record
-- The compatibility record: one row per migration applied (0010 on).
SELECT revision, kind, release, compatible_from
FROM messenger.reaper_migrations
ORDER BY revision;

-- name: schema_owner
-- reaper migrate runs as the schema owner: who owns the revision table, and
-- whether this login acts as that role (no row: no table yet, a new database).
SELECT pg_get_userbyid(c.relowner) AS owner, pg_has_role(c.relowner, 'USAGE') AS acts_as_owner
FROM pg_class c
WHERE c.oid = to_regclass('public.alembic_version');

-- name: ledger_closings
-- The ledger (reaper/ledger.py, docs/delivery.md): the rooms the reaper closed
-- in [since, until), by the partial index of reaped rooms (ix_conf_reaped).
-- Ids as text: the ledger matches them with the events' text.
SELECT s.id::text AS conference_id, s.deal_id::text AS deal_id, s.status, s.end_reason,
       s.ended_at
FROM messenger.conference_sessions s
WHERE s.end_reason IN (
      -- include each phase joined by ,: phase_end_reason
      )
  AND s.ended_at >= :since AND s.ended_at < :until;

-- name: ledger_pending
-- The ledger: every event not yet on Kafka (pending or parked). Published rows
-- (a 0.3.0 relay's) are on the topic, where the ledger reads them.
SELECT o.event_id::text AS event_id, o.message_key, o.payload,
       o.parked_at IS NOT NULL AS parked
FROM messenger.integration_outbox o
WHERE o.published_at IS NULL;

-- name: ledger_pushes
-- The ledger: the push rows of the rooms the reaper closed in [since, until).
SELECT r.conference_id::text AS conference_id, r.kind
FROM messenger.conference_sessions s
JOIN messenger.realtime_outbox r ON r.conference_id = s.id
WHERE s.end_reason IN (
      -- include each phase joined by ,: phase_end_reason
      )
  AND s.ended_at >= :since AND s.ended_at < :until;

-- name: ledger_discarded
-- The ledger: rooms closed in [since, until) whose event an operator discarded
-- (migration 0013; a small table, matched by the event's text).
SELECT s.id::text
FROM messenger.outbox_discards d
JOIN messenger.conference_sessions s ON s.id::text = d.payload->'payload'->>'conferenceId'
WHERE s.ended_at >= :since AND s.ended_at < :until;

-- name: ledger_republished
-- The ledger: the events an operator put back for rooms closed in [since, until)
-- (migration 0014).
SELECT p.event_id::text
FROM messenger.outbox_republishes p
WHERE p.ended_at >= :since AND p.ended_at < :until;

-- name: ledger_rooms
-- The ledger: the rooms of events whose room is not among the closings in the
-- window, as they are now (closed earlier or later, closed otherwise, live).
SELECT s.id::text AS conference_id, s.deal_id::text AS deal_id, s.status, s.end_reason,
       s.ended_at
FROM messenger.conference_sessions s
WHERE s.id = ANY (CAST(:ids AS uuid[]));

-- name: republish_outbox
-- reaper reconcile --republish: the lost event of a room the reaper ended, put
-- back into the outbox and recorded in messenger.outbox_republishes (migration
-- 0014). The definer function refuses a room not ended by the reaper and an
-- event still in the outbox or discarded; EXECUTE is the operator role's only.
SELECT p.event_id::text AS event_id, p.conference_id::text AS conference_id,
       p.deal_id::text AS deal_id, p.end_reason, p.ended_at, p.republished_at,
       p.republished_by, p.republished_login, p.reason
FROM messenger.republish_outbox(CAST(:conference_id AS uuid), :topic, :reason, :operator) p;

-- name: may_republish
-- reaper reconcile --republish asks first, before reading anything: may this
-- login put a lost event back (EXECUTE on the 0014 function is the operator
-- role's only)? to_regprocedure: NULL before 0014 (this release needs it).
SELECT session_user AS login,
       coalesce(has_function_privilege(
           to_regprocedure('messenger.republish_outbox(uuid, text, text, text)'), 'EXECUTE'),
           false) AS allowed;
