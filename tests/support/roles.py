"""Logins as a deployment makes them: a LOGIN role with a password, member of
one of the reaper's NOLOGIN roles (docs/deployment.md#logins-and-secrets)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, make_url, text


@contextmanager
def login(
    owner: Engine, database_url: str, role: str, prefix: str = "reaper_login"
) -> Iterator[str]:
    """A new LOGIN member of ``role``; yields its URL (password included).
    Dropped at the end, its sessions ended first."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    password = f"pw-{uuid.uuid4().hex}"
    with owner.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {name} LOGIN PASSWORD '{password}' IN ROLE {role}")
    try:
        url = make_url(database_url).set(username=name, password=password)
        yield url.render_as_string(hide_password=False)
    finally:
        with owner.begin() as conn:
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :n"),
                {"n": name},
            )
            conn.exec_driver_sql(f"DROP ROLE {name}")


def function_grants(engine: Engine, function: str) -> tuple[bool, bool, bool, bool, list[str]]:
    """Of a function (its regprocedure, e.g. ``messenger.f(uuid)``): whether
    reaper_worker, reaper_operator and PUBLIC may execute it, whether it runs as
    its definer, and its pinned settings (``proconfig``)."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT has_function_privilege('reaper_worker', CAST(:f AS regprocedure),"
                "        'EXECUTE'),"
                "       has_function_privilege('reaper_operator', CAST(:f AS regprocedure),"
                "        'EXECUTE'),"
                "       has_function_privilege('public', CAST(:f AS regprocedure), 'EXECUTE'),"
                "       p.prosecdef, p.proconfig"
                " FROM pg_proc p WHERE p.oid = CAST(:f AS regprocedure)"
            ),
            {"f": function},
        ).one()
    worker, operator, public, definer, config = row
    return worker, operator, public, definer, config
