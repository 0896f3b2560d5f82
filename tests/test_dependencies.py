"""The lock and the ranges it comes from (docs/dependencies.md). Fast: files
and this interpreter's own installed distributions only.

- uv.lock is the resolution of pyproject.toml's ranges as they are now;
- the environment running the tests holds exactly what the lock pins for
  development (the service and the dev extra), nothing more or less: what
  scripts/setup installs on a fresh clone is what CI tested;
- every upper bound says why;
- scripts/deps.py upgrade writes what moved where the CHANGELOG's bullets go.
"""

from __future__ import annotations

import importlib.util
import re
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path
from types import ModuleType

from packaging.utils import NormalizedName, canonicalize_name

from tests.support.lock import (
    PROJECT,
    PYPROJECT,
    ROOT,
    declared_ranges,
    installed_by,
    lock,
    locked_ranges,
    show,
)

FIX = "run `.venv/bin/uv lock` and commit uv.lock"


def deps_script() -> ModuleType:
    """scripts/deps.py, loaded from its file (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("deps_script", ROOT / "scripts" / "deps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lock_is_the_resolution_of_the_ranges_in_pyproject():
    locked = lock()
    declared, recorded = declared_ranges(), locked_ranges(locked)
    assert declared == recorded, (
        f"pyproject.toml and uv.lock disagree: {FIX}. "
        f"In pyproject.toml only: {show(declared - recorded)}; "
        f"in uv.lock only: {show(recorded - declared)}"
    )
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert locked["requires-python"] == project["requires-python"], FIX
    [root] = [p for p in locked["package"] if p["name"] == PROJECT]
    assert set(root["metadata"]["provides-extras"]) == set(project["optional-dependencies"]), FIX


def test_the_lock_check_names_what_differs(tmp_path: Path):
    """The check itself, on a pyproject.toml whose range moved after the lock."""
    moved = tmp_path / "pyproject.toml"
    as_locked = PYPROJECT.read_text()
    assert '"redis>=6"' in as_locked
    moved.write_text(as_locked.replace('"redis>=6"', '"redis>=7"'))
    difference = declared_ranges(moved) ^ locked_ranges(lock())
    assert show(difference) == ["redis>=6", "redis>=7"]


def installed_here() -> dict[NormalizedName, str]:
    """Every distribution in this interpreter's environment (not the source
    tree's own egg-info, which an editable install may leave beside the code)."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {
        canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=paths)
    }


def test_this_environment_is_exactly_the_lock():
    """What the README's commands installed (scripts/setup: uv sync --locked
    --extra dev) is what uv.lock pins: no package missing, none more, none at
    another version. Left out at the ranges' ends (scripts/deps.py end)."""
    expected = installed_by(["dev"], lock())
    installed = installed_here()
    differ = {
        name: (installed.get(name, "-"), expected.get(name, "-"))
        for name in expected.keys() | installed.keys()
        if installed.get(name) != expected.get(name)
    }
    assert not differ, (
        f"installed, locked: {differ}: scripts/setup installs the lock "
        "(or `.venv/bin/uv sync --locked --extra dev`)"
    )
    assert "uv" in expected and "pytest" in expected and "sqlalchemy" in expected


def test_the_service_alone_holds_no_dev_package():
    """The image's install (no extra) leaves out what only the dev extra brings."""
    locked = lock()
    service, development = installed_by([], locked), installed_by(["dev"], locked)
    assert service.keys() < development.keys()
    for tool in ("pytest", "mypy", "ruff", "uv", "deptry", "pip-audit", "matplotlib"):
        assert tool in development and tool not in service, tool
    for runtime in ("celery", "kombu", "sqlalchemy", "psycopg2-binary", "kafka-python"):
        assert runtime in service, runtime


