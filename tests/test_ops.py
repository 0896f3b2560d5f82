"""The deployment files: alert rules (promtool), Grafana dashboard, docker-compose.yml, Procfile."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from reaper import metrics
from reaper.cli import build_parser
from reaper.config import ENV_PREFIX, Settings, load_settings
from reaper.health import CLOSING_INTERVALS
from reaper.ledger import Verdict

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "ops" / "prometheus"
PROMTOOL_INSTALL = "apt-get install -y --no-install-recommends prometheus"

_FUNCTION = re.compile(r"\b[a-z_]+\s*\(")
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "bool", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    expr = re.sub(r'"[^"]*"', "", expr)  # strings (label values, legends)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\boffset\s+\w+", "", expr)
    expr = _FUNCTION.sub("(", expr)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {n for n in names if n not in _KEYWORDS and not re.fullmatch(r"\d+[smhdwy]?", n)}


def exported_series() -> set[str]:
    """Every series name the service exposes (histograms: _bucket, _sum, _count):
    the worker's, and what `reaper reconcile --metrics-file` writes."""
    served = {s.name for family in metrics.registry().collect() for s in family.samples}
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "reconcile.prom"
        now = datetime.now(UTC)
        metrics.write_reconcile(str(path), Verdict(since=now - timedelta(hours=1), until=now))
        written = {
            s.name
            for family in text_string_to_metric_families(path.read_text())
            for s in family.samples
        }
    assert written == set(metrics.RECONCILE_EXPORTED)
    return served | written


def test_metric_name_extraction():
    assert metric_names(
        'histogram_quantile(0.95, sum by (le, phase) (rate(a_bucket{phase="x"}[5m]))) > 60'
    ) == {"a_bucket"}
    assert metric_names("sum(increase(b_total[1m])) == 0 or absent(c)") == {"b_total", "c"}


# -- alert rules -----------------------------------------------------------------


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.fail(f"promtool is not installed; install it with: {PROMTOOL_INSTALL}")
    return found


