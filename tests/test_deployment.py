"""The deployment as written: docker-compose.yml valid against the Compose
specification's own JSON schema, each service with its own credentials, the
secrets from an example file and nowhere in the repository, the image's
default command. Fast: files only (the services themselves are run by
tests/test_compose_local.py)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from sqlalchemy import make_url

from reaper.config import ENV_PREFIX, Settings
from tests.support.compose import ComposeError, interpolate, load, raw, variables
from tests.support.dockerfile import IMAGE_PREFIX, IMAGE_UID, build, image

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_DIR = ROOT / "tests" / "compose-spec"
ENV_EXAMPLE = ROOT / ".env.example"
WORKER_LOGIN = "reaper_worker_login"
SECRETS = {
    "POSTGRES_PASSWORD": "owner-pw",
    "REAPER_WORKER_DB_PASSWORD": "worker-pw",
    "REDIS_PASSWORD": "redis-pw",
    "FLOWER_BASIC_AUTH": "ops:flower-pw",
}


def validator() -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMA_DIR / "compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_compose_file_is_valid_against_the_compose_specification_schema():
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator().iter_errors(raw())
    ]
    assert errors == []
    # as Compose sees it once interpolated, too
    assert list(validator().iter_errors(load(SECRETS))) == []


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (["services", "worker", "comand"], ["celery"]),  # a misspelt key
        (["services", "worker", "depends_on", "migrate", "condition"], "service_done"),
        (["services", "migrate", "restart"], ["no"]),
        (["secrets", "reaper_worker_db_password", "from_env"], "X"),
    ],
)
def test_the_schema_check_refuses_what_compose_refuses(path, value):
    document = copy.deepcopy(raw())
    node = document
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    assert list(validator().iter_errors(document)), path


def test_the_vendored_schema_names_its_source_and_licence():
    notes = (SCHEMA_DIR / "README.md").read_text()
    assert "https://github.com/compose-spec/compose-spec" in notes
    assert "schema/compose-spec.json" in notes
    assert re.search(r"commit: [0-9a-f]{40}", notes)
    assert "Apache License 2.0" in notes
    assert "Apache License" in (SCHEMA_DIR / "LICENSE").read_text()
    assert "Compose Specification" in (SCHEMA_DIR / "NOTICE").read_text()
    schema = json.loads((SCHEMA_DIR / "compose-spec.json").read_text())
    assert schema["title"] == "Compose Specification"


def test_interpolation_is_the_composes_own():
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("a$$b ${SET} $SET", env) == "a$b v v"
    assert interpolate("${EMPTY:-d} ${EMPTY-d} ${UNSET-d}", env) == "d  d"
    assert interpolate("${SET:+alt} ${EMPTY:+alt}", env) == "alt "
    for value in ("${EMPTY:?say}", "${UNSET?say}"):
        with pytest.raises(ComposeError, match="say"):
            interpolate(value, env)
    assert interpolate("${EMPTY?fine}", env) == ""


def services() -> dict[str, Any]:
    return load(SECRETS)["services"]


def environment(name: str) -> dict[str, str]:
    return {k: str(v) for k, v in (services()[name].get("environment") or {}).items()}


def test_each_service_logs_in_with_its_own_credentials():
    owner = services()["postgres"]["environment"]["POSTGRES_USER"]
    # the schema owner: the migration and the one-shot that makes the worker's login
    migrate = make_url(environment("migrate")["REAPER_DATABASE_URL"])
    assert (migrate.username, migrate.password) == (owner, SECRETS["POSTGRES_PASSWORD"])
    assert environment("db-logins")["PGUSER"] == owner
    # the worker: its own login, member of reaper_worker, never the owner
    worker = make_url(environment("worker")["REAPER_DATABASE_URL"])
    assert (worker.username, worker.password) == (
        WORKER_LOGIN,
        SECRETS["REAPER_WORKER_DB_PASSWORD"],
    )
    assert worker.host == migrate.host and worker.database == migrate.database
    # Flower: the broker and its auth, no database
    assert set(environment("flower")) == {"REAPER_BROKER_URL", "FLOWER_BASIC_AUTH"}
    # only the owner's services see the owner's password
    for name in services():
        seen = json.dumps(services()[name])
        if name not in ("postgres", "migrate", "db-logins"):
            assert SECRETS["POSTGRES_PASSWORD"] not in seen, name
        if name not in ("worker",):
            assert SECRETS["REAPER_WORKER_DB_PASSWORD"] not in seen, name


def test_redis_requires_a_password_and_every_broker_url_carries_it():
    command = services()["redis"]["command"]
    assert command[command.index("--requirepass") + 1] == SECRETS["REDIS_PASSWORD"]
    assert environment("redis")["REDISCLI_AUTH"] == SECRETS["REDIS_PASSWORD"]
    assert "PONG" in " ".join(services()["redis"]["healthcheck"]["test"])
    urls = {
        name: env["REAPER_BROKER_URL"]
        for name in services()
        if "REAPER_BROKER_URL" in (env := environment(name))
    }
    assert set(urls) == {"worker", "flower"}
    for name, url in urls.items():
        assert make_url(url).password == SECRETS["REDIS_PASSWORD"], name
        assert make_url(url).host == "redis", name


def test_the_worker_login_is_made_from_a_secret_after_the_migration():
    compose = load(SECRETS)
    one_shot = compose["services"]["db-logins"]
    assert one_shot["secrets"] == ["reaper_worker_db_password"]
    assert compose["secrets"]["reaper_worker_db_password"] == {
        "environment": "REAPER_WORKER_DB_PASSWORD"
    }
    script = one_shot["command"][-1]
    assert "/run/secrets/reaper_worker_db_password" in script
    assert f"CREATE ROLE {WORKER_LOGIN}" in script
    assert f"GRANT reaper_worker TO {WORKER_LOGIN}" in script
    assert "PASSWORD :'password'" in script  # a psql variable: never in the SQL text
    assert one_shot["restart"] == "no"
    assert one_shot["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    worker_needs = compose["services"]["worker"]["depends_on"]
    assert worker_needs["db-logins"]["condition"] == "service_completed_successfully"


def test_every_service_that_runs_the_reapers_code_waits_for_the_migration():
    """A worker started on an older schema refuses it (exit 3): the expand
    migrations come first (docs/runbooks/conference-room-reaper.md#deploying-a-release)."""
    compose = load(SECRETS)
    runs_the_code = [
        name
        for name, service in compose["services"].items()
        if service.get("build") and name != "migrate"
    ]
    assert sorted(runs_the_code) == ["flower", "worker"]
    for name in runs_the_code:
        needs = compose["services"][name]["depends_on"]
        assert needs["migrate"]["condition"] == "service_completed_successfully", name
    assert compose["services"]["migrate"]["command"] == ["reaper", "migrate"]


def test_kafka_sasl_is_shown_commented_with_the_variables_that_switch_it_on(monkeypatch):
    commented = {}
    for line in (ROOT / "docker-compose.yml").read_text().splitlines():
        found = re.match(r"^\s*#\s*(REAPER_KAFKA_(?:SASL|SECURITY|SSL)_[A-Z_]+):\s*(\S+)", line)
        if found:
            commented[found[1]] = found[2]
    assert set(commented) >= {
        "REAPER_KAFKA_SECURITY_PROTOCOL",
        "REAPER_KAFKA_SASL_MECHANISM",
        "REAPER_KAFKA_SASL_USERNAME",
        "REAPER_KAFKA_SASL_PASSWORD",
    }
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    assert set(commented) <= known
    assert commented["REAPER_KAFKA_SECURITY_PROTOCOL"].startswith("SASL_")
    assert commented["REAPER_KAFKA_SASL_PASSWORD"].startswith("${REAPER_KAFKA_SASL_PASSWORD:?")
    # uncommented, they are a valid configuration (the CA file aside: it is a path
    # inside the container)
    for name, value in commented.items():
        if name != "REAPER_KAFKA_SSL_CAFILE":
            monkeypatch.setenv(name, interpolate(value, {"REAPER_KAFKA_SASL_PASSWORD": "pw"}))
    settings = Settings()
    assert settings.kafka_security_protocol == commented["REAPER_KAFKA_SECURITY_PROTOCOL"]
    assert settings.kafka_sasl_password is not None


def example_env() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            out[name.strip()] = value
    return out


def test_the_example_env_file_names_every_secret_and_holds_none():
    needed = variables()
    assert set(example_env()) == needed
    assert all(value == "" for value in example_env().values())  # compose refuses empty ones
    for name in needed:
        with pytest.raises(ComposeError, match=name):
            load({**SECRETS, name: ""})
    # the real file stays out of the repository
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()
    commented = ENV_EXAMPLE.read_text()
    assert "# REAPER_KAFKA_SASL_PASSWORD=" in commented


def test_the_dockerfiles_cmd_is_the_compose_workers_command():
    """What the image runs by default, as the Dockerfile writes it; the image
    test (tests/test_image.py) runs it from the locked tree as the image's user."""
    [cmd] = image("CMD")
    argv = json.loads(cmd)  # the exec form: a JSON array, no shell
    assert argv == services()["worker"]["command"]
    assert argv[:5] == ["celery", "-A", "reaper", "worker", "-B"]
    # explicit concurrency, not one pool process per host CPU
    assert int(argv[argv.index("--concurrency") + 1]) == 2
    # the health check stays /healthz
    [check] = image("HEALTHCHECK")
    assert "/healthz" in check


def test_the_dockerfile_copies_the_image_tests_tree_and_makes_its_users_one_directory():
    """The Dockerfile's text: the tree tests/test_image.py builds and runs is the
    image's (same command, same prefix, on its PATH), the user it runs as is
    that test's, and beat's schedule goes in the directory made for that user."""
    [install] = build("RUN")
    assert f"scripts/deps.py service-tree {IMAGE_PREFIX} " in install + " "
    assert image("COPY") == [f"--from=build {IMAGE_PREFIX} {IMAGE_PREFIX}"]
    [env] = image("ENV")
    assert f"PATH={IMAGE_PREFIX}/bin:$PATH" in env.split()
    [user] = image("USER")
    [made] = image("RUN")
    assert f"--uid {IMAGE_UID} " in made and made.split()[-1] == image("WORKDIR")[-1]
    [cmd] = image("CMD")
    argv = json.loads(cmd)
    schedule = Path(argv[argv.index("-s") + 1])
    assert f"install -d -o {user} -g {user} -m 0750 {schedule.parent}" in made
