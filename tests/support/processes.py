"""Real service processes for end-to-end tests: ``celery -A reaper worker -B``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).parent / "celery")


def wait_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1
) -> Any:
    """Poll until ``predicate()`` is truthy and return its value; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout}s")


class Worker:
    """A worker (with embedded beat unless ``beat=False``) as a subprocess."""

    def __init__(
        self,
        workdir: Path,
        env: dict[str, str] | None = None,
        *,
        beat: bool = True,
        name: str = "reaper",
        concurrency: int = 2,
        extra_args: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
        cwd: Path = ROOT,
    ) -> None:
        # cwd: the tree whose celeryconfig and package the worker loads (another
        # release's, extracted from git, with PYTHONPATH pointing at it)
        self.cwd = cwd
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        # prefix: a command the worker runs under (faketime for a clock that is off)
        args = [*prefix, CELERY, "-A", "reaper", "worker", "-l", "INFO", "-n", f"{name}@%h"]
        args += ["--concurrency", str(concurrency), "--without-gossip", "--without-mingle"]
        if beat:
            args += ["-B", "-s", str(workdir / f"{name}-beat-schedule")]
        self.args = args + list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout: float = 30.0, *, wait_ready: bool = True) -> Worker:
        """Start it; unless ``wait_ready`` is False (a worker that cannot reach its
        broker never says ready), wait for Celery's ``ready.`` line."""
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        # A process group of its own: stop() ends whatever the worker left behind
        # (a wrapper such as faketime forks the worker and does not pass SIGTERM on,
        # so the worker lived on and reaped in later tests' database).
        self.proc = subprocess.Popen(
            self.args,
            cwd=self.cwd,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if wait_ready:
            self.wait_for(lambda text: " ready." in text, ready_timeout, "worker ready")
        return self

    def alive(self) -> bool:
        """Any process of the worker's group still there (the worker, its pool, a wrapper)."""
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for(self, predicate: Callable[[str], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.output()):
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}):\n{self.output()}")
            time.sleep(0.1)
        raise TimeoutError(f"{what} not seen in {timeout}s:\n{self.output()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # pool children, a wrapped worker
            os.killpg(self.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.alive() and time.monotonic() < deadline:  # until init has reaped them
            time.sleep(0.05)
        self._log.close()
        return self.proc.returncode


REAPER = str(Path(sys.executable).parent / "reaper")


def children(pid: int) -> list[int]:
    """The process ids of ``pid``'s children (a worker's pool and its embedded beat)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:  # the process is gone
        return []
    for task in tasks:
        # A thread may end between the listing and the read (a worker starts one per
        # /healthz request): skip it, not the whole process (that lost every child
        # once, under the load of the parallel suite).
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``reaper ARGS...`` as an operator runs it, with this session's environment."""
    return subprocess.run(
        [REAPER, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
