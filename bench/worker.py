"""A real ``celery -A reaper worker`` draining the bench database, its RSS sampled."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from celery import Celery

from bench.broker import Tansu, create_topic
from bench.seed import one

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def worker_env(url: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "REAPER_BROKER_URL": os.environ.get("REAPER_BROKER_URL", "redis://127.0.0.1:6379/0"),
        "REAPER_DATABASE_URL": url,
        "REAPER_BROKER_KEY_PREFIX": f"reaper-bench-{uuid.uuid4().hex[:8]}:",
        "REAPER_METRICS_PORT": "0",
        **extra,
    }


@dataclass
class Drain:
    rooms: int
    # each round's drain, in order; the figure takes the best, as the in-process
    # drain it is compared with does
    seconds: list[float] = field(default_factory=list)
    # (round, rooms done in it, RSS of the pool child in KiB), sampled through every round
    samples: list[tuple[int, int, int]] = field(default_factory=list)

    def best_seconds(self) -> float:
        return min(self.seconds)

    def peak_kib(self) -> int:
        """The pool child's peak over every round."""
        return max((rss for _, _, rss in self.samples), default=0)

    def first_half_peak_kib(self) -> int:
        """Its peak over the first half of the first round: a worker that keeps
        memory from one batch or round to the next grows past it."""
        limit = self.rooms / 2
        return max((rss for n, done, rss in self.samples if n == 0 and done <= limit), default=0)


