"""The image's file tree, built as the Dockerfile builds it and run as the
image's user, without a container engine.

The build stage's sources, copied as its COPY instructions copy them, and its
own step (``scripts/deps.py service-tree``) install the service from uv.lock,
hashes checked and no extra, into an empty prefix; the
tree holds exactly the lock's service packages; the worker's and the CLI's
commands start from it as an unprivileged user, who migrates a database and
reads it with it and cannot change the tree. A file the package leaves out, or
a package the lock leaves out, fails here. The service's SBOM lists the same
packages, with their locked hashes.

The tree is built on Debian's /usr/bin/python3.11, which every user can run
(the project's own interpreter may live under /root); the image's is
python:3.11-slim's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.utils import canonicalize_name
from sqlalchemy import create_engine, text

from tests.conftest import PG_URL, SESSION_TAG
from tests.support.dockerfile import IMAGE_PREFIX, IMAGE_UID, build, copy_build_sources, image
from tests.support.lock import PROJECT, ROOT, installed_by, lock, packages
from tests.support.processes import wait_until

pytestmark = pytest.mark.process

SYSTEM_PYTHON = Path("/usr/bin/python3.11")
# Every module of the service imports from the tree (the migrations are loaded
# by alembic, from their files: the migrate test runs them).
IMPORT_EVERYTHING = """
import importlib, pkgutil, reaper
names = [m.name for m in pkgutil.walk_packages(reaper.__path__, "reaper.")
         if not m.name.startswith("reaper.migrations")]
for name in names:
    importlib.import_module(name)
print(len(names), reaper.__file__)
"""
LIST_DISTRIBUTIONS = """
import importlib.metadata, json, platform
print(json.dumps({"python_full_version": platform.python_version(),
                  "installed": {d.metadata["Name"]: d.version
                                for d in importlib.metadata.distributions()}}))
"""


@dataclass
class Tree:
    prefix: Path  # /opt/reaper in the image
    home: Path  # /var/lib/reaper: the one directory the user owns, its working directory

    def as_user(
        self, *argv: str, env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """argv as the image's user, with the image's PATH and nothing else of ours."""
        return subprocess.run(
            ["setpriv", f"--reuid={IMAGE_UID}", f"--regid={IMAGE_UID}", "--clear-groups", *argv],
            cwd=self.home,
            env={"PATH": f"{self.prefix}/bin:/usr/bin:/bin", "HOME": str(self.home), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def tree_step() -> list[str]:
    """The build stage's step that installs the tree, as the Dockerfile writes it."""
    [install] = build("RUN")
    [step] = [s for s in install.split("&&") if "scripts/deps.py service-tree" in s]
    argv = shlex.split(step)
    assert argv[:4] == ["python", "scripts/deps.py", "service-tree", IMAGE_PREFIX], argv
    return argv


