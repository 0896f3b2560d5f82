"""A private PgBouncer in transaction pooling mode (or session mode), in front
of the session's test database (docs/design.md#behind-pgbouncer).

Its own configuration, auth file, log and pid file live in a temporary
directory; it listens on 127.0.0.1 at a free port and is always stopped by its
owner (a fixture's teardown). A missing ``pgbouncer`` fails the test: it is
installed by scripts/setup (Debian's ``pgbouncer`` package).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg2
from sqlalchemy import make_url

from tests.support.ports import free_port, wait_for_port

# Debian installs it in /usr/sbin, which is not on every user's PATH.
PGBOUNCER = os.environ.get("REAPER_TEST_PGBOUNCER") or shutil.which(
    "pgbouncer", path=f"{os.environ.get('PATH', '')}:/usr/sbin"
)
# How long a stop waits for PgBouncer to end before it is killed.
STOP_WAIT_S = 10.0


def _as_postgres() -> list[str]:
    # PgBouncer refuses to run as root: it switches to this user itself.
    return ["-u", "postgres"] if os.geteuid() == 0 else []


class PgBouncer:
    """``PgBouncer(database_url, pool_size=4).start()``; ``url`` is the same
    database through PgBouncer; ``stop()`` ends it (idempotent)."""

    def __init__(self, database_url: str, *, pool_size: int = 8, mode: str = "transaction") -> None:
        if PGBOUNCER is None:
            raise RuntimeError("pgbouncer is not installed (scripts/setup installs it)")
        self.target = make_url(database_url)
        self.pool_size = pool_size
        self.mode = mode  # pool_mode: transaction, or session
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="reaper-pgbouncer-"))
        self.log_path = self.root / "pgbouncer.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The test database's URL, through PgBouncer."""
        return self.target.set(host="127.0.0.1", port=self.port).render_as_string(
            hide_password=False
        )

    def config(self) -> str:
        user = self.target.username or "postgres"
        database = self.target.database
        server = f"host={self.target.host or '127.0.0.1'} port={self.target.port or 5432}"
        return f"""\
[databases]
{database} = {server} dbname={database}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
; no Unix socket: several PgBouncers of parallel test sessions share /tmp
unix_socket_dir =
auth_type = trust
auth_file = {self.root / "userlist.txt"}
admin_users = {user}
pool_mode = {self.mode}
default_pool_size = {self.pool_size}
max_client_conn = 200
logfile = {self.log_path}
pidfile = {self.root / "pgbouncer.pid"}
; libpq (psycopg2) sends no startup parameter PgBouncer does not know:
; application_name is one it tracks, and connect_timeout, keepalives* and
; tcp_user_timeout are the client's own. So no ignore_startup_parameters:
; a client that needed it would fail these tests instead of being hidden.
"""

    def start(self) -> PgBouncer:
        user = self.target.username or "postgres"
        (self.root / "userlist.txt").write_text(f'"{user}" ""\n')
        ini = self.root / "pgbouncer.ini"
        ini.write_text(self.config())
        if os.geteuid() == 0:  # it runs as postgres and writes its log and pid here
            for path in (self.root, ini, self.root / "userlist.txt"):
                shutil.chown(path, "postgres")
        self._output = open(self.root / "stdout.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(PGBOUNCER), *_as_postgres(), str(ini)],
            stdout=self._output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_port(self.port, timeout=10)
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"pgbouncer did not start:\n{self.output()}") from None
        return self

    def output(self) -> str:
        # In the foreground PgBouncer writes every line of its log to stderr too,
        # and what it says before it opens its log file only there.
        out = self.root / "stdout.log"
        return out.read_text(errors="replace") if out.exists() else ""

    def connect(self, database: str | None = None) -> psycopg2.extensions.connection:
        """A client connection through PgBouncer (another client than the reaper)."""
        return psycopg2.connect(
            host="127.0.0.1",
            port=self.port,
            dbname=database or self.target.database,
            user=self.target.username or "postgres",
            connect_timeout=5,
        )

    def admin(self, command: str) -> list[dict[str, Any]]:
        """A command of PgBouncer's admin console (``SHOW SERVERS``...), as rows."""
        conn = self.connect("pgbouncer")
        try:
            conn.autocommit = True  # the console knows no transactions
            with conn.cursor() as cur:
                cur.execute(command)
                names = [c.name for c in cur.description or ()]
                return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        finally:
            conn.close()

    def server_pids(self) -> set[int]:
        """The backend pids of every server connection PgBouncer holds to the database."""
        return {
            int(row["remote_pid"])
            for row in self.admin("SHOW SERVERS")
            if row["database"] == self.target.database
        }

    def waiting_clients(self) -> int:
        """Clients of the database waiting for a server connection (``SHOW POOLS``)."""
        return sum(
            int(row["cl_waiting"])
            for row in self.admin("SHOW POOLS")
            if row["database"] == self.target.database
        )

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)  # at once: a test is over
                try:
                    self.proc.wait(timeout=STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=STOP_WAIT_S)
            self._output.close()
            self.proc = None
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