class Worker:
    TRACKED = (" ready.", '"cycle.completed"')

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        *,
        beat: bool = False,
        concurrency: int = 1,
        queues: str | None = None,
    ) -> None:
        self.env = env
        self.log_path = log_path
        self._pos = 0
        self._counts: dict[str, int] = {}
        args = [str(BIN / "celery"), "-A", "reaper", "worker", "-l", "INFO"]
        args += ["--concurrency", str(concurrency), "--without-gossip", "--without-mingle"]
        if queues:
            args += ["-Q", queues]
        args += ["-n", f"bench-{uuid.uuid4().hex[:6]}@%h"]
        if beat:
            args += ["-B", "-s", str(log_path.with_suffix(".schedule"))]
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self._sender: Celery | None = None

    def start(self, timeout: float = 60.0) -> Worker:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.wait_for(" ready.", timeout)
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def seen(self, needle: str) -> int:
        """How often ``needle`` is in the log so far (read incrementally: the log is large)."""
        with open(self.log_path, "rb") as log:
            log.seek(self._pos)
            chunk = log.read()
        complete = chunk.rfind(b"\n") + 1
        self._pos += complete
        for line in chunk[:complete].decode(errors="replace").splitlines():
            for tracked in self.TRACKED:
                if tracked in line:
                    self._counts[tracked] = self._counts.get(tracked, 0) + 1
        return self._counts.get(needle, 0)

    def wait_for(self, needle: str, timeout: float, count: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.seen(needle) >= count:
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker exited:\n{self.output()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{needle!r} x{count} not seen in {timeout}s:\n{self.output()[-3000:]}")

    def pool_pid(self) -> int:
        """The worker's pool child (the one process that drains), once it has forked."""
        assert self.proc is not None
        found: list[int] = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            # a thread may end between the listing and the read
            with suppress(FileNotFoundError, ProcessLookupError):
                found += [int(c) for c in (task / "children").read_text().split()]
        return found[0] if found else self.proc.pid

    def call(self, task: str) -> None:
        """Send ``task`` to the worker's queue from this process: as beat or a
        cycle's chain sends it, within milliseconds (``celery call`` would start a
        process of its own, a second or more inside the measured time)."""
        if self._sender is None:
            self._sender = Celery("bench-sender", broker=self.env["REAPER_BROKER_URL"])
            self._sender.conf.broker_transport_options = {
                "global_keyprefix": self.env["REAPER_BROKER_KEY_PREFIX"]
            }
        self._sender.send_task(task, queue="reaper", routing_key="reaper", expires=120)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self._sender is not None:
            self._sender.close()
        forget_broker_keys(self.env["REAPER_BROKER_KEY_PREFIX"])


@contextmanager
def relaying(url: str, log_path: Path, **env: str) -> Iterator[tuple[str, str]]:
    """A ``celery -A reaper worker -B`` (two pool processes) relaying to a private Tansu
    broker, to a topic of its own: the broker's address and the topic, once the
    worker is warm (its beat's first cycle completed); both stopped afterwards."""
    broker = Tansu().start()
    topic = f"bench.{log_path.stem}.{uuid.uuid4().hex[:8]}"
    worker = Worker(
        worker_env(
            url,
            REAPER_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
            REAPER_CONFERENCE_ENDED_TOPIC=topic,
            **env,
        ),
        log_path,
        beat=True,
        concurrency=2,
    )
    try:
        create_topic(broker.bootstrap, topic)
        worker.start()
        worker.wait_for('"cycle.completed"', 60)  # beat ticks, imports are warm
        yield broker.bootstrap, topic
    finally:
        worker.stop()
        broker.stop()


def forget_broker_keys(prefix: str) -> None:
    """Our own leftovers in the shared Redis (queued relay ticks): only our prefix."""
    import redis

    client = redis.Redis.from_url(os.environ.get("REAPER_BROKER_URL", "redis://127.0.0.1:6379/0"))
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def count(url: str, sql: str) -> int:
    return int(one(url, sql)[0])


def realtime_rows(url: str) -> int:
    return count(url, "SELECT count(*) FROM messenger.realtime_outbox")


def realtime_latest(url: str) -> int:
    """The id of the latest realtime row (one per closed room), from the index: a
    count(*) every 50 ms would take a good part of a core from the drain."""
    return count(url, "SELECT coalesce(max(id), 0) FROM messenger.realtime_outbox")


def open_runs(url: str) -> int:
    """Cycles that have not finished (messenger.reaper_runs)."""
    return count(url, "SELECT count(*) FROM messenger.reaper_runs WHERE finished_at IS NULL")


def drain(
    url: str,
    workdir: Path,
    expected: int,
    batch_size: int,
    timeout: float,
    prepare: Callable[[], None],
    rounds: int = 1,
) -> Drain:
    """Cycles sent to one running worker until ``expected`` rooms are closed, ``rounds``
    times over.

    The worker warms up on a quiet database (one cycle: imports, connections);
    before each round ``prepare`` puts the eligible rooms back, and only then is the
    round timed.
    """
    env = worker_env(url, REAPER_BATCH_SIZE=str(batch_size))
    # the reaper queue only: the drain's relay ticks wait (no Kafka here)
    worker = Worker(env, workdir / "worker-drain.log", queues="reaper").start()
    try:
        # one quiet cycle first: imports, connections and caches are warm
        worker.call("reaper.reap")
        worker.wait_for('"cycle.completed"', 60)
        result = Drain(rooms=expected)
        cycles = 1
        for n in range(rounds):
            prepare()
            result.samples.append((n, 0, rss_kib(worker.pool_pid())))  # warm and idle
            started = time.perf_counter()
            worker.call("reaper.reap")
            cycles += 1
            while True:
                done = realtime_latest(url)
                if done >= expected:  # ids can skip: the exact count decides
                    done = realtime_rows(url)
                result.samples.append((n, done, rss_kib(worker.pool_pid())))
                if done >= expected:
                    break
                if time.perf_counter() - started > timeout:
                    raise TimeoutError(f"worker drained {done} of {expected} in {timeout}s")
                if worker.seen('"cycle.completed"') >= cycles:
                    worker.call("reaper.reap")  # the cycle's time was spent: next one
                    cycles += 1
                time.sleep(0.05)
            result.seconds.append(time.perf_counter() - started)
            # The cycle's last task closes its run: a round begun before it, or a
            # worker stopped before it, would find the run still open and the
            # next cycle skipped until its lease ran out.
            deadline = time.perf_counter() + 60
            while open_runs(url) and time.perf_counter() < deadline:
                time.sleep(0.05)
        return result
    finally:
        worker.stop()
