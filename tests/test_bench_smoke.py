"""bench/run.py in its tiny mode: it seeds its own database, runs every figure and
prints its table; its sustained mode prints every incident and every goal; the
charts are PNG files. Only that the figures are there and sane is checked here:
ratios and pass/fail are the bench's business, never a unit test's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from sqlalchemy import create_engine, text

from bench import charts
from tests.conftest import PG_URL, ROOT, SESSION_TAG

pytestmark = pytest.mark.long  # minutes: started first (tests/support/runner.py)

FIGURES = (
    "quiet cycle",
    "`reaper reap --once`",
    "drain, batch 100",
    "drain, batch 1000",
    "relay, ",
    "relay over the drain",
    "worker RSS",
    "worker drain / in-process drain",
    "incident",
    "end to end p99",
)


def run_bench(script: str, *args: str) -> str:
    """A bench script on the tests' PostgreSQL; what it printed, once it exited 0."""
    done = subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        env={**os.environ, "REAPER_BENCH_PG": PG_URL},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.process
def test_bench_tiny_prints_every_figure(tmp_path, database_url):
    name = f"reaper_bench_smoke_{SESSION_TAG}"
    report = tmp_path / "bench.json"
    out = run_bench(
        "bench/run.py",
        *("--tiny", "--drop", "--database", name, "--json", str(report)),
        *("--charts", str(tmp_path / "charts")),
    )
    header, rule, *lines = out.strip().splitlines()[1:]
    assert [c.strip() for c in header.split("|")] == [
        "figure",
        "reaper",
        "baseline",
        "ratio",
        "goal",
        "pass/fail",
    ]
    assert set(rule) <= {"-", "+"}
    printed = [line.split("|")[0].strip() for line in lines if "|" in line]
    for figure in FIGURES:
        assert any(p.startswith(figure) for p in printed), (figure, out)

    rows = {r["figure"]: r for r in json.loads(report.read_text())["rows"]}
    raw = json.loads(report.read_text())["raw"]
    for row in rows.values():
        assert row["reaper"] is None or row["reaper"] >= 0
    drains = [r for f, r in rows.items() if f.startswith("drain")]
    assert len(drains) == 2 and all(r["reaper"] > 0 and r["baseline"] > 0 for r in drains)
    assert all(d["rooms"] == raw["sizes"]["eligible"] for d in raw["drain"])
    quiet = next(r for f, r in rows.items() if f.startswith("quiet"))
    assert 0 < quiet["reaper"] < 10_000 and 0 < quiet["baseline"] < 10_000  # ms
    relays = {f: r for f, r in rows.items() if f.startswith("relay, ")}
    # each size against kafka-python alone, and (info) against it with the partitions given
    assert sum("partitions given" in f for f in relays) == 2 and len(relays) == 4
    assert all(r["reaper"] > 0 and r["baseline"] > 0 for r in relays.values())
    sizes = raw["sizes"]
    assert [r["events"] for r in raw["relay"]] == [sizes["relay"], sizes["relay_small"]]
    assert all(r["partitions_given_per_s"] > 0 for r in raw["relay"])
    incident = raw["incident"]
    assert incident["rooms"] == sizes["eligible"]
    assert 0 < incident["to_closed_s"] <= incident["to_kafka_s"]
    rss = next(r for f, r in rows.items() if f.startswith("worker RSS"))
    assert 10 < rss["baseline"] <= rss["reaper"] < 4096  # MiB
    assert raw["e2e"]["rooms"] == 20 and 0 <= raw["e2e"]["median_s"] <= raw["e2e"]["max_s"]
    assert charts.is_png(tmp_path / "charts" / "incident.png")

    # its own database, gone afterwards; never the tests' one
    admin = create_engine(f"{PG_URL}/postgres")
    with admin.connect() as conn:
        left = conn.execute(
            text("SELECT count(*) FROM pg_database WHERE datname LIKE :n"), {"n": f"{name}%"}
        ).scalar()
    admin.dispose()
    assert left == 0
    assert database_url.rsplit("/", 1)[1] != name


def databases_named(name):
    admin = create_engine(f"{PG_URL}/postgres")
    with admin.connect() as conn:
        found = conn.execute(
            text("SELECT count(*) FROM pg_database WHERE datname LIKE :n"), {"n": f"{name}%"}
        ).scalar()
    admin.dispose()
    return found


