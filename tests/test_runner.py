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
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")),
            *("--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-q", str(suite)),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout and "a thread's assert" in done.stdout, done.stdout
