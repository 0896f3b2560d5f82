"""uv.lock, read as an install from it reads it: the packages (and their
versions) that the service alone, or development (the ``dev`` extra), holds
on this interpreter, and the ranges the lock was resolved from."""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import NormalizedName, canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "uv.lock"
PYPROJECT = ROOT / "pyproject.toml"
PROJECT = "conference-room-reaper"

# One requirement as both files can say it: name, its extras, its range, and the
# extra of this project that asks for it ("" for the service itself).
Range = tuple[NormalizedName, frozenset[str], SpecifierSet, str]


def lock(path: Path = LOCK) -> dict[str, Any]:
    return tomllib.loads(path.read_text())


def packages(locked: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The lock's packages by name: one version each (the lock is for one
    environment, pyproject.toml's [tool.uv] environments)."""
    found: dict[str, dict[str, Any]] = {}
    for package in locked["package"]:
        assert package["name"] not in found, f"two versions of {package['name']} in uv.lock"
        found[package["name"]] = package
    return found


def installed_by(
    extras: Iterable[str],
    locked: dict[str, Any],
    environment: dict[str, str] | None = None,
    *,
    any_interpreter: bool = False,
) -> dict[NormalizedName, str]:
    """Name -> version of every package an install of the project with
    ``extras`` holds: the project's dependencies, its extras', theirs, each only
    where its marker holds on this interpreter (or on one whose marker values
    ``environment`` gives; with ``any_interpreter``, on any the lock is for)."""
    by_name = packages(locked)
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(PROJECT, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        package = by_name[name]
        needs = list(package.get("dependencies", []))
        for extra in wanted:
            needs += package.get("optional-dependencies", {})[extra]
        for need in needs:
            if (
                "marker" in need
                and not any_interpreter
                and not Marker(need["marker"]).evaluate(environment)
            ):
                continue
            todo.append((need["name"], frozenset(need.get("extra", []))))
    return {canonicalize_name(name): by_name[name]["version"] for name, _ in seen}


def declared_ranges(pyproject: Path = PYPROJECT) -> set[Range]:
    """The ranges of pyproject.toml: the service's, then every extra's."""
    project = tomllib.loads(pyproject.read_text())["project"]
    groups = {"": project["dependencies"], **project.get("optional-dependencies", {})}
    ranges: set[Range] = set()
    for extra, requirements in groups.items():
        for text in requirements:
            requirement = Requirement(text)
            assert requirement.marker is None, f"{text}: a marker the lock check does not read"
            ranges.add(
                (
                    canonicalize_name(requirement.name),
                    frozenset(requirement.extras),
                    requirement.specifier,
                    extra,
                )
            )
    return ranges


def locked_ranges(locked: dict[str, Any]) -> set[Range]:
    """The ranges the lock was resolved from, as uv recorded them."""
    ranges: set[Range] = set()
    for entry in packages(locked)[PROJECT]["metadata"]["requires-dist"]:
        marker = entry.get("marker", "")
        extra = marker.removeprefix("extra == '").removesuffix("'") if marker else ""
        assert marker == (f"extra == '{extra}'" if extra else ""), f"uv.lock: {entry}"
        ranges.add(
            (
                canonicalize_name(entry["name"]),
                frozenset(entry.get("extras", [])),
                SpecifierSet(entry.get("specifier", "")),
                extra,
            )
        )
    return ranges


def show(ranges: Iterable[Range]) -> list[str]:
    out = []
    for name, extras, specifier, extra in sorted(ranges, key=lambda r: (r[3], r[0], str(r[2]))):
        with_extras = f"{name}[{','.join(sorted(extras))}]" if extras else name
        out.append(f"{with_extras}{specifier}" + (f" (extra {extra})" if extra else ""))
    return out
