"""One way to say what went wrong, in one line, without secrets."""

from __future__ import annotations

from collections.abc import Iterable

MAX_LENGTH = 500


def describe(exc: BaseException, *, secrets: Iterable[str | None] = ()) -> str:
    """``Type: first line of the message``, at most MAX_LENGTH characters.

    A SQLAlchemy error is described by the driver's error it wraps (``orig``):
    its message is what PostgreSQL said, without the statement and parameters
    SQLAlchemy appends. Any of ``secrets`` found in the text is masked.
    """
    inner = getattr(exc, "orig", None) or exc
    lines = str(inner).strip().splitlines()
    text = lines[0].strip() if lines else ""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return (f"{type(inner).__name__}: {text}" if text else type(inner).__name__)[:MAX_LENGTH]


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE PostgreSQL answered with, for a SQLAlchemy error whose driver
    error (``orig``) carries one; None for any other error."""
    code: str | None = getattr(getattr(exc, "orig", None), "pgcode", None)
    return code
