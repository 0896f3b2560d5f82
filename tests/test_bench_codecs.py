"""bench/codecs.py in its tiny mode: it seeds its own database, closes real rooms,
measures every codec and prints its tables. Only that every figure is there and
sane is checked here: which codec is faster or smaller is the bench's business,
never a unit test's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import PG_URL, ROOT, SESSION_TAG

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")


def rows_of(table: str, output: str) -> dict[str, list[str]]:
    """The codec rows of the markdown table that follows the line starting ``table``."""
    section = output.split(table, 1)[1].split("\n\n", 2)[1]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def number(cell: str) -> float:
    return float(re.sub(r"[,x]", "", cell.split()[0]))


@pytest.mark.process
def test_bench_codecs_tiny_prints_every_codec(database_url):
    env = {**os.environ, "REAPER_BENCH_PG": PG_URL}
    done = subprocess.run(
        [
            sys.executable,
            "bench/codecs.py",
            "--tiny",
            "--repeats",
            "1",
            "--database",
            f"reaper_bench_codecs_{SESSION_TAG}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    sizes = [line for line in out.splitlines() if line.startswith("| 12,000 roster rows")]
    assert [line.split("|")[2].strip() for line in sizes] == list(CODECS)
    per_row = rows_of("bytes per roster row", out)
    assert set(per_row) == set(CODECS)
    assert all(number(cells[0]) > 0 for cells in per_row.values())
    for table in ("relay, normal rooms", "relay, rooms of 12,000 roster rows"):
        rates = rows_of(table, out)
        assert set(rates) == set(CODECS), table
        assert rates["none"][1] == "1.00x" and rates["none"][3] == "1.00x"
        for cells in rates.values():
            events_per_s, bytes_per_event = number(cells[0]), number(cells[2])
            assert events_per_s > 0 and bytes_per_event > 0, (table, cells)
