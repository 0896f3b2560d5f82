"""Network faults a test injects and always undoes.

- :class:`SilentServer`: accepts TCP connections and never sends a byte (a
  server that hangs, or a load balancer with nobody behind it).
- :class:`Proxy`: relays TCP connections to a real service (PostgreSQL,
  Redis); :meth:`Proxy.cut` then drops every packet of the connections open
  through it at that moment, on both legs (client to proxy, proxy to service)
  and in both directions, with iptables. Nobody sees a reset or a FIN: the
  connections die silently, as after a failover, a dropped NAT entry or a
  partition, while NEW connections still pass.

Every iptables rule carries the comment ``reaper-test-<tag>`` (a tag of its
own per proxy), and :meth:`Proxy.close` deletes every rule with that comment
whatever happened before; the proxy's threads end at close too. Needs root and
Debian's ``iptables`` (scripts/setup installs it).
"""

from __future__ import annotations

import contextlib
import select
import shlex
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

# -w: wait for the xtables lock, which tests running in parallel share.
IPTABLES = ("iptables", "-w", "10")
COMMENT_PREFIX = "reaper-test-"
# How often a blocked thread looks whether it should stop: the longest close() waits per thread.
POLL = 0.2
# A relay that cannot reach its service within this fails the client's connection.
CONNECT_TIMEOUT = 5.0