@pytest.mark.process
def test_bench_sustained_prints_every_incident_and_goal(tmp_path, database_url):
    """Two incidents and one with a snapshot held, not six and three: each incident
    costs three processes (the relay's and kafka-python alone's on either side of
    it), and every kind of incident and goal is in two and one."""
    name = f"reaper_bench_smoke_sus_{SESSION_TAG}"
    report = tmp_path / "sustained.json"
    out = run_bench(
        "bench/run.py",
        *("--sustained", "--rooms", "100", "--incidents", "2", "--held", "1"),
        *("--drop", "--database", name),
        *("--json", str(report), "--charts", str(tmp_path / "charts")),
    )
    assert "3 incidents of 100 rooms through one outbox (cluster autovacuum: " in out
    rows = [line.split("|") for line in out.splitlines() if line[:1].isdigit() and "|" in line]
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    assert [r[1].strip() for r in rows] == ["-", "-", "held"]
    goals = [line for line in out.splitlines() if line.startswith("GOAL ")]
    expected = [
        "GOAL incident 2's relay rate over kafka-python alone's beside it >= 0.9x the first's: ",
        "GOAL incident 3 (held snapshot)'s relay rate over kafka-python alone's beside it"
        " >= 0.7x the first's: ",
        # held to 0.3.0's outbox after six incidents of 50,000 rooms, in proportion
        "GOAL outbox after 2 incidents <= 369 MiB at 50,000 rooms an incident",
    ]
    assert ", x1500 = " in goals[-1], goals[-1]  # 50,000 / 100 rooms, 6 / 2 incidents
    assert len(goals) == len(expected), out
    for goal, start in zip(goals, expected, strict=True):
        assert goal.startswith(start) and goal.endswith((" PASS", " FAIL")), goal
    info = [line for line in out.splitlines() if line.startswith("INFO incident ")]
    assert [line.split("'")[0] for line in info] == ["INFO incident 2", "INFO incident 3"]
    assert all(
        re.search(r"on its own, against the first's: \d+\.\d\dx \(one pass", i) for i in info
    )

    result = json.loads(report.read_text())
    incidents = result["incidents"]
    assert [i["held_snapshot"] for i in incidents] == [False, False, True]
    events = incidents[0]["events"]
    assert events > 0 and all(i["events"] == events and i["rows_left"] == 0 for i in incidents)
    assert all(i["relay_per_s"] > 0 and i["outbox_bytes"] > 0 for i in incidents)
    # kafka-python alone on each side of every relay pass, and the relay's WAL
    assert all(i["alone_before_per_s"] > 0 and i["alone_after_per_s"] > 0 for i in incidents)
    assert all(i["relay_wal_bytes"] > 0 and i["checkpoints"] >= 0 for i in incidents)

    # each incident's relay rate over kafka-python alone's beside it (the mean of
    # the two), against the first's: from the incident's own measured rates...
    def to_alone(i):
        return i["relay_per_s"] / ((i["alone_before_per_s"] + i["alone_after_per_s"]) / 2)

    first = to_alone(incidents[0])
    assert [i["ratio_to_alone"] for i in incidents] == pytest.approx(
        [to_alone(i) / first for i in incidents]
    )
    # ...and the rate goals (incidents 2 and 3) judge those very ratios
    for goal, inc in zip(goals[:2], incidents[1:], strict=True):
        floor = float(re.search(r">= (\d+\.\d+)x the first's", goal)[1])  # type: ignore[index]
        verdict = "PASS" if inc["ratio_to_alone"] >= floor else "FAIL"
        assert goal.endswith(f": {inc['ratio_to_alone']:.2f}x {verdict}"), (goal, inc)
    # the last incident's deleted rows stay dead versions: the held snapshot keeps
    # them from any vacuum or pruning
    assert incidents[-1]["dead_tuples"] >= events
    assert charts.is_png(tmp_path / "charts" / "sustained.png")
    assert databases_named(name) == 0
    assert database_url.rsplit("/", 1)[1] != name


def test_charts_are_written_as_png_files(tmp_path):
    incident = charts.incident_chart(
        tmp_path / "incident.png",
        closings=[100.0, 100.0, 100.5, 101.0],
        on_kafka=[100.2, 100.7, 101.1, 101.2],
        title="incident",
    )
    sustained = charts.sustained_chart(
        tmp_path / "sustained.png", [900.0, 950.0, 700.0], [False, False, True], "sustained"
    )
    for path in (incident, sustained):
        assert path.stat().st_size > 1000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert charts.is_png(path)
    not_png = tmp_path / "not.png"
    not_png.write_text("a text file")
    assert not charts.is_png(not_png)
