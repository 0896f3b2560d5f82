"""bench/run.py in its tiny mode: it seeds its own database, runs every figure and
prints its table. Only that the figures are there and sane is checked here:
ratios and pass/fail are the bench's business, never a unit test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sqlalchemy import create_engine, text

from tests.conftest import PG_URL, ROOT, SESSION_TAG

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


@pytest.mark.process
def test_bench_tiny_prints_every_figure(tmp_path, database_url):
    name = f"reaper_bench_smoke_{SESSION_TAG}"
    report = tmp_path / "bench.json"
    env = {**os.environ, "REAPER_BENCH_PG": PG_URL}
    done = subprocess.run(
        [
            sys.executable,
            "bench/run.py",
            "--tiny",
            "--drop",
            "--database",
            name,
            "--json",
            str(report),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    header, rule, *lines = done.stdout.strip().splitlines()[1:]
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
        assert any(p.startswith(figure) for p in printed), (figure, done.stdout)

    rows = {r["figure"]: r for r in json.loads(report.read_text())["rows"]}
    raw = json.loads(report.read_text())["raw"]
    for row in rows.values():
        assert row["reaper"] is None or row["reaper"] >= 0
    drains = [r for f, r in rows.items() if f.startswith("drain")]
    assert len(drains) == 2 and all(r["reaper"] > 0 and r["baseline"] > 0 for r in drains)
    assert all(d["rooms"] == raw["sizes"]["eligible"] for d in raw["drain"])
    quiet = next(r for f, r in rows.items() if f.startswith("quiet"))
    assert 0 < quiet["reaper"] < 10_000 and 0 < quiet["baseline"] < 10_000  # ms
    relays = [r for f, r in rows.items() if f.startswith("relay, ")]
    assert len(relays) == 2 and all(r["reaper"] > 0 and r["baseline"] > 0 for r in relays)
    sizes = raw["sizes"]
    assert [r["events"] for r in raw["relay"]] == [sizes["relay"], sizes["relay_small"]]
    incident = raw["incident"]
    assert incident["rooms"] == sizes["eligible"]
    assert 0 < incident["to_closed_s"] <= incident["to_kafka_s"]
    rss = next(r for f, r in rows.items() if f.startswith("worker RSS"))
    assert 10 < rss["baseline"] <= rss["reaper"] < 4096  # MiB
    assert raw["e2e"]["rooms"] == 20 and 0 <= raw["e2e"]["median_s"] <= raw["e2e"]["max_s"]

    # its own database, gone afterwards; never the tests' one
    admin = create_engine(f"{PG_URL}/postgres")
    with admin.connect() as conn:
        left = conn.execute(
            text("SELECT count(*) FROM pg_database WHERE datname LIKE :n"), {"n": f"{name}%"}
        ).scalar()
    admin.dispose()
    assert left == 0
    assert database_url.rsplit("/", 1)[1] != name
