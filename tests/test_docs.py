"""docs/design.md is the one list of the configuration and of the log events.

Its configuration table is held against :class:`reaper.config.Settings` (every
variable once, each default as the environment would give it), and its table
of log events against the events the sources can emit: every call of
:func:`reaper.logs.log` under ``reaper/``, read with :mod:`ast`, and every fact
declared with ``@logged`` (``reaper.events.LOGGED``). A setting or an event
added without a row here fails, and so does a row left for one removed.
"""

from __future__ import annotations

import ast
import logging
import os
import re
from pathlib import Path

import pytest

from reaper.config import ENV_PREFIX, Settings
from reaper.events import LOGGED
from tests.support.docs import table as docs_table

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SOURCES = ROOT / "reaper"

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def table(heading: str) -> list[list[str]]:
    """The rows (header and rule left out) of the first table under ``heading``."""
    return docs_table(DESIGN, heading)


def difference(what: str, documented: set[str], actual: set[str]) -> str:
    return (
        f"{what} in docs/design.md and in the code differ; "
        f"missing from the docs: {sorted(actual - documented)}; "
        f"documented but not in the code: {sorted(documented - actual)}"
    )


# -- configuration -------------------------------------------------------------


def documented_settings() -> dict[str, str]:
    """Variable -> its default cell, from the configuration table."""
    documented: dict[str, str] = {}
    for cells in table("Configuration"):
        names = re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[0])
        assert names, f"a configuration row names no variable: {cells}"
        for name in names:
            assert name not in documented, f"{name} is listed twice"
            documented[name] = cells[1]
    return documented


def test_every_setting_is_documented_and_nothing_else():
    coded = {ENV_PREFIX + field.upper() for field in Settings.model_fields}
    documented = set(documented_settings())
    assert documented == coded, difference("The variables", documented, coded)


def test_every_documented_default_is_the_default(monkeypatch: pytest.MonkeyPatch):
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    defaults = Settings()

    absent = {"unset": None, "empty": ""}
    for name, cell in documented_settings().items():
        field = name.removeprefix(ENV_PREFIX).lower()
        if cell in absent:
            assert getattr(defaults, field) == absent[cell], (name, cell, getattr(defaults, field))
            continue
        value = re.fullmatch(r"`([^`]*)`", cell)
        assert value, f"{name}: the default {cell!r} is neither `a value` nor unset nor empty"
        monkeypatch.setenv(name, value.group(1))
    # the documented defaults, as the environment gives them, make the same settings
    as_documented = Settings()

    wrong = {
        ENV_PREFIX + field.upper(): (getattr(as_documented, field), getattr(defaults, field))
        for field in Settings.model_fields
        if getattr(as_documented, field) != getattr(defaults, field)
    }
    assert not wrong, f"documented default, default: {wrong}"


# -- log events ----------------------------------------------------------------


def is_log_call(node: ast.Call) -> bool:
    """``log(...)`` or ``logs.log(...)``: reaper.logs.log, the one way a line is logged."""
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "log"
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "log"
        and isinstance(func.value, ast.Name)
        and func.value.id == "logs"
    )


def literal_levels(node: ast.expr | None) -> set[str] | None:
    """The levels a ``level=`` argument can take; None when it is computed."""
    if node is None:
        return {"INFO"}  # log()'s default
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return {logging.getLevelName(node.value)}
    if isinstance(node, ast.Attribute) and node.attr in LEVELS:
        return {node.attr}
    if isinstance(node, ast.IfExp):
        body, orelse = literal_levels(node.body), literal_levels(node.orelse)
        if body is not None and orelse is not None:
            return body | orelse
    return None


def variants(name: ast.expr | None, level: ast.expr | None) -> list[tuple[str, set[str] | None]]:
    """The (event name, levels) a call can log; [] when the name is not written out.
    A name and a level chosen by the same condition are read branch by branch."""
    if isinstance(name, ast.Constant) and isinstance(name.value, str):
        return [(name.value, literal_levels(level))]
    if isinstance(name, ast.IfExp):
        if isinstance(level, ast.IfExp) and ast.dump(level.test) == ast.dump(name.test):
            body_level: ast.expr | None = level.body  # the same choice
            orelse_level: ast.expr | None = level.orelse
        else:
            body_level = orelse_level = level
        body = variants(name.body, body_level)
        orelse = variants(name.orelse, orelse_level)
        if body and orelse:
            return body + orelse
    return []


