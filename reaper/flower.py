"""Flower's set-up: it refuses to start without basic auth.

The check waits until Flower has parsed its options (``FLOWER_BASIC_AUTH``,
the command line, its config file), so an empty ``--basic-auth=`` cannot
switch auth off. Flower never touches the worker's metrics directory.
"""

from __future__ import annotations

import os
import sys

from reaper import multiproc

FLOWER_AUTH_ENV = "FLOWER_BASIC_AUTH"


def prepare() -> None:
    """At app load, in every process that loads it: Flower's checks wait for its options."""
    from tornado.options import options

    options.add_parse_callback(_flower_options_parsed)


def auth_problem(value: str | list[str] | None) -> str | None:
    """Why a basic-auth setting is unusable, or None when it is fine."""
    entries = value.split(",") if isinstance(value, str) else list(value or [])
    entries = [e.strip() for e in entries]
    if not entries or entries == [""]:
        return "is not set"
    for entry in entries:
        user, sep, password = entry.partition(":")
        if not sep or not user or not password:
            return "must be user:password[,user:password...] with a non-empty password"
    return None


def _refuse(problem: str) -> None:
    print(
        f"reaper: refusing to start Flower: {FLOWER_AUTH_ENV} {problem} "
        "(without auth anyone who reaches it can revoke and terminate tasks)",
        file=sys.stderr,
    )
    raise SystemExit(2)


def _flower_options_parsed() -> None:
    """Tornado calls this when a program parses its options: only Flower does.

    By then Flower has applied ``FLOWER_BASIC_AUTH`` and its command line, so
    an empty ``--basic-auth=`` cannot switch auth off. Flower creates its own
    Prometheus metrics later, on its first event: here they are kept out of a
    worker's multiprocess directory it may have inherited.
    """
    from tornado.options import options

    if "basic_auth" not in options:
        return  # not Flower
    problem = auth_problem(options.basic_auth)
    if problem and not auth_problem(os.environ.get(FLOWER_AUTH_ENV)):
        problem = problem.replace("is not set", "was emptied by an option")
    if problem:
        _refuse(problem)
    multiproc.keep_out_of_multiprocess()