def requirement_lines() -> list[tuple[int, str, str]]:
    """(line number, requirement, its comment: inline, or the comment lines just
    above) for every requirement of [project] and [project.optional-dependencies]."""
    lines = PYPROJECT.read_text().splitlines()
    found = []
    table, inside = "", False
    for number, line in enumerate(lines):
        stripped = line.strip()
        if re.fullmatch(r"\[[^\]]+\]", stripped):
            table = stripped
        elif table in ("[project]", "[project.optional-dependencies]") and re.fullmatch(
            r"[a-z-]+ = \[", stripped
        ):
            inside = True
        elif stripped == "]":
            inside = False
        elif inside and (quoted := re.fullmatch(r'"([^"]+)",\s*(#.*)?', stripped)):
            above = []
            for previous in reversed(lines[:number]):
                if not previous.strip().startswith("#"):
                    break
                above.append(previous.strip())
            found.append((number + 1, quoted[1], " ".join([*reversed(above), quoted[2] or ""])))
    return found


def test_every_upper_bound_says_why():
    """An upper bound only where the next major version is known to break, and
    then its reason beside it: a comment that names the bound (``<6: ...``)."""
    requirements = requirement_lines()
    assert len(requirements) == len(declared_ranges())  # every one of them read
    bounded = [(n, r, c) for n, r, c in requirements if "<" in r]
    assert {r for _, r, _ in bounded} >= {"kombu>=5.6,<6", "sqlalchemy>=2.0.5,<3"}
    for number, requirement, comment in bounded:
        [bound] = re.findall(r"<=?\s*[0-9][0-9a-z.]*", requirement)
        assert f"# {bound.replace(' ', '')}:" in comment, (
            f"pyproject.toml:{number}: {requirement}: its upper bound has no reason "
            f"(a comment above it: '# {bound}: why the next major breaks')"
        )


def test_an_upgrade_writes_what_moved_at_the_end_of_the_unreleased_section(tmp_path):
    deps = deps_script()
    changelog = tmp_path / "CHANGELOG.md"
    changelog.write_text(
        "# Changelog\n\n## 0.5.0 (unreleased)\n\n- One change.\n\n"
        "## 0.4.0 (2026-12-07, commit f900179)\n\n- Older.\n"
    )
    moved = deps.moves(
        {"celery": "5.6.0", "kombu": "5.6.0", "vine": "5.1.0"},
        {"celery": "5.7.0", "kombu": "5.6.0", "tzdata": "2026.6"},
    )
    assert moved == ["celery 5.6.0 -> 5.7.0", "tzdata 2026.6 (new)", "vine 5.1.0 (gone)"]
    deps.record(moved, "scripts/deps.py upgrade celery", changelog)
    assert changelog.read_text() == (
        "# Changelog\n\n## 0.5.0 (unreleased)\n\n- One change.\n"
        "- Locked dependencies renewed (`scripts/deps.py upgrade celery`):\n"
        "  celery 5.6.0 -> 5.7.0, tzdata 2026.6 (new), vine 5.1.0 (gone).\n\n"
        "## 0.4.0 (2026-12-07, commit f900179)\n\n- Older.\n"
    )


def test_uv_is_installed_first_from_the_lock_with_every_hash():
    """scripts/setup installs uv with pip from this line before uv installs the rest."""
    deps = deps_script()
    [uv] = [p for p in lock()["package"] if p["name"] == "uv"]
    line = deps.uv_requirement()
    assert line.startswith(f"uv=={uv['version']} --hash=sha256:")
    files = [*uv["wheels"], uv["sdist"]]
    assert re.findall(r"--hash=(\S+)", line) == [f["hash"] for f in files]
    assert any("manylinux" in f["url"] and "x86_64" in f["url"] for f in uv["wheels"])


def test_the_audit_passes_only_when_every_package_was_checked_and_none_is_vulnerable(capsys):
    deps = deps_script()
    clean = [{"name": "celery", "version": "5.7.0", "vulns": []}]
    assert deps.audited("pypi", clean) == 0
    advisory = {"id": "GHSA-0000-0000-0000", "fix_versions": ["2.0.7"]}
    vulnerable = [*clean, {"name": "urllib3", "version": "2.0.0", "vulns": [advisory]}]
    assert deps.audited("pypi", vulnerable) == 1
    assert "urllib3 2.0.0: GHSA-0000-0000-0000 (fixed in 2.0.7)" in capsys.readouterr().out
    left_out = [*clean, {"name": "kombu", "version": "5.7.0", "skip_reason": "not found"}]
    assert deps.audited("pypi", left_out) == 2
    assert "not checked: kombu: not found" in capsys.readouterr().out
