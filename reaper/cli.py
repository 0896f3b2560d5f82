"""The ``reaper`` console script (docs/design.md#the-command-line).

Every command runs the very code the worker runs; ``reaper reap --once`` is
``Reaper.run_cycle``, the three calls the Celery tasks make one after the other.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from reaper import logs
from reaper.config import Settings, get_settings


def cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    """Expand by default (this release's expand migrations, and whatever earlier
    releases left); ``--contract``: this release's contract migrations, once
    its expand ones are in; ``--revision R``: exactly R, kinds unchecked."""
    from reaper import budgets, release, schema
    from reaper.db import engine_of, ensure_database, migrate
    from reaper.overview import safe_url

    peer = budgets.peer(settings)  # bounded like every connection of the reaper
    version = release.version()
    # A database error (e.g. run as a login that is not the schema owner) is main()'s line.
    ensure_database(settings.database_url, peer)
    owner = schema.not_the_owner(engine_of(settings), settings)
    if owner is not None:
        # as the roles' logins may read the revision, say it here, not by
        # alembic's failure (which a schema with nothing to apply never meets)
        print(
            f"reaper: database {safe_url(settings.database_url)} refused: permission denied:"
            f" migrations run as the schema owner ({owner})",
            file=sys.stderr,
        )
        return 1
    if args.revision is not None:
        migrate(settings.database_url, args.revision, peer=peer)
        print(f"schema at {args.revision}")
        return 0
    before = schema.check(engine_of(settings), settings).revision
    plan = release.migrate_plan(before, contract=args.contract, version=version)
    if plan.refusal is not None:
        print(f"reaper: {plan.refusal}", file=sys.stderr)
        return release.EXIT_SCHEMA
    if plan.target is not None:
        migrate(settings.database_url, plan.target, peer=peer)
    at = plan.target or before
    if plan.target is None:
        print(f"schema at {at}: nothing to apply")
    elif before is None:
        print(f"schema at {at}: a new database, every migration of {version} applied")
    elif args.contract:
        print(f"schema at {at}: the contract migrations of {version} are applied")
    elif release.SCHEMA_NEEDED != release.SCHEMA_KNOWN:
        print(
            f"schema at {at}: the expand migrations of {version} are applied; roll every "
            f"worker to {version}, then run reaper migrate --contract"
        )
    else:
        print(f"schema at {at}: the migrations of {version} are applied")
    return 0


def _schema_refused(settings: Settings) -> int | None:
    """Every command that uses the database (not migrate) checks the schema
    first: a schema this release does not run on is one line and EXIT_SCHEMA;
    a newer one it is compatible with, a warning (schema.newer) and on."""
    from reaper import release, schema
    from reaper.db import engine_of

    verdict = schema.check(engine_of(settings), settings)
    if not verdict.runs:
        print(f"reaper: {verdict.message()}", file=sys.stderr)
        return release.EXIT_SCHEMA
    if verdict.state is not release.SchemaState.SUPPORTED:
        schema.log_verdict(verdict, process="cli")
    return None


def cmd_reap(settings: Settings, args: argparse.Namespace) -> int:
    from reaper.cycle import Reaper
    from reaper.events import CycleCompleted
    from reaper.runs import AsOfRefused

    if not args.once:
        print(
            "reaper reap: only --once is supported here; the worker runs the schedule "
            "(celery -A reaper worker -B)",
            file=sys.stderr,
        )
        return 2
    as_of = _as_of(args)
    if isinstance(as_of, str):
        return _refuse(as_of)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        # finish the batch in flight, then stop: never leave one half-done
        signal.signal(signum, lambda *_: stop.set())
    from reaper import tracing
    from reaper.db import engine_of

    # A database that cannot be reached is one line and exit 1, as for every
    # other command, within REAPER_DATABASE_CONNECT_TIMEOUT: not a failed
    # cycle's log lines after one connect timeout per part that tries.
    with engine_of(settings).connect():
        pass
    tracing.configure()  # OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set, else off
    reaper = Reaper(settings, stop_event=stop, allow_mass_closure=args.allow_mass_closure)
    finished: list[CycleCompleted] = []
    reaper.bus.subscribe(CycleCompleted, finished.append)
    try:
        result = reaper.run_cycle(as_of)
    except AsOfRefused as exc:
        print(f"reaper: {exc}", file=sys.stderr)
        return 2
    finally:
        tracing.shutdown()  # flush
        reaper.bus.unsubscribe(CycleCompleted, finished.append)
    if settings.recorder_url:
        from reaper.recorder import StopPass

        # The stop signals of the rooms this cycle closed (and any other due),
        # by the code of the reaper.stop_recordings task, within budgets.stop_pass;
        # beside a worker's pass too (it holds no worker slot).
        StopPass(settings, bus=reaper.bus, stop_event=stop, exclusive=False).run()
    else:
        logs.log(
            logs.get_logger("cli"),
            "recorder.disabled",
            level=logging.WARNING,
            reason="REAPER_RECORDER_URL is unset: no recording stop signals were sent",
        )
    _print(result, as_json=args.json)
    end = finished[-1]
    if end.blocked:
        print(
            f"reaper: mass-closure guard: {', '.join(end.blocked)} ended nothing; "
            "rerun with --allow-mass-closure to end them anyway",
            file=sys.stderr,
        )
    return 1 if end.errors else 0


def cmd_relay(settings: Settings, args: argparse.Namespace) -> int:
    from reaper.db import engine_of
    from reaper.kafka import close_producer
    from reaper.relay import PASS_CONNECTIONS, Relay

    if not args.once:
        print(
            "reaper relay: only --once is supported here; the worker runs the relay "
            "(celery -A reaper worker -B)",
            file=sys.stderr,
        )
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        # settle the batches in flight, then stop: their rows are marked or rolled back
        signal.signal(signum, lambda *_: stop.set())
    engine = engine_of(settings)
    # The connections a pass holds at once, opened before it as a worker has them
    # from its previous pass (no database: one line, exit 1, main()).
    with contextlib.ExitStack() as held:
        for _ in range(PASS_CONNECTIONS):
            held.enter_context(engine.connect())
    relay = Relay(settings, stop_event=stop)
    # Connected before the pass, as a worker's producer is at every pass after its
    # first (it is kept for the process's life): the pass's duration_ms then counts
    # what a worker's pass does. Kafka unreachable: the pass meets it and says so.
    with contextlib.suppress(Exception):
        relay.producers.get().partitions_for(settings.conference_ended_topic)
    gc.freeze()  # start-up out of the pass's collections, as in a worker (reaper.lifecycle)
    try:
        result = relay.run()  # what reaper.relay_outbox runs
    finally:
        close_producer()  # flushes: nothing of this process stays in flight
    if result.kafka_unavailable:
        print(
            f"reaper: Kafka {settings.kafka_bootstrap_servers} could not be reached: "
            f"{result.published} published, {result.pending} still pending",
            file=sys.stderr,
        )
        return 1
    if result.lock_lost:
        print(
            "reaper: the relay pass lost its lock midway (see the relay.lock_lost log line): "
            f"{result.published} published; the pass that took over sends the rest",
            file=sys.stderr,
        )
        return 1
    if result.database_failed:
        print(
            f"reaper: the relay's database work failed: {result.published} published, "
            "see the relay.db_failed log line",
            file=sys.stderr,
        )
        return 1
    if result.skipped:
        print(
            "reaper: another relay pass is running (a worker's): this one only counted",
            file=sys.stderr,
        )
    data = result.to_json()
    if args.json:
        print(json.dumps(data, sort_keys=True))
    else:
        print(
            f"published {data['published']}, failed {data['failed']}, "
            f"parked {data['parked']}, pending {data['pending']}"
        )
    return 0


def _database_failed(settings: Settings, exc: Exception) -> int:
    from sqlalchemy import make_url

    from reaper.errors import describe
    from reaper.overview import safe_url

    password = make_url(settings.database_url).password  # the driver does not echo it; make sure
    print(
        f"reaper: database {safe_url(settings.database_url)} failed: "
        f"{describe(exc, secrets=[password])}",
        file=sys.stderr,
    )
    return 1


def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    from reaper.db import engine_of
    from reaper.overview import format_status, status

    data = status(engine_of(settings), settings)
    print(json.dumps(data, sort_keys=True) if args.json else format_status(data))
    return 0


def cmd_plan(settings: Settings, args: argparse.Namespace) -> int:
    from reaper.db import engine_of
    from reaper.overview import format_plan, plan

    as_of = _as_of(args)
    if isinstance(as_of, str):
        return _refuse(as_of)
    data = plan(engine_of(settings), settings, as_of, args.limit)
    print(json.dumps(data, sort_keys=True) if args.json else format_plan(data))
    return 0


def _as_of(args: argparse.Namespace) -> datetime | str | None:
    """``--as-of`` parsed (None when not given), or why it is refused: checked
    before anything else, so a bad one is one line and exit 2."""
    from reaper.clock import parse_as_of

    if args.as_of is None:
        return None
    try:
        return parse_as_of(args.as_of)
    except ValueError as exc:
        return f"--as-of: {exc}"


def _refuse(message: str) -> int:
    print(f"reaper: {message}", file=sys.stderr)
    return 2


def _controls(settings: Settings) -> Any:
    from reaper.control import Controls
    from reaper.db import engine_of

    return Controls(engine_of(settings), settings)


def cmd_pause(settings: Settings, args: argparse.Namespace) -> int:
    from reaper.clock import rfc3339
    from reaper.config import parse_duration

    try:
        for_ = parse_duration(args.for_) if args.for_ else None
    except ValueError as exc:
        return _refuse(f"--for: {exc}")
    if not args.reason.strip():
        return _refuse("--reason: a pause needs a reason")
    paused = _controls(settings).pause(args.phase and [args.phase], args.reason, for_)
    for p in paused:
        until = f"until {rfc3339(p.paused_until)}" if p.paused_until else "until resumed"
        print(f"paused {p.phase} {until} (by {p.paused_by}): {p.reason}")
    return 0


def cmd_resume(settings: Settings, args: argparse.Namespace) -> int:
    resumed = _controls(settings).resume(args.phase and [args.phase])
    for r in resumed:
        print(f"resumed {r.phase} (it was paused: {r.reason})")
    if not resumed:
        print("nothing was paused")
    return 0


def _windows(args: argparse.Namespace) -> dict[str, Any] | str:
    """The windows given to ``policy set``, parsed as the environment's are;
    or why one is refused."""
    from reaper.config import parse_duration
    from reaper.control import OPTIONS

    windows: dict[str, Any] = {}
    for name, option in OPTIONS.items():
        value = getattr(args, name)
        if value is None:
            continue
        try:
            windows[name] = parse_duration(value)
        except ValueError as exc:
            return f"{option}: {exc}"
    return windows


def cmd_policy_set(settings: Settings, args: argparse.Namespace) -> int:
    from reaper.control import PolicyRefused
    from reaper.overview import format_policy

    windows = _windows(args)
    if isinstance(windows, str):
        return _refuse(windows)
    try:
        fact = _controls(settings).set_policy(args.tenant, **windows)
    except PolicyRefused as exc:
        return _refuse(str(exc))
    print(f"set the policy of tenant {format_policy(fact, settings)} (by {fact.updated_by})")
    return 0


def cmd_policy_unset(settings: Settings, args: argparse.Namespace) -> int:
    from reaper.control import PolicyRefused
    from reaper.overview import format_policy

    try:
        fact = _controls(settings).unset_policy(args.tenant)
    except PolicyRefused as exc:
        return _refuse(str(exc))
    if fact is None:
        print(f"tenant {args.tenant} has no policy: nothing changed")
        return 1
    print(f"removed the policy of tenant {format_policy(fact, settings)}; it gets the defaults")
    return 0


def cmd_policy_list(settings: Settings, args: argparse.Namespace) -> int:
    from reaper.overview import format_policies, policies_json

    policies = _controls(settings).policies()
    if args.json:
        print(json.dumps(policies_json(policies), sort_keys=True))
    else:
        print(format_policies(policies, settings))
    return 0


def cmd_outbox_parked(settings: Settings, args: argparse.Namespace) -> int:
    from reaper.db import engine_of
    from reaper.overview import format_parked, parked

    rows = parked(engine_of(settings), settings, args.limit)
    print(json.dumps(rows, sort_keys=True) if args.json else format_parked(rows))
    return 0


def cmd_outbox_requeue(settings: Settings, args: argparse.Namespace) -> int:
    import uuid

    if args.event_id is not None:
        try:
            uuid.UUID(args.event_id)
        except ValueError:
            return _refuse(f"--event-id: {args.event_id!r} is not a UUID")
    count = _controls(settings).requeue(args.event_id)
    print(f"requeued {count} parked row{'' if count == 1 else 's'}")
    return 0 if count or args.all else 1


def cmd_outbox_discard(settings: Settings, args: argparse.Namespace) -> int:
    import uuid

    from reaper.control import DiscardRefused

    try:
        uuid.UUID(args.event_id)
    except ValueError:
        return _refuse(f"--event-id: {args.event_id!r} is not a UUID")
    if not args.reason.strip():
        return _refuse("--reason: a discard needs a reason")
    try:
        fact = _controls(settings).discard(args.event_id, args.reason)
    except DiscardRefused as exc:
        print(f"reaper: {exc}", file=sys.stderr)
        return 1
    print(
        f"discarded {fact.event_id} (deal {fact.message_key}, topic {fact.topic}) "
        f"by {fact.discarded_by} as {fact.discarded_login}: {fact.reason}; "
        "kept in messenger.outbox_discards"
    )
    return 0


# reaper reconcile's exit statuses (docs/delivery.md#exit-statuses), beside 1 (the
# database failed or refused), 2 (usage) and 3 (the schema, release.EXIT_SCHEMA).
EXIT_NOT_CLEAN = 4  # the ledger found something lost, unexpected, duplicated, ...
EXIT_KAFKA = 5  # the topic could not be read: no verdict on delivery


def cmd_reconcile(settings: Settings, args: argparse.Namespace) -> int:
    """The ledger over the rooms closed in [--since, --until) (docs/delivery.md)."""
    from sqlalchemy.exc import DBAPIError

    from reaper import budgets
    from reaper.control import operator
    from reaper.db import engine_of, transaction
    from reaper.errors import sqlstate
    from reaper.ledger import KafkaUnreadable, Ledger, lost_rooms, moment, parse_moment

    try:
        since_arg = parse_moment(args.since)
    except ValueError as exc:
        return _refuse(f"--since: {exc}")
    try:
        until_arg = parse_moment(args.until) if args.until else None
    except ValueError as exc:
        return _refuse(f"--until: {exc}")
    if args.reason is not None and not args.reason.strip():
        return _refuse("--reason: a republish needs a reason")
    engine = engine_of(settings)
    with transaction(engine, budgets.quick(settings)) as queries:
        now = queries.database_clock()
        may = queries.may_republish() if args.republish else None
    if may is not None and not may.allowed:
        print(
            f"reaper: --republish: login {may.login} may not put events back "
            "(messenger.republish_outbox is the reaper_operator role's only); "
            "run it as an operator login, or without --republish to only check",
            file=sys.stderr,
        )
        return 1
    since = moment(since_arg, now)
    until = moment(until_arg, now) if until_arg is not None else now
    if since >= until:
        return _refuse(f"--since {args.since} is not before --until ({until.isoformat()})")
    try:
        verdict = Ledger(settings, engine).check(since, until)
    except KafkaUnreadable as exc:
        print(f"reaper: Kafka could not be read, no verdict on delivery: {exc}", file=sys.stderr)
        return EXIT_KAFKA  # the metrics file keeps the last verdict; its window end ages
    logger = logs.get_logger("reconcile")
    for found in verdict.lost:
        logs.log(
            logger,
            "reconcile.lost",
            level=logging.WARNING,
            conference_id=found.conference_id,
            deal_id=found.deal_id,
            end_reason=found.end_reason,
        )
    counts = verdict.counts()
    logs.log(
        logger,
        "reconcile.checked",
        level=logging.INFO if verdict.ok else logging.WARNING,
        since=verdict.to_json()["since"],
        until=verdict.to_json()["until"],
        ok=verdict.ok,
        **counts,
    )
    republished: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    if args.republish:
        reason = (args.reason or "").strip() or (
            f"reaper reconcile --republish: lost between {verdict.to_json()['since']} "
            f"and {verdict.to_json()['until']}"
        )
        for found in lost_rooms(verdict):
            assert found.conference_id is not None  # a lost room is a room
            try:
                with transaction(engine, budgets.quick(settings)) as queries:
                    row = queries.republish_outbox(
                        found.conference_id,
                        settings.conference_ended_topic,
                        reason,
                        operator(settings),
                    )
            except DBAPIError as exc:
                if sqlstate(exc) not in ("55000", "P0002"):
                    raise
                refused.append({"conference_id": found.conference_id, "why": str(exc.orig)})
                continue
            done = {
                "conference_id": row.conference_id,
                "deal_id": row.deal_id,
                "event_id": row.event_id,
                "end_reason": row.end_reason,
            }
            republished.append(done)
            logs.log(
                logger,
                "reconcile.republished",
                level=logging.WARNING,
                by=row.republished_by,
                login=row.republished_login,
                reason=row.reason,
                **done,
            )
    if args.json:
        data = verdict.to_json()
        if args.republish:
            data["republished"] = republished
            data["republish_refused"] = refused
        print(json.dumps(data, sort_keys=True))
    else:
        for line in verdict.summary():
            print(line)
        for done in republished:
            print(
                f"republished conference {done['conference_id']} (deal {done['deal_id']}) "
                f"as event {done['event_id']}: the relay sends it"
            )
        for no in refused:
            print(f"not republished: conference {no['conference_id']}: {no['why'].strip()}")
    if args.metrics_file:
        from reaper import metrics
        from reaper.errors import describe

        try:
            metrics.write_reconcile(args.metrics_file, verdict)
        except OSError as exc:  # the verdict is printed; a file nobody can read is a failure
            print(f"reaper: --metrics-file: {describe(exc)}", file=sys.stderr)
            return 1
    return 0 if verdict.ok else EXIT_NOT_CLEAN


def cmd_sql(settings: Settings, args: argparse.Namespace) -> int:
    """A named statement as the query class sends it: its includes expanded,
    compiled for the configured database's driver, so its parameters are in the
    driver's style; and their names. Reads no database."""
    from reaper.db import engine_of
    from reaper.phases import IN_ORDER
    from reaper.queries import load

    statements = load(IN_ORDER)
    clause = statements.get(args.name)
    if clause is None:
        print(f"reaper sql: no statement {args.name!r}; the names:", file=sys.stderr)
        for name in sorted(statements):
            print(f"  {name}", file=sys.stderr)
        return 2
    compiled = clause.compile(dialect=engine_of(settings).dialect)
    print(f"-- {args.name}: parameters {', '.join(compiled.params) or '(none)'}")
    print(compiled.string)
    return 0