@pytest.fixture(scope="module")
def tree() -> Iterator[Tree]:
    assert SYSTEM_PYTHON.exists(), f"{SYSTEM_PYTHON} is missing (Debian's python3.11 package)"
    # under /tmp itself: pytest's own temporary directories are root's alone
    base = Path(tempfile.mkdtemp(prefix="reaper-image-", dir="/tmp"))
    try:
        base.chmod(0o755)
        # the build's sources as the Dockerfile copies them (no egg-info or
        # build directory of this checkout's), then its own step, with the
        # prefix here and a Python every user can run
        sources = copy_build_sources(base / "build")
        prefix = base / IMAGE_PREFIX.lstrip("/")
        argv = [sys.executable, *tree_step()[1:], "--python", str(SYSTEM_PYTHON)]
        argv[argv.index(IMAGE_PREFIX)] = str(prefix)
        built = subprocess.run(
            argv,
            cwd=sources,
            env={**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert built.returncode == 0, built.stdout + built.stderr
        home = base / "var" / "lib" / "reaper"
        home.mkdir(parents=True)
        os.chown(home, IMAGE_UID, IMAGE_UID)
        home.chmod(0o750)
        yield Tree(prefix, home)
    finally:
        shutil.rmtree(base)


def test_the_tree_holds_exactly_the_locked_service_and_no_dev_package(tree: Tree):
    listed = subprocess.run(
        [str(tree.prefix / "bin" / "python"), "-c", LIST_DISTRIBUTIONS],
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(listed.stdout)
    installed = {canonicalize_name(k): v for k, v in found["installed"].items()}
    on_this_python = {"python_full_version": found["python_full_version"]}
    expected = installed_by([], lock(), on_this_python)
    assert installed == expected
    assert PROJECT in installed and "pytest" not in installed and "uv" not in installed
    # the same set as uv's own reading of the lock (the check's reading is uv's)
    export = [str(ROOT / ".venv" / "bin" / "uv"), "export", "--frozen", "--no-emit-project"]
    export += ["--no-default-groups", "--no-hashes", "--no-annotate", "--no-header"]
    exported = subprocess.run(
        [*export, "--format", "requirements.txt"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    by_uv = {}
    for line in exported.stdout.splitlines():
        requirement, _, marker = line.partition(" ; ")
        if marker and not Marker(marker).evaluate(on_this_python):
            continue
        name, _, version = requirement.partition("==")
        by_uv[canonicalize_name(name)] = version
    assert by_uv == {k: v for k, v in expected.items() if k != PROJECT}


def test_the_worker_and_the_cli_start_from_the_tree_as_the_images_user(tree: Tree):
    version = tree.as_user("reaper", "--version")
    assert (version.returncode, version.stdout.strip()) == (0, "reaper 0.5.0"), version.stderr
    worker = tree.as_user("celery", "-A", "reaper", "worker", "--help")
    assert worker.returncode == 0, worker.stderr
    assert "--concurrency" in worker.stdout and "--schedule" in worker.stdout
    modules = tree.as_user("python", "-c", IMPORT_EVERYTHING)
    assert modules.returncode == 0, modules.stderr
    count, where = modules.stdout.split()
    assert int(count) > 30 and where.startswith(f"{tree.prefix}/lib/")  # not the sources
    # the code is the image's, not the user's to change
    written = tree.as_user("touch", where)
    assert written.returncode != 0 and "Permission denied" in written.stderr


def test_the_images_default_command_runs_from_the_tree_as_its_user(tree: Tree, engine):
    """The Dockerfile's CMD, as written, from the tree as the image's user: the
    worker and its beat start, and beat keeps its schedule in the user's directory."""
    [cmd] = image("CMD")
    argv = json.loads(cmd)
    at = argv.index("-s") + 1
    schedule = Path(argv[at])
    assert schedule.parent == Path("/var/lib/reaper")  # tree.home here
    argv[at] = str(tree.home / schedule.name)
    env = {name: value for name, value in os.environ.items() if name.startswith("REAPER_")}
    env |= {"PATH": f"{tree.prefix}/bin:/usr/bin:/bin", "HOME": str(tree.home)}
    log = tree.home.parent / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            ["setpriv", f"--reuid={IMAGE_UID}", f"--regid={IMAGE_UID}", "--clear-groups", *argv],
            cwd=tree.home,
            env={**env, "REAPER_POLLING_INTERVAL": "3600"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(
            lambda: " ready." in log.read_text() or worker.poll() is not None, 60, "worker ready"
        )
        assert worker.poll() is None, log.read_text()
        kept = wait_until(lambda: list(tree.home.glob(f"{schedule.name}*")), 30, "beat schedule")
        assert all(path.stat().st_uid == IMAGE_UID for path in kept)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):  # its pool's children
                os.killpg(worker.pid, signal.SIGKILL)


def test_the_tree_migrates_a_database_and_reads_it_as_the_images_user(tree: Tree, services):
    database = f"reaper_image_{SESSION_TAG}"
    env = {"REAPER_DATABASE_URL": f"{PG_URL}/{database}"}
    try:
        migrated = tree.as_user("reaper", "migrate", env=env, timeout=120)
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        status = tree.as_user("reaper", "status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        assert "outbox" in json.loads(status.stdout)
    finally:
        admin = create_engine(f"{PG_URL}/postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()


def test_the_sbom_lists_the_locked_service_packages_with_their_hashes(tmp_path):
    output = tmp_path / "sbom.cdx.json"
    made = subprocess.run(
        [sys.executable, "scripts/deps.py", "sbom", "--output", str(output)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    sbom = json.loads(output.read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    root = sbom["metadata"]["component"]
    assert (root["name"], root["version"]) == (PROJECT, "0.5.0")
    locked = lock()
    service = installed_by([], locked, any_interpreter=True)
    del service[canonicalize_name(PROJECT)]
    components = {canonicalize_name(c["name"]): c for c in sbom["components"]}
    assert {name: c["version"] for name, c in components.items()} == service
    files = packages(locked)
    for name, component in components.items():
        assert component["purl"] == f"pkg:pypi/{name}@{component['version']}"
        hashes = {
            f"sha256:{h['content']}"
            for ref in component["externalReferences"]
            for h in ref["hashes"]
        }
        locked_hashes = {f["hash"] for f in [*files[name].get("wheels", [])]} | (
            {files[name]["sdist"]["hash"]} if "sdist" in files[name] else set()
        )
        assert hashes and hashes == locked_hashes, name
