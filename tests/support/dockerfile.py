"""The Dockerfile's instructions as Docker reads them: continuation lines
joined, comments left out, each stage apart (the image is its last)."""

from __future__ import annotations

import fnmatch
import re
import shutil
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
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


def ignored(name: str) -> bool:
    """Whether .dockerignore leaves a file or directory of this name out
    (its ``**/NAME`` patterns, the only kind the copy below reads)."""
    patterns = [
        line.strip().removeprefix("**/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip().startswith("**/")
    ]
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def copy_build_sources(into: Path) -> Path:
    """The first stage's sources as its COPY instructions lay them out (each
    ``COPY SRC... DEST`` relative to its WORKDIR), from this checkout, under
    ``into``; returns the WORKDIR there. A file the build needs and does not
    copy is then missing here too."""
    workdir = PurePosixPath("/")
    for instruction, arguments in stages()[0]:
        if instruction == "WORKDIR":
            workdir = workdir / arguments
        elif instruction == "COPY":
            *sources, dest = arguments.split()
            assert not any(s.startswith("--") for s in sources), arguments
            target = into / str(workdir / dest).lstrip("/")
            for source in sources:
                path = ROOT / source
                inside = target / path.name if dest.endswith("/") else target
                if path.is_dir():
                    shutil.copytree(
                        path, inside, ignore=lambda _, names: [n for n in names if ignored(n)]
                    )
                else:
                    inside.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, inside)
    return into / str(workdir).lstrip("/")