def _print(data: Mapping[str, Any], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(data, sort_keys=True))
        return
    width = max(len(k) for k in data)
    for key, value in data.items():
        print(f"{key:<{width}}  {value}")


def build_parser() -> argparse.ArgumentParser:
    from reaper.release import version

    parser = argparse.ArgumentParser(prog="reaper", description="Conference room reaper")
    parser.add_argument("--version", action="version", version=f"reaper {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    migrate = sub.add_parser(
        "migrate",
        help="apply this release's expand migrations (idempotent); --contract: its contract "
        "migrations, once every worker runs this release",
    )
    which = migrate.add_mutually_exclusive_group()
    which.add_argument(
        "--contract",
        action="store_true",
        help="apply this release's contract migrations (they break the release before it)",
    )
    which.add_argument("--revision", help="upgrade to exactly this revision (kinds unchecked)")
    migrate.set_defaults(handler=cmd_migrate)

    reap = sub.add_parser("reap", help="run one cycle in this process (no broker)")
    reap.add_argument("--once", action="store_true", help="run one cycle and exit")
    reap.add_argument("--as-of", help="the cycle's moment, RFC 3339 (default: now)")
    reap.add_argument("--json", action="store_true", help="print the result as JSON")
    reap.add_argument(
        "--allow-mass-closure",
        action="store_true",
        help="this run only: let stale_live end more than REAPER_MASS_CLOSURE_SHARE "
        "of the active conferences",
    )
    reap.set_defaults(handler=cmd_reap)

    relay = sub.add_parser(
        "relay", help="one outbox relay pass in this process (pending events to Kafka)"
    )
    relay.add_argument("--once", action="store_true", help="run one pass and exit")
    relay.add_argument("--json", action="store_true", help="print the result as JSON")
    relay.set_defaults(handler=cmd_relay)

    status = sub.add_parser(
        "status", help="per phase: eligible now and oldest; outbox backlog; the run lock"
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(handler=cmd_status)

    plan = sub.add_parser(
        "plan", help="dry run: what the next cycle would close, per phase, and why"
    )
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.add_argument("--as-of", help="the cycle's moment, RFC 3339 (default: now)")
    plan.add_argument(
        "--limit", type=int, default=100, help="conferences listed per phase (default 100)"
    )
    plan.set_defaults(handler=cmd_plan)

    from reaper.control import OPTIONS
    from reaper.phases import ORDER, PHASES

    phases = ORDER
    pause = sub.add_parser(
        "pause", help="stop a phase (all without --phase) changing anything, on every replica"
    )
    pause.add_argument("--phase", choices=phases, help="one phase (default: all three)")
    pause.add_argument(
        "--for", dest="for_", metavar="DURATION", help="end by itself after this (90, PT2H)"
    )
    pause.add_argument("--reason", required=True, help="why (shown by reaper status)")
    pause.set_defaults(handler=cmd_pause)

    resume = sub.add_parser("resume", help="end a pause (all phases without --phase)")
    resume.add_argument("--phase", choices=phases, help="one phase (default: all three)")
    resume.set_defaults(handler=cmd_resume)

    policy = sub.add_parser(
        "policy", help="windows per tenant: a tenant's own grace and timeouts (set, unset, list)"
    )
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    policy_set = policy_sub.add_parser(
        "set",
        help="set a tenant's windows (merged into its policy: a window not given keeps its value)",
    )
    policy_set.add_argument("--tenant", required=True, metavar="UUID", help="the tenant id")
    for phase in PHASES.values():
        policy_set.add_argument(
            OPTIONS[phase.setting],
            dest=phase.setting,
            metavar="DURATION",
            help=f"the tenant's {phase.name} window (90, PT10M; at most 7 days)",
        )
    policy_set.set_defaults(handler=cmd_policy_set)
    policy_unset = policy_sub.add_parser(
        "unset", help="remove a tenant's policy: its conferences get the defaults again"
    )
    policy_unset.add_argument("--tenant", required=True, metavar="UUID", help="the tenant id")
    policy_unset.set_defaults(handler=cmd_policy_unset)
    policy_list = policy_sub.add_parser("list", help="the tenant policies")
    policy_list.add_argument("--json", action="store_true", help="print JSON")
    policy_list.set_defaults(handler=cmd_policy_list)

    outbox = sub.add_parser(
        "outbox", help="integration events Kafka refused: list, requeue, discard"
    )
    outbox_sub = outbox.add_subparsers(dest="outbox_command", required=True)
    parked_cmd = outbox_sub.add_parser("parked", help="list the parked rows")
    parked_cmd.add_argument("--json", action="store_true", help="print JSON")
    parked_cmd.add_argument("--limit", type=int, default=1000, help="at most this many")
    parked_cmd.set_defaults(handler=cmd_outbox_parked)
    requeue = outbox_sub.add_parser("requeue", help="parked rows back to pending")
    which = requeue.add_mutually_exclusive_group(required=True)
    which.add_argument("--event-id", help="one row, by its eventId")
    which.add_argument("--all", action="store_true", help="every parked row")
    requeue.set_defaults(handler=cmd_outbox_requeue)
    discard = outbox_sub.add_parser(
        "discard",
        help="a parked row Kafka will never accept out of delivery for good (kept in "
        "messenger.outbox_discards); its deal's later events then go on",
    )
    discard.add_argument("--event-id", required=True, help="the parked row, by its eventId")
    discard.add_argument("--reason", required=True, help="why (kept with the row, logged)")
    discard.set_defaults(handler=cmd_outbox_discard)

    reconcile = sub.add_parser(
        "reconcile",
        help="the rooms closed in a window against the conference-ended events on Kafka "
        "(docs/delivery.md); changes nothing unless --republish",
    )
    reconcile.add_argument(
        "--since", required=True, help="a moment (RFC 3339) or a duration ago: 2h, 30m, 1d"
    )
    reconcile.add_argument("--until", help="as --since; default: now, by the database's clock")
    reconcile.add_argument("--json", action="store_true", help="print JSON")
    reconcile.add_argument(
        "--republish",
        action="store_true",
        help="put each lost event of a room the reaper ended back into the outbox "
        "(an operator login only)",
    )
    reconcile.add_argument("--reason", help="why, kept with each event put back (--republish)")
    reconcile.add_argument(
        "--metrics-file",
        metavar="PATH",
        help="also write the verdict as Prometheus metrics to PATH, e.g. a *.prom file "
        "in node_exporter's textfile directory (docs/delivery.md#metrics)",
    )
    reconcile.set_defaults(handler=cmd_reconcile)

    sql = sub.add_parser(
        "sql", help="a named statement, includes expanded, as the reaper sends it; its parameters"
    )
    sql.add_argument("name", help="the statement's name (a phase's: end_active_batch[empty_room])")
    sql.set_defaults(handler=cmd_sql)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = get_settings()
    logs.configure()
    # Only a worker counts into a multiprocess directory: this process keeps its
    # metrics in memory even if it inherited the variable (read at import).
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    from sqlalchemy.exc import SQLAlchemyError

    from reaper import wiring

    wiring.install(settings)
    try:
        # migrate makes the schema; sql reads only the statements' file
        if args.handler not in (cmd_migrate, cmd_sql):
            refused = _schema_refused(settings)
            if refused is not None:
                return refused
        code: int = args.handler(settings, args)
    except SQLAlchemyError as exc:
        # Every command says a database it could not use in this one line, exit 1.
        return _database_failed(settings, exc)
    return code


if __name__ == "__main__":
    sys.exit(main())