class SilentServer:
    """Listens on 127.0.0.1 and accepts every connection; never reads, never answers."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(POLL)
        self.port: int = self._listener.getsockname()[1]
        self._accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="silent-server", daemon=True)

    def start(self) -> SilentServer:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            self._accepted.append(conn)

    @property
    def accepted(self) -> int:
        return len(self._accepted)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * POLL)
        self._listener.close()
        for conn in self._accepted:
            conn.close()

    def __enter__(self) -> SilentServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass
class Link:
    """One relayed connection: the client's leg (accepted) and the service's leg."""

    client: socket.socket
    upstream: socket.socket
    service_port: int = 0  # the service leg's local port, as the service sees the client
    cut: bool = False
    closed: threading.Event = field(default_factory=threading.Event)

    def port_pairs(self) -> list[tuple[int, int]]:
        """(source port, destination port) of every packet of both legs, both directions."""
        client_port, proxy_port = self.client.getpeername()[1], self.client.getsockname()[1]
        relay_port, service_port = self.upstream.getsockname()[1], self.upstream.getpeername()[1]
        return [
            (client_port, proxy_port),
            (proxy_port, client_port),
            (relay_port, service_port),
            (service_port, relay_port),
        ]


class Proxy:
    """A TCP relay from 127.0.0.1:``port`` to ``host:target_port``, owned by one test."""

    def __init__(self, host: str, target_port: int, *, name: str = "proxy") -> None:
        self.target = (host, target_port)
        self.tag = f"{COMMENT_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(POLL)
        self.port: int = self._listener.getsockname()[1]
        self._links: list[Link] = []
        # the local port of every service leg ever opened: how the service (its
        # pg_stat_activity, inet_client_port()) sees this proxy's clients
        self.service_ports: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # Cleared by pause(): bytes are still read (the kernel acknowledges them)
        # but not passed on, as a pooler with no server connection free does.
        self.passing = threading.Event()
        self.passing.set()
        self._ruled = False  # a rule was ever added: heal() must look for it

    # -- relaying ------------------------------------------------------------------

    def start(self) -> Proxy:
        self._spawn(self._accept, "accept")
        return self

    def _spawn(self, target: Callable[..., None], what: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"{self.tag}-{what}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT)
            except OSError:
                client.close()
                continue
            link = Link(client, upstream, service_port=upstream.getsockname()[1])
            with self._lock:
                self._links.append(link)
                self.service_ports.add(link.service_port)
            self._spawn(self._pump, "up", link, client, upstream)
            self._spawn(self._pump, "down", link, upstream, client)

    def _pump(self, link: Link, source: socket.socket, sink: socket.socket) -> None:
        """Copy one direction until its end closes, the link fails, or the proxy closes."""
        # poll, not select: select refuses a descriptor above 1024, which a long
        # campaign's process reaches (seen: after ten minutes every new link died)
        poller = select.poll()
        poller.register(source, select.POLLIN)
        try:
            while not self._stop.is_set() and not link.closed.is_set():
                if not poller.poll(POLL * 1000):
                    continue
                data = source.recv(65536)
                if not data:
                    break
                self.passing.wait()
                sink.sendall(data)
        except (OSError, ValueError):  # a reset, or the socket closed by close()
            pass
        link.closed.set()
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            # closed, not only shut down: a link's descriptors must not outlive it
            sock.close()

    def open_links(self) -> list[Link]:
        with self._lock:
            self._links = [link for link in self._links if not link.closed.is_set()]
            return list(self._links)

    # -- the fault -----------------------------------------------------------------

    def cut(self, service_ports: set[int] | None = None) -> int:
        """Drop every packet of the connections open now (or of those whose service
        leg has one of ``service_ports``), on both legs; new connections still
        pass. Returns how many connections were cut."""
        cut = 0
        for link in self.open_links():
            if link.cut:
                continue
            if service_ports is not None and link.service_port not in service_ports:
                continue
            try:
                pairs = link.port_pairs()
            except OSError:  # it closed meanwhile: nothing left to cut
                continue
            self._ruled = True
            for sport, dport in pairs:
                _iptables("-I", *self._rule(sport, dport))
            link.cut = True
            cut += 1
        return cut

    def drop_answers(self) -> int:
        """Drop only what the service sends on the connections open now (its
        answers and its acknowledgements): requests still arrive and are acted
        on, but the client never hears back, as in a one-way partition. Returns
        how many connections it hit; heal() undoes it like a cut."""
        hit = 0
        for link in self.open_links():
            if link.cut:
                continue
            try:
                relay_port, service_port = (
                    link.upstream.getsockname()[1],
                    link.upstream.getpeername()[1],
                )
            except OSError:  # it closed meanwhile
                continue
            self._ruled = True
            _iptables("-I", *self._rule(service_port, relay_port))
            link.cut = True
            hit += 1
        return hit

    def _rule(self, sport: int, dport: int) -> list[str]:
        return [
            "INPUT",
            "-i",
            "lo",
            "-p",
            "tcp",
            "--sport",
            str(sport),
            "--dport",
            str(dport),
            "-m",
            "comment",
            "--comment",
            self.tag,
            "-j",
            "DROP",
        ]

    def rules(self) -> list[str]:
        """This proxy's rules in the INPUT chain (``iptables -S`` lines)."""
        listed = _iptables("-S", "INPUT")
        return [line for line in listed.splitlines() if self.tag in shlex.split(line)]

    def pause(self) -> None:
        """Stop passing bytes on, both ways, while still reading them."""
        self.passing.clear()

    def resume(self) -> None:
        self.passing.set()

    def heal(self) -> None:
        """Delete every rule this proxy added (found by its comment)."""
        if not self._ruled:  # never cut: nothing to look for (and no iptables to run)
            return
        for line in self.rules():
            spec = shlex.split(line)
            _iptables("-D", *spec[1:])  # "-A INPUT ..." -> "-D INPUT ..."

    def close(self) -> None:
        """Rules first (they must never outlive the test), then every socket and thread."""
        try:
            self.heal()
        finally:
            self._stop.set()
            self.passing.set()
            self._listener.close()
            with self._lock:
                links = list(self._links)
            for link in links:
                link.closed.set()
                for sock in (link.client, link.upstream):
                    sock.close()
            for thread in self._threads:
                thread.join(timeout=5 * POLL)

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _iptables(*args: str) -> str:
    done = subprocess.run(
        [*IPTABLES, *args], capture_output=True, text=True, timeout=30, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"iptables {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout
