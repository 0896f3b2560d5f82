"""A bound on waits the server cannot bound: shut the socket of a connection whose
wait outlived it.

PostgreSQL bounds what it works on (``statement_timeout``, ``lock_timeout``),
and TCP bounds a peer that stopped acknowledging (``tcp_user_timeout``,
keepalives). Neither bounds a wait in front of the server that is still
answered at the TCP level: a pooler in transaction mode (PgBouncer) with no
server connection free keeps a client waiting for as long as its own
``query_wait_timeout`` (two minutes by default), and a phase whose lanes wait
for a server connection that its own lock session holds waits for ever. The
first statement of every transaction is trivial on a server that has it
(the budget's ``set_config``), so :func:`bound` gives it a few seconds and, past
them, shuts the connection's socket down: the waiting call returns at once
with an error, and the pool discards the connection.

One daemon thread per process (started again after a fork) looks at the open
bounds four times a second; a bound costs the caller two dictionary operations.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# How often the thread looks at the open bounds: a bound ends within this late.
TICK_S = 0.25


class WaitExceeded(Exception):
    """A bounded wait ended by the watchdog (its socket was shut down)."""


@dataclass
class _Bound:
    deadline: float
    fd: int
    fired: bool = False


class Watchdog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bounds: dict[int, _Bound] = {}
        self._ids = itertools.count()
        self._pid = 0  # the process whose thread watches (none yet)
        # A fork copies the lock in whatever state the parent's thread had it.
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()
        self._bounds = {}

    @contextmanager
    def bound(self, fd: int, seconds: float) -> Iterator[None]:
        """Shut the socket ``fd`` down if the block is still running after ``seconds``;
        raises WaitExceeded (from the block's own error) when that happened."""
        key = next(self._ids)
        entry = _Bound(time.monotonic() + seconds, fd)
        with self._lock:
            self._watching()
            self._bounds[key] = entry
        try:
            yield
        except Exception as exc:
            if entry.fired:
                raise WaitExceeded(f"no answer within {seconds:g} s") from exc
            raise
        finally:
            with self._lock:
                del self._bounds[key]
        if entry.fired:  # it answered as the bound ran out: the socket is gone all the same
            raise WaitExceeded(f"no answer within {seconds:g} s")

    def _watching(self) -> None:
        """Start the thread in this process (under the lock)."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        threading.Thread(target=self._watch, name="reaper-watchdog", daemon=True).start()

    def _watch(self) -> None:
        pid = os.getpid()
        while self._pid == pid:
            time.sleep(TICK_S)
            now = time.monotonic()
            with self._lock:
                for entry in self._bounds.values():
                    if not entry.fired and now >= entry.deadline:
                        entry.fired = True
                        _shut(entry.fd)


def _shut(fd: int) -> None:
    """Shut the socket down for both directions; the owner of ``fd`` closes it."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed meanwhile: nothing left to end


watchdog = Watchdog()
