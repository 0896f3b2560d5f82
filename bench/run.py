"""The reaper against the physical limit: one command, one table.

    .venv/bin/python bench/run.py            # full sizes (100k eligible behind 1M finished)
    .venv/bin/python bench/run.py --quick    # 10x smaller, a few minutes
    .venv/bin/python bench/run.py --tiny     # seconds; what tests/test_bench_smoke.py runs
    .venv/bin/python bench/run.py --sustained [--quick | --tiny | --rooms N]
                                             # the relay over nine incidents (bench/sustained.py)

It seeds its own databases (``reaper_bench`` and ``reaper_bench_quiet`` by
default: dropped and re-created, migrated with ``reaper.db.migrate``), measures
every figure against its baseline in the same run, and prints one table:
figure, reaper, baseline, ratio, goal, pass/fail. ``--json PATH`` also writes
the rows (and the raw numbers) as JSON. Both databases hold ``--policies N``
tenant policies (default 1000, ``0`` for none; bench/seed.py POLICIES).
``--charts DIR`` also draws the incident's closings and events on Kafka over
time (``incident.png``; with ``--sustained``, the relay's rate per incident,
``sustained.png``): bench/charts.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# run as a script, bench/ itself is first on the path: the repository instead
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import baseline, charts, drain, e2e, incident, seed, sustained  # noqa: E402
from bench import relay as bench_kafka  # noqa: E402
from bench import worker as bench_worker  # noqa: E402
from bench.broker import Tansu, create_topic  # noqa: E402

PG = os.environ.get("REAPER_BENCH_PG", "postgresql+psycopg2://postgres@127.0.0.1:5432")
TOPIC = "pin.messenger.conference-ended.v1"


@dataclass(frozen=True)
class Sizes:
    eligible: int
    history: int
    quiet_small: int
    relay: int
    relay_small: int
    quiet_runs: int
    repeats: int
    e2e_rooms: int
    live_big: int  # the quiet cycle among this many live rooms, against quiet_small of them
    # the end-to-end rooms become eligible one after another over this many seconds
    e2e_spread_s: float = 10.0


SIZES = {
    "full": Sizes(
        100_000,
        1_000_000,
        10_000,
        50_000,
        5_000,
        quiet_runs=41,
        repeats=3,
        e2e_rooms=200,
        live_big=1_000_000,
    ),
    "quick": Sizes(
        10_000,
        100_000,
        10_000,
        5_000,
        500,
        quiet_runs=31,
        repeats=2,
        e2e_rooms=100,
        live_big=100_000,
    ),
    "tiny": Sizes(
        600,
        3_000,
        300,
        200,
        50,
        quiet_runs=5,
        repeats=1,
        e2e_rooms=20,
        live_big=3_000,
        e2e_spread_s=2.0,  # its 20 rooms at the full size's pace (200 over 10 s)
    ),
}


# rooms an incident of the sustained run (bench/sustained.py), by size
SUSTAINED_ROOMS = {"full": 50_000, "quick": 5_000, "tiny": 200}


@dataclass
class Row:
    figure: str
    reaper: float | None
    baseline: float | None
    unit: str
    goal: str
    check: Callable[[float], bool] | None = None
    ratio: float | None = None
    passed: bool | None = None
    note: str = ""

    def settle(self) -> Row:
        if self.reaper is not None and self.baseline:
            self.ratio = self.reaper / self.baseline
        if self.check is not None and self.ratio is not None:
            self.passed = self.check(self.ratio)
        return self


def fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.3f}"
    return f"{text} {unit}".strip()


def table(rows: list[Row]) -> str:
    header = ("figure", "reaper", "baseline", "ratio", "goal", "pass/fail")
    body = [
        (
            r.figure,
            fmt(r.reaper, r.unit),
            fmt(r.baseline, r.unit),
            "-" if r.ratio is None else f"{r.ratio:.2f}x",
            r.goal,
            "-" if r.passed is None else ("PASS" if r.passed else "FAIL"),
        )
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in [header, *body]) for i in range(len(header))]
    out = [" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    out.append("-+-".join("-" * w for w in widths))
    out += [" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in body]
    return "\n".join(out)


def say(message: str) -> None:
    print(f"[bench {datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


# -- figures -----------------------------------------------------------------


def drain_figures(url: str, sizes: Sizes, as_of: datetime, raw: dict) -> list[Row]:
    rows = []
    for batch_size in (100, 1000):
        best: dict[str, float] = {"reaper": 0.0, "baseline": 0.0}
        outcomes: dict[str, tuple] = {}
        for attempt in range(sizes.repeats):
            # alternate who goes first, so neither always gets the warmer cache
            order = ("baseline", "reaper") if attempt % 2 == 0 else ("reaper", "baseline")
            for side in order:
                seed.reset_eligible(url)
                if side == "baseline":
                    counts, seconds = baseline.drain(url, as_of, batch_size, TOPIC)
                else:
                    counts, seconds = drain.reaper_drain(url, as_of, batch_size, sizes.eligible)
                rooms = sum(counts.values())
                outcome = drain.outcome(url)
                if rooms != sizes.eligible or outcome[0] or outcome[1]:
                    raise RuntimeError(f"{side} left work undone: {counts} {outcome}")
                outcomes.setdefault(side, outcome)
                rate = rooms / seconds
                raw.setdefault("drain", []).append(
                    {"side": side, "batch_size": batch_size, "rooms": rooms, "seconds": seconds}
                )
                say(f"drain b={batch_size} {side}: {rooms} rooms in {seconds:.2f}s = {rate:,.0f}/s")
                best[side] = max(best[side], rate)
        if outcomes["reaper"] != outcomes["baseline"]:
            raise RuntimeError(f"the two sides did different work: {outcomes}")
        rows.append(
            Row(
                f"drain, batch {batch_size} (rooms/s)",
                best["reaper"],
                best["baseline"],
                "",
                ">= 1.0x",
                lambda r: r >= 1.0,
            )
        )
    return rows


def quiet_figure(
    big_url: str, small_url: str, sizes: Sizes, as_of: datetime, raw: dict, what: str = "finished"
) -> Row:
    """A whole cycle with nothing eligible (its census of the gauges included),
    on the big database against the small one."""
    for url in (big_url, small_url):  # warm: connections, plans, caches
        for _ in range(3):
            drain.quiet_cycle(url, as_of)
    big, small = [], []
    for _ in range(sizes.quiet_runs):  # interleaved, so drift hits both alike
        big.append(drain.quiet_cycle(big_url, as_of))
        small.append(drain.quiet_cycle(small_url, as_of))
    raw[f"quiet_{what}"] = {"big_s": big, "small_s": small}
    big_n = sizes.history if what == "finished" else sizes.live_big
    return Row(
        f"quiet cycle, {big_n:,} vs {sizes.quiet_small:,} {what} (ms)",
        statistics.median(big) * 1000,
        statistics.median(small) * 1000,
        "",
        "<= 1.2x",
        lambda r: r <= 1.2,
    )


def live_figure(
    database: str, sizes: Sizes, as_of: datetime, raw: dict, drop: bool, policies: int
) -> Row:
    """The quiet cycle among many live rooms (Active, occupied, recently active):
    it must cost what the eligible rows cost, not what the live ones do."""
    big_url, small_url = f"{PG}/{database}_live", f"{PG}/{database}_live_small"
    started = time.perf_counter()
    for url, count in ((big_url, sizes.live_big), (small_url, sizes.quiet_small)):
        seed.recreate(url)
        seed.seed_live(url, count, as_of)
        if policies:
            seed.seed_policies(url, policies)
    say(
        f"seeded {sizes.live_big:,} and {sizes.quiet_small:,} live rooms"
        f" in {time.perf_counter() - started:.1f}s"
    )
    try:
        return quiet_figure(big_url, small_url, sizes, as_of, raw, what="live")
    finally:
        if drop:
            seed.drop(big_url)
            seed.drop(small_url)


def reap_once_figure(url: str, raw: dict) -> Row:
    env = {**os.environ, "REAPER_DATABASE_URL": url, "REAPER_METRICS_PORT": "0"}
    reaper_bin = str(Path(sys.executable).parent / "reaper")

    def wall(args: list[str]) -> float:
        started = time.perf_counter()
        subprocess.run(
            args, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        return time.perf_counter() - started

    once = [wall([reaper_bin, "reap", "--once"]) for _ in range(5)]
    bare = [wall([sys.executable, "-c", "pass"]) for _ in range(5)]
    raw["reap_once"] = {"reap_once_s": once, "python_c_pass_s": bare}
    row = Row(
        "`reaper reap --once`, nothing to do (s)",
        statistics.median(once),
        statistics.median(bare),
        "",
        "< 1.5 s",
        note="baseline: `python -c pass`",
    ).settle()
    row.passed = row.reaper is not None and row.reaper < 1.5
    return row


def memory_figure(
    url: str, sizes: Sizes, workdir: Path, raw: dict, in_process: float | None
) -> list[Row]:
    seed.clear_eligible(url)  # the worker warms up on a quiet database
    result = bench_worker.drain(
        url,
        workdir,
        sizes.eligible,
        batch_size=1000,
        timeout=900,
        prepare=lambda: seed.reset_eligible(url),
        rounds=sizes.repeats,
    )
    raw["worker_drain"] = asdict(result)
    for seconds in result.seconds:
        say(
            f"worker drain: {result.rooms} rooms in {seconds:.1f}s"
            f" = {result.rooms / seconds:,.0f}/s"
        )
    rate = result.rooms / result.best_seconds()
    return [
        Row(
            "worker RSS: peak over every drain / over the first one's first half (MiB)",
            result.peak_kib() / 1024,
            result.first_half_peak_kib() / 1024,
            "",
            "<= 1.1x",
            lambda r: r <= 1.1,
        ),
        Row(
            "worker drain / in-process drain, batch 1000 (rooms/s), best of each",
            rate,
            in_process,
            "",
            ">= 0.9x",
            lambda r: r >= 0.9,
            note="reaper: a real `celery worker`; baseline: the same drain in process",
        ),
    ]


def relay_figures(url: str, sizes: Sizes, raw: dict, drain_b100: float | None) -> list[Row]:
    """`reaper relay --once` on a freshly written backlog (statistics of an empty
    outbox, never an ANALYZE in between) against kafka-python alone; then the relay's
    rate over the drain's, so an incident's events keep pace with its closings."""
    rows = []
    broker = Tansu().start()
    try:
        create_topic(broker.bootstrap, TOPIC)
        create_topic(broker.bootstrap, f"{TOPIC}.baseline")
        for count in (sizes.relay, sizes.relay_small):
            rate = base = given = 0.0
            for attempt in range(sizes.repeats):
                # alternate who goes first, as the drain's figures do
                order = ("baseline", "relay", "given")
                order = order if attempt % 2 == 0 else order[::-1]
                try:
                    pending = bench_kafka.fresh_backlog(url, count)
                    if pending != count:
                        raise RuntimeError(f"{pending} outbox rows to relay, wanted {count}")
                    alone: dict[str, float] = {}  # kafka-python alone, as it comes and given
                    for side in order:
                        if side in ("baseline", "given"):
                            alone[side] = bench_kafka.kafka_alone(
                                url,
                                broker.bootstrap,
                                f"{TOPIC}.baseline",
                                count,
                                partitions_given=side == "given",
                            )
                        else:
                            ours = bench_kafka.relay_once(url, broker.bootstrap, TOPIC, count)
                            # the same pass on the outbox it just emptied: what a pass
                            # costs whatever it relays (lock, empty claim, retention,
                            # gauges), which the baseline has no counterpart of
                            empty = bench_kafka.relay_once(url, broker.bootstrap, TOPIC, 0)
                finally:
                    bench_kafka.autovacuum_back(url)
                one_base, one_given = alone["baseline"], alone["given"]
                # the events over what the pass spent on them: less an empty pass
                one_rate = count / max(ours["pass_s"] - empty["pass_s"], 0.001)
                whole = count / ours["pass_s"]
                raw.setdefault("relay", []).append(
                    {
                        "events": count,
                        "relay_per_s": one_rate,
                        "relay_whole_pass_per_s": whole,
                        "empty_pass_s": empty["pass_s"],
                        "baseline_per_s": one_base,
                        "partitions_given_per_s": one_given,
                        **ours,
                        "native_crc": bench_kafka.native_crc(),
                    }
                )
                say(
                    f"relay {count:,}: {one_rate:,.0f} events/s (pass {ours['pass_s']:.2f}s"
                    f" less an empty pass {empty['pass_s']:.3f}s;"
                    f" process {ours['process_s']:.2f}s);"
                    f" kafka-python alone: {one_base:,.0f}/s; relay / kafka-python alone:"
                    f" {one_rate / one_base:.2f}x (whole pass {whole / one_base:.2f}x);"
                    f" kafka-python alone, partitions given as the relay gives them:"
                    f" {one_given:,.0f}/s ({one_rate / one_given:.2f}x)"
                )
                rate, base = max(rate, one_rate), max(base, one_base)
                given = max(given, one_given)
            rows.append(
                Row(
                    f"relay, {count:,} fresh events, `reaper relay --once` (events/s)",
                    rate,
                    base,
                    "",
                    ">= 0.8x",
                    lambda r: r >= 0.8,
                    note="the pass less an empty pass; baseline: kafka-python alone in its own"
                    " process, same records, one flush; best of each"
                    + ("" if bench_kafka.native_crc() else "; crc32c NOT installed"),
                )
            )
            rows.append(
                Row(
                    f"relay, {count:,} fresh events, against kafka-python alone with the"
                    " partitions given (events/s)",
                    rate,
                    given,
                    "",
                    "(info)",
                    note="baseline: kafka-python alone as above, each record's partition"
                    " hashed a batch at a time and given to send, as the relay does; best"
                    " of each",
                )
            )
    finally:
        broker.stop()
    if drain_b100:
        rows.append(
            Row(
                "relay over the drain, batch 100 (events/s vs rooms/s)",
                rows[0].reaper,
                drain_b100,
                "",
                ">= 1.0x",
                lambda r: r >= 1.0,
                note="baseline: the reaper's drain at batch 100, in process",
            )
        )
    return rows


def e2e_figures(url: str, workdir: Path, raw: dict, rooms: int, spread_s: float) -> list[Row]:
    seed.clear_eligible(url)  # no pending outbox rows from the drains
    interval = 2.0
    result = e2e.run(url, workdir, rooms=rooms, interval_s=interval, spread_s=spread_s)
    raw["e2e"] = result
    say(f"end to end: {result}")
    p99 = Row(
        f"end to end p99, interval {interval:g} s (s)",
        result["p99_s"],
        interval,
        "",
        "<= interval + 1 s",
        note="baseline: the polling interval; eligible -> record on Kafka (producer timestamp)",
    ).settle()
    p99.passed = result["p99_s"] <= interval + 1.0
    return [
        p99,
        Row("end to end median (s)", result["median_s"], interval, "", "(info)").settle(),
        Row("end to end max (s)", result["max_s"], interval, "", "(info)").settle(),
    ]


def incident_figure(
    url: str, sizes: Sizes, workdir: Path, raw: dict, charts_dir: Path | None
) -> Row:
    """Every eligible room at once under a real `worker -B` with Kafka: from the first
    closing to the last event on Kafka, over the first closing to the last closing."""
    result = incident.run(url, workdir, sizes.eligible, prepare=lambda: seed.reset_eligible(url))
    closings, on_kafka = result.pop("closings"), result.pop("on_kafka")  # the chart's, not JSON
    raw["incident"] = result
    say(f"incident: {result}")
    if charts_dir is not None:
        charts_dir.mkdir(parents=True, exist_ok=True)
        path = charts.incident_chart(
            charts_dir / "incident.png",
            closings,
            on_kafka,
            f"incident: {sizes.eligible:,} rooms on `celery -A reaper worker -B`",
        )
        say(f"chart: {path}")
    return Row(
        f"incident, {sizes.eligible:,} rooms on `worker -B`: to Kafka / to closed (s)",
        result["to_kafka_s"],
        result["to_closed_s"],
        "",
        "<= 1.1x",
        lambda r: r <= 1.1,
        note="from the first closing: to the last event on Kafka (its record's timestamp)"
        " / to the last closing",
    )


# -- main --------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="10x smaller sizes")
    mode.add_argument("--tiny", action="store_true", help="smoke-test sizes (seconds)")
    parser.add_argument("--database", default="reaper_bench", help="name of the bench database")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--drop", action="store_true", help="drop the bench databases at the end")
    parser.add_argument(
        "--only",
        default="drain,quiet,live,once,memory,relay,incident,e2e",
        help="comma-separated figures",
    )
    parser.add_argument(
        "--policies",
        type=int,
        default=1000,
        help="tenant policies in both seeded databases (default 1000; 0: none)",
    )
    parser.add_argument("--charts", type=Path, help="also draw the charts (PNG) into this folder")
    parser.add_argument(
        "--sustained",
        action="store_true",
        help="the relay over nine incidents through one outbox instead (bench/sustained.py)",
    )
    parser.add_argument(
        "--rooms",
        type=int,
        help="--sustained: rooms an incident (default 50,000; --quick 5,000; --tiny 200)",
    )
    parser.add_argument(
        "--vacuum-between",
        action="store_true",
        help="--sustained: a VARIANT with a plain VACUUM of the outbox after each incident",
    )
    parser.add_argument(
        "--baseline-marking",
        action="store_true",
        help="--sustained: the same incidents again with 0.3.0's marking relay, as a baseline",
    )
    parser.add_argument(
        "--incidents",
        type=int,
        default=sustained.INCIDENTS,
        help=f"--sustained: incidents before the held ones (default {sustained.INCIDENTS};"
        " fewer only to smoke-test the run)",
    )
    parser.add_argument(
        "--held",
        type=int,
        default=sustained.HELD_INCIDENTS,
        help=f"--sustained: incidents with a snapshot held (default {sustained.HELD_INCIDENTS})",
    )
    args = parser.parse_args(argv)
    if not args.database.startswith("reaper_bench"):
        parser.error("--database must start with reaper_bench (it is dropped and re-created)")
    if args.incidents < 1 or args.held < 0:
        parser.error("--incidents is at least 1, --held at least 0")
    size_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    sizes = SIZES[size_name]
    if args.sustained:
        rooms = args.rooms or SUSTAINED_ROOMS[size_name]
        workdir = Path(tempfile.mkdtemp(prefix="reaper-bench-"))
        sustained.run(
            f"{PG}/{args.database}_sustained",
            rooms,
            datetime.now(UTC).replace(microsecond=0),
            workdir,
            charts_dir=args.charts,
            json_path=args.json,
            vacuum_between=args.vacuum_between,
            baseline_marking=args.baseline_marking,
            drop=args.drop,
            say=say,
            normal=args.incidents,
            held=args.held,
        )
        return 0
    counts = (args.incidents, args.held) != (sustained.INCIDENTS, sustained.HELD_INCIDENTS)
    if args.rooms or args.vacuum_between or args.baseline_marking or counts:
        parser.error(
            "--rooms, --vacuum-between, --baseline-marking, --incidents and --held go with"
            " --sustained"
        )
    only = set(args.only.split(","))
    big_url = f"{PG}/{args.database}"
    small_url = f"{PG}/{args.database}_quiet"
    as_of = datetime.now(UTC).replace(microsecond=0)
    raw: dict = {
        "sizes": asdict(sizes),
        "mode": size_name,
        "as_of": as_of.isoformat(),
        "policies": args.policies,
    }
    rows: list[Row] = []
    workdir = Path(tempfile.mkdtemp(prefix="reaper-bench-"))
    drain.log_to(workdir / "reaper-in-process.log")
    live = max(sizes.eligible // 2, 100)
    try:
        started = time.perf_counter()
        say(f"seeding {size_name}: {sizes.history:,} finished + {live:,} live rooms")
        seed.recreate(big_url)
        seed.seed_history(big_url, sizes.history, as_of, live=live)
        seed.recreate(small_url)
        seed.seed_history(small_url, sizes.quiet_small, as_of, live=live)
        if args.policies:
            seed.seed_policies(big_url, args.policies)
            seed.seed_policies(small_url, args.policies)
        say(
            f"seeded history and {args.policies:,} tenant policies in"
            f" {time.perf_counter() - started:.1f}s"
        )
        if "quiet" in only:
            rows.append(quiet_figure(big_url, small_url, sizes, as_of, raw).settle())
        if "live" in only:
            rows.append(
                live_figure(
                    args.database, sizes, as_of, raw, drop=args.drop, policies=args.policies
                ).settle()
            )
        if "once" in only:
            rows.append(reap_once_figure(big_url, raw))
        seed.seed_eligible(big_url, sizes.eligible, as_of)
        drains: list[Row] = []
        if "drain" in only:
            drains = [r.settle() for r in drain_figures(big_url, sizes, as_of, raw)]
            rows += drains
        if "relay" in only:
            b100 = next((r.reaper for r in drains if "batch 100 " in r.figure), None)
            rows += [r.settle() for r in relay_figures(big_url, sizes, raw, b100)]
        if "memory" in only:
            b1000 = next((r.reaper for r in drains if "batch 1000 " in r.figure), None)
            rows += [r.settle() for r in memory_figure(big_url, sizes, workdir, raw, b1000)]
        if "incident" in only:
            rows.append(incident_figure(big_url, sizes, workdir, raw, args.charts).settle())
        if "e2e" in only:
            rows += e2e_figures(
                big_url, workdir, raw, rooms=sizes.e2e_rooms, spread_s=sizes.e2e_spread_s
            )
    finally:
        if args.drop:
            seed.drop(big_url)
            seed.drop(small_url)
    print(
        f"\nreaper bench ({size_name}: {sizes.eligible:,} eligible behind {sizes.history:,}"
        f" finished; quiet {sizes.history:,} vs {sizes.quiet_small:,}; relay {sizes.relay:,};"
        f" {args.policies:,} tenant policies)"
    )
    print(table(rows))
    for row in rows:
        if row.note:
            print(f"  {row.figure}: {row.note}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": [{k: v for k, v in asdict(r).items() if k != "check"} for r in rows],
                    "raw": raw,
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
