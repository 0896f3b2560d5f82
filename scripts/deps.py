#!/usr/bin/env python3
"""The project's dependencies around its lock, uv.lock (docs/dependencies.md).

    scripts/deps.py upgrade [PACKAGE ...] [-- ARGS]   renew the lock (every package, or
                                                      those named), write what moved in
                                                      CHANGELOG.md, then scripts/test ARGS
    scripts/deps.py end lowest|newest [-- ARGS]       the fast layer on the lowest (the
                                                      newest) versions the ranges allow,
                                                      in .venv-lowest (.venv-newest)
    scripts/deps.py sbom [--output PATH]              the service's SBOM (CycloneDX), from
                                                      the lock
    scripts/deps.py audit                             the lock's packages against a database
                                                      of known vulnerabilities
    scripts/deps.py service-tree PREFIX [--python P]  the image's tree: a virtualenv at
                                                      PREFIX, the service as locked, no
                                                      dev extra (the Dockerfile runs it)
    scripts/deps.py uv-version | uv-requirement       uv as locked (scripts/setup)

Only the standard library: scripts/setup runs it before anything is installed.
The tools it runs (uv, cyclonedx-py, pip-audit) are the lock's own, from
.venv/bin, or from PATH where there is no .venv (the image's build).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "uv.lock"
CHANGELOG = ROOT / "CHANGELOG.md"
SBOM = ROOT / "build" / "sbom" / "conference-room-reaper.cdx.json"
# The services pip-audit can ask, in the order they are tried: PyPI's JSON API
# (the advisories of the Python Packaging Advisory Database), then OSV's.
VULNERABILITY_SERVICES = ("pypi", "osv")
# What is left out of a test run at either end: this check holds .venv to the lock.
NOT_AT_THE_ENDS = "tests/test_dependencies.py::test_this_environment_is_exactly_the_lock"
RESOLUTION = {"lowest": "lowest-direct", "newest": "highest"}


class Failed(Exception):
    """A step failed; its message is the one line the command ends with."""


def tool(name: str) -> str:
    """The lock's own copy of a tool: .venv's, else the one on PATH (the image's build)."""
    local = ROOT / ".venv" / "bin" / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise Failed(f"{name} is not installed (scripts/setup installs it from the lock)")
    return found


def run(*argv: str, env: dict[str, str] | None = None) -> None:
    """argv from the project's directory; its failure ends the command."""
    print("+ " + shlex.join(argv), file=sys.stderr, flush=True)
    done = subprocess.run(argv, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise Failed(f"{Path(argv[0]).name} exited {done.returncode}")


def locked_packages(lock: Path = LOCK) -> dict[str, dict[str, Any]]:
    """The lock's packages by name."""
    return {p["name"]: p for p in tomllib.loads(lock.read_text())["package"]}


def locked_versions(lock: Path = LOCK) -> dict[str, str]:
    return {name: p["version"] for name, p in locked_packages(lock).items()}


# -- uv itself ---------------------------------------------------------------


def uv_version() -> str:
    return str(locked_packages()["uv"]["version"])


def uv_requirement() -> str:
    """uv pinned as the lock has it, with the hash of each of its files, for pip."""
    uv = locked_packages()["uv"]
    files = [*uv.get("wheels", []), *([uv["sdist"]] if "sdist" in uv else [])]
    return f"uv=={uv['version']} " + " ".join(f"--hash={f['hash']}" for f in files)


# -- upgrade -----------------------------------------------------------------


def moves(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What a renewal changed, one phrase a package, by name."""
    out = []
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name), after.get(name)
        if old == new:
            continue
        if old is None:
            out.append(f"{name} {new} (new)")
        elif new is None:
            out.append(f"{name} {old} (gone)")
        else:
            out.append(f"{name} {old} -> {new}")
    return out


def record(moved: list[str], command: str, changelog: Path = CHANGELOG) -> None:
    """One bullet at the end of the unreleased section of CHANGELOG.md."""
    lines = changelog.read_text().splitlines()
    start = next(
        (i for i, line in enumerate(lines) if re.match(r"^## \S+ \(unreleased\)$", line)), None
    )
    if start is None:
        raise Failed(f"{changelog.name} has no '## X.Y.Z (unreleased)' section to write in")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    # a package's move stays on one line: its spaces are not wrapped at
    kept = [move.replace(" ", "\0") for move in moved]
    bullet = textwrap.wrap(
        f"- Locked dependencies renewed (`{command}`): {', '.join(kept)}.",
        width=78,
        subsequent_indent="  ",
        break_on_hyphens=False,
    )
    lines[end:end] = [line.replace("\0", " ") for line in bullet]
    changelog.write_text("\n".join(lines) + "\n")


def upgrade(packages: list[str], test_args: list[str]) -> int:
    before = locked_versions()
    if packages:
        run(tool("uv"), "lock", *(f"--upgrade-package={name}" for name in packages))
    else:
        run(tool("uv"), "lock", "--upgrade")
    moved = moves(before, locked_versions())
    if not moved:
        print("deps: nothing moved: the lock is as it was", file=sys.stderr)
        return 0
    command = shlex.join(["scripts/deps.py", "upgrade", *packages])
    record(moved, command)
    print("deps: moved (written in CHANGELOG.md): " + ", ".join(moved), file=sys.stderr)
    # scripts/test installs the renewed lock into .venv (scripts/setup) first
    return subprocess.run([str(ROOT / "scripts" / "test"), *test_args], cwd=ROOT).returncode


# -- both ends of the ranges -------------------------------------------------


def direct_requirements() -> list[str]:
    """The ranges of pyproject.toml: the service's and every extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return [*project["dependencies"], *(r for group in extras.values() for r in group)]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def end(which: str, test_args: list[str]) -> int:
    """A virtualenv of its own with the lowest (newest) versions the direct ranges
    allow (transitive dependencies at their newest either way), then the fast layer."""
    venv = ROOT / f".venv-{which}"
    shutil.rmtree(venv, ignore_errors=True)
    uv = tool("uv")
    run(uv, "venv", "--quiet", "--python", "3.11", "--no-python-downloads", str(venv))
    python = str(venv / "bin" / "python")
    run(uv, "pip", "install", "--python", python, "--resolution", RESOLUTION[which], "-e", ".[dev]")
    listed = subprocess.run(
        [uv, "pip", "list", "--python", python, "--format", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    installed = {canonical(p["name"]): p["version"] for p in json.loads(listed.stdout)}
    locked = {canonical(k): v for k, v in locked_versions().items()}
    print(f"\n{which} end: each direct range, what it installed, what uv.lock holds")
    for requirement in direct_requirements():
        name = canonical(re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0])
        print(f"  {requirement:<48} {installed.get(name, '-'):<24} {locked.get(name, '-')}")
    print(flush=True)
    pytest = [python, "-m", "pytest", "-m", "fast", "-n", "2", "--dist", "loadfile"]
    pytest += ["-p", "no:cacheprovider", "--deselect", NOT_AT_THE_ENDS, *test_args]
    return subprocess.run(pytest, cwd=ROOT).returncode


# -- what is inside ----------------------------------------------------------


def export(into: Path, *selection: str) -> Path:
    """The lock as a requirements file with hashes (the project itself left out)."""
    run(
        tool("uv"),
        "export",
        "--frozen",
        "--quiet",
        "--no-emit-project",
        "--no-default-groups",
        "--format",
        "requirements.txt",
        *selection,
        "--output-file",
        str(into),
    )
    return into


def sbom(output: Path) -> int:
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        service = export(Path(tmp) / "service.txt")  # no extra: what the image holds
        run(
            tool("cyclonedx-py"),
            "requirements",
            str(service),
            "--pyproject",
            str(ROOT / "pyproject.toml"),
            "--mc-type",
            "application",
            "--output-reproducible",
            "--output-format",
            "JSON",
            "--output-file",
            str(output),
            # requirements carry no dependency graph, and cyclonedx warns that the
            # SBOM has none: docs/dependencies.md says so once
            env={**os.environ, "PYTHONWARNINGS": "ignore::UserWarning"},
        )
    count = len(json.loads(output.read_text()).get("components", []))
    print(f"deps: the service's SBOM, {count} components: {output}", file=sys.stderr)
    return 0


def audit() -> int:
    """0: every package checked and none known vulnerable; 1: some are; 2: not
    every package could be checked (no database reached, or some left out)."""
    unreachable: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        everything = export(Path(tmp) / "all.txt", "--all-extras")
        for service in VULNERABILITY_SERVICES:
            print(f"+ pip-audit against {service}", file=sys.stderr, flush=True)
            pip_audit = [tool("pip-audit"), "--requirement", str(everything), "--require-hashes"]
            pip_audit += ["--no-deps", "--disable-pip", "--progress-spinner", "off"]
            pip_audit += ["--format", "json", "--vulnerability-service", service]
            done = subprocess.run(
                pip_audit,
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            try:
                dependencies = json.loads(done.stdout)["dependencies"]
            except (json.JSONDecodeError, KeyError):
                lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
                unreachable[service] = lines[-1]
                continue
            skipped = [d for d in dependencies if "skip_reason" in d]
            if len(skipped) == len(dependencies):
                unreachable[service] = (
                    f"every package left out, as {skipped[0]['skip_reason']}"
                    if skipped
                    else "no package"
                )
                continue
            return audited(service, dependencies)
    print(
        "deps: audit: NOT CHECKED: no database of known vulnerabilities answered from "
        "here, so no package of the lock was checked:",
        *(f"  {service}: {why}" for service, why in unreachable.items()),
        "  Run `scripts/deps.py audit` on a machine that reaches pypi.org's JSON API "
        "or api.osv.dev.",
        sep="\n",
        file=sys.stderr,
    )
    return 2


def audited(service: str, dependencies: list[dict[str, Any]]) -> int:
    found = [(d, v) for d in dependencies for v in d.get("vulns", [])]
    skipped = [d for d in dependencies if "skip_reason" in d]
    for dependency, vuln in found:
        fixes = ", ".join(vuln.get("fix_versions", [])) or "none yet"
        print(f"{dependency['name']} {dependency['version']}: {vuln['id']} (fixed in {fixes})")
    for dependency in skipped:
        print(f"not checked: {dependency['name']}: {dependency['skip_reason']}")
    checked = len(dependencies) - len(skipped)
    print(
        f"deps: audit: {checked} of {len(dependencies)} locked packages checked against "
        f"{service}: {len(found)} known vulnerabilities",
        file=sys.stderr,
    )
    return 1 if found else 2 if skipped else 0


# -- the image's tree ----------------------------------------------------------


def service_tree(prefix: Path, python: str, compile_bytecode: bool) -> int:
    """What the image runs: a virtualenv at PREFIX holding the service's locked
    dependencies (hashes checked, no extra) and the project itself, not editable."""
    run(
        tool("uv"),
        "sync",
        "--locked",
        "--no-editable",
        "--no-default-groups",
        "--python",
        python,
        "--no-python-downloads",
        *(["--compile-bytecode"] if compile_bytecode else []),
        env={**os.environ, "UV_PROJECT_ENVIRONMENT": str(prefix)},
    )
    return 0


def main(argv: list[str]) -> int:
    # what follows -- goes to pytest (scripts/test, the fast layer at an end)
    own, passed = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(prog="scripts/deps.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("upgrade").add_argument("packages", nargs="*")
    commands.add_parser("end").add_argument("which", choices=sorted(RESOLUTION))
    commands.add_parser("sbom").add_argument("--output", type=Path, default=SBOM)
    commands.add_parser("audit")
    tree = commands.add_parser("service-tree")
    tree.add_argument("prefix", type=Path)
    tree.add_argument("--python", default="3.11", help="the interpreter (default: a 3.11)")
    tree.add_argument("--compile-bytecode", action="store_true")
    commands.add_parser("uv-version")
    commands.add_parser("uv-requirement")
    args = parser.parse_args(own)
    try:
        match args.command:
            case "upgrade":
                return upgrade(args.packages, passed)
            case "end":
                return end(args.which, passed)
            case "sbom":
                return sbom(args.output.resolve())
            case "audit":
                return audit()
            case "service-tree":
                return service_tree(args.prefix.resolve(), args.python, args.compile_bytecode)
            case "uv-version":
                print(uv_version())
            case "uv-requirement":
                print(uv_requirement())
        return 0
    except Failed as failed:
        print(f"deps: {args.command}: {failed}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
