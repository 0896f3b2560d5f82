"""The suite's own runner (tests/support/runner.py), run as scripts/test runs it:
two processes, a file to each. A test marked ``alone`` has nothing beside it;
the others do run side by side; figures reach the summary from either process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each test writes when it ran (monotonic, the same clock for both processes).
TIMED = """
import time, pathlib, pytest
from tests.support.figures import figure

def ran(name, seconds, out=pathlib.Path({out!r})):
    started = time.monotonic()
    time.sleep(seconds)
    (out / name).write_text(f"{{started}} {{time.monotonic()}}")
"""


@pytest.mark.process
def test_an_alone_test_runs_by_itself_and_the_others_side_by_side(tmp_path):
    out = tmp_path / "ran"
    out.mkdir()
    suite = tmp_path / "suite"
    suite.mkdir()
    header = TIMED.format(out=str(out))
    (suite / "test_a.py").write_text(
        header
        + textwrap.dedent(
            """
            def test_a1():
                ran("a1", 2)
                figure("a1 slept  2 s")

            @pytest.mark.alone
            def test_a2_alone():
                ran("a2", 1)
            """
        )
    )
    (suite / "test_b.py").write_text(
        header
        + textwrap.dedent(
            """
            def test_b1():
                ran("b1", 2)

            def test_b2():
                ran("b2", 2)
            """
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-p",
            "tests.support.runner",
            "-n",
            "2",
            "--dist",
            "loadfile",
            "-q",
            str(suite),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    spans = {p.name: tuple(map(float, p.read_text().split())) for p in out.iterdir()}
    assert set(spans) == {"a1", "a2", "b1", "b2"}

    def overlap(x: str, y: str) -> bool:
        return spans[x][0] < spans[y][1] and spans[y][0] < spans[x][1]

    assert overlap("a1", "b1") or overlap("a1", "b2")  # the two processes ran side by side
    assert not any(overlap("a2", other) for other in ("a1", "b1", "b2")), spans
    assert "test_a.py::test_a1: a1 slept 2 s" in done.stdout  # from a worker process


@pytest.mark.process
def test_a_thread_that_fails_fails_its_test(tmp_path):
    """A test whose helper thread raises fails, even when the test's own asserts
    hold (its other threads did the work): pytest alone would only warn."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_thread.py").write_text(
        textwrap.dedent(
            """
            import threading

            def test_threads():
                done = []

                def work(index):
                    assert index != 1, "a thread's assert"
                    done.append(index)

                threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                assert done == [0]
            """
        )
    )
    done = pytest_run(tmp_path, "-p", "no:cacheprovider", "-q", str(suite))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout and "a thread's assert" in done.stdout, done.stdout


def pytest_run(rootdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest in a process of its own, with this project's settings, on ``rootdir``."""
    return subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")),
            *("--rootdir", str(rootdir), *args),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def started_order(tmp_path: Path, *dist: str) -> list[str]:
    """The order in which one process started the tests of three files: test_a
    (three tests), test_b (two) and test_z, marked ``long`` (one)."""
    out = tmp_path / "-".join(dist or ("plain",))
    out.mkdir()
    suite = out / "suite"
    suite.mkdir()
    header = TIMED.format(out=str(out))
    for name, tests, mark in (
        ("a", 3, ""),
        ("b", 2, ""),
        ("z", 1, "pytestmark = pytest.mark.long"),
    ):
        body = "".join(f"\ndef test_{name}{i}():\n    ran('{name}{i}', 0)\n" for i in range(tests))
        (suite / f"test_{name}.py").write_text(f"{header}\n{mark}\n{body}")
    done = pytest_run(
        out,
        "-p",
        "tests.support.runner",
        "-p",
        "no:cacheprovider",
        "-n",
        "1",
        *dist,
        "-q",
        str(suite),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    spans = {p.name: float(p.read_text().split()[0]) for p in out.iterdir() if p.is_file()}
    return sorted(spans, key=spans.__getitem__)


@pytest.mark.process
def test_a_long_file_starts_first(tmp_path):
    """As scripts/test runs the suite, the file marked ``long`` starts before the
    others; with pytest-xdist's own order (most tests first) it would start last,
    alone at the end while the other process sits idle."""
    exec_line = (ROOT / "scripts" / "test").read_text().split("exec ", 1)[1]
    assert "--dist loadfile --no-loadscope-reorder" in exec_line
    ours = started_order(tmp_path, "--dist", "loadfile", "--no-loadscope-reorder")
    assert ours == ["z0", "a0", "a1", "a2", "b0", "b1"], ours
    xdists = started_order(tmp_path, "--dist", "loadfile")
    assert xdists[-1] == "z0", xdists