@pytest.mark.process
def test_alert_rules_pass_their_promtool_unit_tests():
    tool = promtool()
    for args in (
        ["check", "rules", "alerts.yml"],
        ["check", "config", "prometheus.yml"],
        ["test", "rules", "alerts.test.yml"],
    ):
        done = subprocess.run(
            [tool, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
        assert "SUCCESS" in done.stdout + done.stderr


def test_alert_rules_cover_the_spec_and_read_only_exported_metrics():
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    alerts = {r["alert"]: r for group in rules["groups"] for r in group["rules"]}
    assert {
        "ConferenceReaperNotRunning",  # no growth of run_total over two intervals
        "ConferenceReaperNotClosing",  # no run completed (any worker) for four intervals
        "ConferenceReaperBacklogHigh",  # active_backlog > 20 for 2 min
        "ConferenceProvisionFailuresRising",
        "ConferenceReaperErrors",
        "ConferenceEndedRelayLagging",
    } <= set(alerts)
    assert alerts["ConferenceReaperBacklogHigh"]["for"] == "2m"
    assert "> 20" in alerts["ConferenceReaperBacklogHigh"]["expr"]
    # the same count of intervals as /healthz (windows assume 30 s)
    assert f"> {CLOSING_INTERVALS * 30}\n" in alerts["ConferenceReaperNotClosing"]["expr"]
    exported = exported_series()
    for name, rule in alerts.items():
        used = metric_names(rule["expr"])
        assert used and used <= exported, (name, used - exported)
        anchor = rule["annotations"]["runbook"].split("#", 1)[1]
        assert anchor in runbook_anchors(), (name, anchor)


def runbook_anchors() -> set[str]:
    text = (ROOT / "docs" / "runbooks" / "conference-room-reaper.md").read_text()
    headings = re.findall(r"^#+\s+(.+)$", text, re.MULTILINE)
    return {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-") for h in headings}


# -- Grafana ---------------------------------------------------------------------


def expressions(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in expressions(value)]
    if isinstance(node, list):
        return [e for value in node for e in expressions(value)]
    return []


def test_dashboard_reads_only_metrics_the_service_exports():
    dashboard = json.loads((ROOT / "ops" / "grafana" / "reaper-dashboard.json").read_text())
    exprs = expressions(dashboard["panels"])
    assert len(exprs) >= 8
    exported = exported_series()
    used: set[str] = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names and names <= exported, (expr, names - exported)
        used |= names
    # cycles, items by outcome, backlog, lateness, relay lag
    assert {
        "messenger_conf_reaper_run_total",
        "messenger_conf_reaper_items_total",
        "messenger_conf_reaper_active_backlog",
        "messenger_conf_reaper_closing_lateness_seconds_bucket",
        "messenger_outbox_oldest_pending_age_seconds",
    } <= used


def test_every_contract_metric_is_in_the_registry():
    families = {f.name for f in metrics.registry().collect()}
    for name in metrics.EXPORTED:
        assert name.removesuffix("_total") in families


# -- docker-compose.yml and the Procfile -----------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def procfile() -> dict[str, list[str]]:
    entries = {}
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, command = line.partition(":")
            entries[name.strip()] = shlex.split(command)
    return entries


def core(argv: list[str]) -> list[str]:
    """A command without what differs by place: binary path, beat file, bind address."""
    out: list[str] = [Path(argv[0]).name]
    skip = False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg == "-s":
            skip = True
        elif not arg.startswith(("--address=", "--schedule=")):
            out.append(arg)
    return out


def test_procfile_and_compose_run_the_same_worker_and_flower():
    services = compose()["services"]
    procs = procfile()
    assert set(procs) >= {"worker", "flower"}
    assert core(procs["worker"]) == core(services["worker"]["command"])
    assert core(procs["flower"]) == core(services["flower"]["command"])
    assert core(procs["worker"])[:5] == ["celery", "-A", "reaper", "worker", "-B"]
    assert core(procs["flower"])[:4] == ["celery", "-A", "reaper", "flower"]
    # Flower on loopback only: the Procfile binds it there, compose publishes it there
    assert "--address=127.0.0.1" in procs["flower"]
    assert all(p.startswith("127.0.0.1:") for p in services["flower"]["ports"])


def test_compose_has_the_services_their_health_and_order():
    services = compose()["services"]
    assert {"postgres", "redis", "kafka", "migrate", "worker", "flower", "prometheus"} <= set(
        services
    )
    # a real Kafka in KRaft mode, no ZooKeeper
    kafka_env = services["kafka"]["environment"]
    assert "controller" in kafka_env["KAFKA_PROCESS_ROLES"]
    assert not any("zookeeper" in name for name in services)
    # the migration is one-shot and is the CLI's own command
    assert services["migrate"]["command"] == ["reaper", "migrate"]
    assert services["migrate"]["restart"] == "no"
    assert build_parser().parse_args(services["migrate"]["command"][1:]).command == "migrate"
    # the worker starts after healthy services and a completed migration
    needs = services["worker"]["depends_on"]
    for name in ("postgres", "redis", "kafka"):
        assert needs[name]["condition"] == "service_healthy"
        assert services[name]["healthcheck"]["test"]
    # ... and once its login exists, which is made after the migration made its role
    assert needs["db-logins"]["condition"] == "service_completed_successfully"
    assert services["db-logins"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully"
    )
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    # the worker's health check is /healthz (503 when cycles stop, e.g. beat died)
    assert any("/healthz" in part for part in services["worker"]["healthcheck"]["test"])
    assert services["migrate"]["healthcheck"] == {"disable": True}
    # Prometheus loads the alert rules and scrapes the worker's metrics port
    assert "./ops/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert "alerts.yml" in config["rule_files"]
    targets = {
        t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    }
    port = services["worker"]["environment"]["REAPER_METRICS_PORT"]
    assert f"worker:{port}" in targets


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (service.get("environment") or {}).items()}


def test_compose_variables_are_the_services_own_and_secrets_come_from_the_environment(
    monkeypatch,
):
    services = compose()["services"]
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    for name in ("migrate", "worker", "flower"):
        env = environment_of(services[name])
        reaper_vars = {k for k in env if k.startswith(ENV_PREFIX)}
        assert reaper_vars, name
        assert reaper_vars <= known, (name, reaper_vars - known)
    assert environment_of(services["flower"])["FLOWER_BASIC_AUTH"].startswith(
        "${FLOWER_BASIC_AUTH:?"
    )
    for service in services.values():
        for key, value in environment_of(service).items():
            if re.search(r"PASSWORD|SECRET|TOKEN|AUTH", key):
                assert value.startswith("${"), (key, value)
    url = environment_of(services["worker"])["REAPER_DATABASE_URL"]
    assert "${REAPER_WORKER_DB_PASSWORD" in url
    # what the containers get is a valid configuration for the worker and the CLI
    for key, value in environment_of(services["worker"]).items():
        if key.startswith(ENV_PREFIX):
            value = re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "pw", value)
            value = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("REAPER_RECORDER_URL", raising=False)  # empty default: unset
    settings = load_settings()
    assert settings.metrics_port == 9808
    assert settings.kafka_bootstrap_servers == "kafka:9092"


def test_dockerfile_installs_the_project():
    text = (ROOT / "Dockerfile").read_text()
    assert "scripts/deps.py service-tree /opt/reaper" in text and "COPY reaper" in text
    assert "USER " in text  # not root
    [check] = [line for line in text.splitlines() if line.startswith("HEALTHCHECK")]
    assert "/healthz" in text.split(check, 1)[1].splitlines()[1]
