"""docker-compose.yml as Compose reads it, and its services run on this machine.

There is no Docker engine here. ``load`` parses the file and interpolates it as
Compose does (``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``, ``$$``);
``Local`` then rewrites only what differs outside the Compose network: the
services' host names and ports, and the container paths (secrets, beat's
schedule, the metrics directory) to directories of the test. Everything else
(command, arguments, environment) is run exactly as written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"

_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_]\w*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?[-?+])(?P<arg>.*))?$", re.DOTALL)


class ComposeError(ValueError):
    """What Compose itself would refuse (a required variable unset or empty)."""


def raw() -> dict[str, Any]:
    """The file as YAML (anchors and merge keys resolved), not interpolated."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


def variables() -> set[str]:
    """Every variable the file interpolates (comments left out)."""
    names: set[str] = set()
    for line in COMPOSE_FILE.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        for match in _VARIABLE.finditer(line):
            if match["named"]:
                names.add(match["named"])
            elif match["braced"] is not None:
                names.add(_BRACED.match(match["braced"])["name"])  # type: ignore[index]
    return names


def interpolate(value: str, env: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["named"]:
            return env.get(match["named"], "")
        parsed = _BRACED.match(match["braced"])
        if parsed is None:
            raise ComposeError(f"invalid interpolation: {match[0]!r}")
        name, op, arg = parsed["name"], parsed["op"], parsed["arg"]
        value = env.get(name)
        unset_or_empty = not value if op and op.startswith(":") else value is None
        if op in (":-", "-"):
            return arg if unset_or_empty else value  # type: ignore[return-value]
        if op in (":?", "?"):
            if unset_or_empty:
                raise ComposeError(f"required variable {name} is missing a value: {arg}")
            return value  # type: ignore[return-value]
        if op in (":+", "+"):
            return "" if unset_or_empty else arg
        return value or ""

    return _VARIABLE.sub(one, value)


def load(env: dict[str, str]) -> dict[str, Any]:
    """The file as Compose sees it with these variables (as from .env)."""

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return interpolate(node, env)
        if isinstance(node, list):
            return [walk(item) for item in node]
        if isinstance(node, dict):
            return {key: walk(value) for key, value in node.items()}
        return node

    return walk(raw())


@dataclass
class Local:
    """Where the Compose network's names and the containers' paths are here."""

    # "postgres" -> ("127.0.0.1", 54321): the service's host name, and its port
    # inside the network -> here
    services: dict[str, tuple[str, int, int]]
    # container directory -> a directory of the test
    paths: dict[str, Path]
    # a port a process listens on inside its container -> a free one here
    ports: dict[int, int] = field(default_factory=dict)

    def text(self, value: str) -> str:
        """Every name, path and port rewritten in one pass (a rewritten part is
        never rewritten again: a test directory under /tmp stays as it is)."""
        table: dict[str, str] = {}
        for name, (host, inside, here) in self.services.items():
            table[f"{name}:{inside}"] = f"{host}:{here}"
        for inside_dir, here_dir in self.paths.items():
            table[inside_dir] = f"{here_dir}/"
        for inside_port, here_port in self.ports.items():
            table[str(inside_port)] = str(here_port)
        keys = sorted(table, key=len, reverse=True)  # the longest match first
        pattern = "|".join(
            rf"(?<![0-9]){re.escape(k)}(?![0-9])" if k.isdigit() else re.escape(k) for k in keys
        )
        return re.sub(pattern, lambda m: table[m[0]], value)

    def command(self, argv: list[str]) -> list[str]:
        return [self.text(arg) for arg in argv]

    def environment(self, env: dict[str, Any]) -> dict[str, str]:
        out: dict[str, str] = {}
        libpq_host = str(env.get("PGHOST", ""))  # libpq's own variables name the host apart
        for key, value in ((k, str(v)) for k, v in env.items()):
            if key == "PGHOST" and value in self.services:
                out[key] = self.services[value][0]
            elif key == "PGPORT" and libpq_host in self.services:
                _, inside, here = self.services[libpq_host]
                out[key] = str(here) if value == str(inside) else value
            else:
                out[key] = self.text(value)
        return out
