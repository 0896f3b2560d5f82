"""Private service instances a fault test may stop and restart without touching
the machine's shared ones: PostgreSQL 15 (initdb into a temp dir, its own port,
optionally TLS) and Redis (its own port, no persistence)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.support.ports import free_port, wait_for_port

PG_BIN = Path(os.environ.get("REAPER_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _as_postgres() -> list[str]:
    # initdb and postgres refuse to run as root
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class PrivatePostgres:
    def __init__(self, *, tls: bool = False, password_auth: bool = False) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="reaper-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.tls = tls
        # TCP clients must give a password (SCRAM), as in the postgres image;
        # the unix socket in self.root stays trusted for the test's own setup.
        self.password_auth = password_auth
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")

    def _run(self, *args: str) -> None:
        subprocess.run(
            [*_as_postgres(), *args], check=True, capture_output=True, cwd=self.root, timeout=60
        )

    def init(self) -> PrivatePostgres:
        self._run(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
            "-E",
            "UTF8",
            *(["--auth-host=scram-sha-256"] if self.password_auth else []),
        )
        if self.tls:
            self._make_certificates()
        return self.start()

    def _options(self) -> str:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        if self.tls:
            options += (
                f" -c ssl=on -c ssl_cert_file={self.root}/server.crt"
                f" -c ssl_key_file={self.root}/server.key"
            )
        return options

    def start(self) -> PrivatePostgres:
        self._run(
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.root / "log"),
            "-w",
            "-o",
            self._options(),
            "start",
        )
        wait_for_port(self.port)
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # not running
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def socket_url(self, database: str = "postgres") -> str:
        """As the superuser postgres over the unix socket (trusted)."""
        return f"postgresql+psycopg2://postgres@/{database}?host={self.root}&port={self.port}"

    def url(self, database: str = "reaper", user: str = "postgres", query: str = "") -> str:
        url = f"postgresql+psycopg2://{user}@127.0.0.1:{self.port}/{database}"
        return f"{url}?{query}" if query else url

    def _make_certificates(self) -> None:
        """A private CA and a server certificate for 127.0.0.1 / localhost."""
        r = self.root

        def ssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=r)

        ssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=test-ca",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        )
        ssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        )
        (r / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        ssl(
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "server.crt",
        )
        os.chmod(r / "server.key", 0o600)
        if os.geteuid() == 0:
            shutil.chown(r / "server.key", "postgres")
            shutil.chown(r / "server.crt", "postgres")


class PrivateRedis:
    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # a crash: no goodbye to the clients
            self.proc.wait(timeout=10)
        self.proc = None


def scrape(port: int) -> dict[str, float]:
    """The worker's /metrics as {'name{labels}': value}; empty when it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as resp:
            body = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout}s")
