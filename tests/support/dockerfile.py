"""The Dockerfile's instructions as Docker reads them: continuation lines
joined, comments left out, each stage apart (the image is its last)."""

from __future__ import annotations

import re
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"
# Where the image holds the service, and who runs it (tests/test_image.py builds
# and runs that tree; tests/test_deployment.py holds the Dockerfile to these)
IMAGE_PREFIX = "/opt/reaper"
IMAGE_UID = 10001


def stages() -> list[list[tuple[str, str]]]:
    """Each stage's (instruction, its arguments), from its FROM on."""
    joined = re.sub(r"\\\n(\s*#.*\n)*\s*", " ", DOCKERFILE.read_text())
    found: list[list[tuple[str, str]]] = []
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, _, arguments = line.strip().partition(" ")
        if name == "FROM":
            found.append([])
        found[-1].append((name, arguments.strip()))
    return found


def image(name: str) -> list[str]:
    """The arguments of every NAME instruction of the image (the last stage)."""
    return [arguments for instruction, arguments in stages()[-1] if instruction == name]


def build(name: str) -> list[str]:
    """The same in the stages before it, which build what the image copies."""
    return [a for stage in stages()[:-1] for instruction, a in stage if instruction == name]