# The one call whose name is not written out: eventlog.writer, which logs the
# facts declared with @logged under the name each declares (read below).
DECLARED_WRITER = ("reaper/eventlog.py", "declared.event")


def emitted_events() -> dict[str, set[str] | None]:
    """Event name -> the levels it is logged at (None: computed), from every call of
    reaper.logs.log under reaper/ and every fact declared with @logged. A name
    that is not written out (in a call or a declaration) fails here: the names
    are an interface, and a reader (or this test) must be able to find them."""
    events: dict[str, set[str] | None] = {}
    unreadable: list[str] = []

    def add(name: str, levels: set[str] | None) -> None:
        known = events.get(name, set())
        events[name] = None if levels is None or known is None else known | levels

    writers = 0
    for path in sorted(SOURCES.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and is_log_call(node)):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            argument = node.args[1] if len(node.args) > 1 else keywords.get("event")
            if argument is not None and (where, ast.unparse(argument)) == DECLARED_WRITER:
                writers += 1
                continue
            logged = variants(argument, keywords.get("level"))
            if not logged:
                unreadable.append(f"{where}:{node.lineno}")
            for name, levels in logged:
                add(name, levels)
    assert not unreadable, f"log calls whose event name is not a string literal: {unreadable}"
    assert writers == 1, f"{DECLARED_WRITER}: expected the one writer of declared facts"
    for declared in LOGGED.values():
        add(declared.event, {logging.getLevelName(declared.level)})
    return events


def documented_events() -> dict[str, str]:
    """Event name -> its level cell, from the table of log events."""
    documented: dict[str, str] = {}
    for cells in table("Log events"):
        name = re.fullmatch(r"`([a-z_]+\.[a-z_]+)`", cells[0])
        assert name, f"a log event row does not start with `area.event`: {cells}"
        assert name.group(1) not in documented, f"{name.group(1)} is listed twice"
        documented[name.group(1)] = cells[1]
    return documented


def test_every_log_event_is_documented_and_nothing_else():
    emitted = set(emitted_events())
    documented = set(documented_events())
    assert documented == emitted, difference("The log events", documented, emitted)


def test_every_declared_fact_is_documented_with_its_fields():
    """A fact declared with @logged is in the table, at its level, and its row
    names every field it logs."""
    rows = {cells[0].strip("`"): " ".join(cells[1:]) for cells in table("Log events")}
    wrong = {}
    for fact_type, declared in LOGGED.items():
        row = rows.get(declared.event, "")
        named = set(re.findall(r"`([a-z_]+)`", row))
        missing = [name for name in declared.fields if name not in named]
        if not row or missing:
            wrong[fact_type.__name__] = (declared.event, row or "no row", missing)
    assert not wrong, f"fact: (event, documented, fields missing from its row): {wrong}"


def test_every_log_event_is_documented_at_its_levels():
    documented = documented_events()
    wrong = {}
    for name, levels in emitted_events().items():
        stated = set(re.findall(r"\b(?:" + "|".join(LEVELS) + r")\b", documented.get(name, "")))
        # a computed level is not read here: the row must at least name one level
        if (levels is not None and stated != levels) or not stated:
            wrong[name] = (documented.get(name), sorted(levels) if levels else "computed")
    assert not wrong, f"event: (documented level, level in the code): {wrong}"


def test_nothing_logs_around_reaper_logs_log():
    """A line logged by a logger's own methods has no event name, and the scan
    above would not see it."""
    methods = {"debug", "info", "warning", "error", "exception", "critical", "log"}
    direct = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted(SOURCES.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in methods
        and isinstance(node.func.value, ast.Name)
        and (node.func.value.id == "logging" or node.func.value.id.endswith("logger"))
    ]
    assert not direct, f"log lines without an event name (use reaper.logs.log): {direct}"
