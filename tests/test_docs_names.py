"""The tables of names in docs/design.md, each held to the code it lists: the
metrics (names, types, labels and their values), the commands and their
options, the tasks and their result keys, the spellings of a phase, and the
layers of the package. Each table is written once, in docs/design.md; other
pages link to it. The configuration and the log events are held by
tests/test_docs.py.
"""

from __future__ import annotations

import argparse
import ast
import re
import tomllib
from datetime import UTC, datetime

import yaml
from prometheus_client import Metric

from reaper import metrics
from reaper.cli import build_parser
from reaper.events import Counts, RelayResult, RelayTaskResult
from reaper.phases import ORDER, PHASES
from reaper.recorder import StopPassResult
from reaper.runs import COUNT_KEYS, cycle_result
from tests.support.docs import ROOT, names, table

DESIGN = ROOT / "docs" / "design.md"


def difference(what: str, documented: object, actual: object) -> str:
    return f"{what}: docs/design.md says {documented!r}, the code {actual!r}"


# -- metrics -------------------------------------------------------------------


def exported() -> dict[str, Metric]:
    """Name -> family of every metric the worker serves (counters with their
    ``_total``, as they are scraped)."""
    families: dict[str, Metric] = {}
    for family in metrics.registry().collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        families[name] = family
    return families


def labels_of(family: Metric) -> dict[str, set[str]]:
    """Label -> the values its series have (every labelled series exists from the start)."""
    found: dict[str, set[str]] = {}
    for sample in family.samples:
        for label, value in sample.labels.items():
            if label != "le":  # a histogram's buckets
                found.setdefault(label, set()).add(value)
    return found


def documented_metrics() -> dict[str, tuple[str, dict[str, set[str] | None]]]:
    """Name -> (type, label -> its listed values or None) from the metrics table,
    whose second cell reads ``type[, `label`[ = `value` \\| `value`...]]``."""
    documented: dict[str, tuple[str, dict[str, set[str] | None]]] = {}
    for cells in table(DESIGN, "Metrics"):
        (name,) = names(cells[0])
        assert name not in documented, f"{name} is listed twice"
        kind, *label_parts = [part.strip() for part in cells[1].split(",")]
        labels: dict[str, set[str] | None] = {}
        for part in label_parts:
            label, _, values = part.partition("=")
            (label_name,) = names(label)
            labels[label_name] = set(names(values)) if values else None
        documented[name] = (kind, labels)
    return documented


def test_every_metric_is_documented_and_nothing_else():
    documented, actual = set(documented_metrics()), set(exported())
    assert documented == actual, (
        f"missing from the table: {sorted(actual - documented)}; "
        f"in the table but not served: {sorted(documented - actual)}"
    )
    assert actual == set(metrics.EXPORTED), "metrics.EXPORTED, which ops/ is checked against"


def test_every_metric_is_documented_with_its_type_and_labels():
    families = exported()
    wrong: dict[str, object] = {}
    for name, (kind, labels) in documented_metrics().items():
        family = families[name]
        actual = labels_of(family)
        if kind != family.type or set(labels) != set(actual):
            wrong[name] = ((kind, sorted(labels)), (family.type, sorted(actual)))
        for label, values in labels.items():
            if values is not None and values != actual.get(label):
                wrong[f"{name}{{{label}}}"] = (sorted(values), sorted(actual.get(label, ())))
    assert not wrong, f"metric: (documented, served): {wrong}"


# -- the command line ----------------------------------------------------------


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict:
    """Every command the parser runs (its words) -> the options it takes."""
    found = {}
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    options = {
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    if subparsers:
        if options:  # the top level's own: --version
            found[path] = options
        for word, child in subparsers[0].choices.items():
            found.update(commands(child, (*path, word)))
    else:
        found[path] = options
    return found


def documented_commands() -> dict[tuple[str, ...], set[str]]:
    """The words of each row's command -> the options its rows name."""
    documented: dict[tuple[str, ...], set[str]] = {}
    for cells in table(DESIGN, "The command line"):
        usage = " ".join(names(cells[0]))
        assert usage.startswith("reaper "), f"a command row without `reaper ...`: {cells[0]}"
        words = tuple(re.match(r"reaper((?: [a-z]+)*)", usage).group(1).split())  # type: ignore[union-attr]
        documented.setdefault(words, set()).update(re.findall(r"--[a-z][a-z-]*", usage))
    return documented


def test_every_command_is_documented_with_its_options():
    documented = documented_commands()
    actual = commands(build_parser())
    assert set(documented) == set(actual), difference(
        "the commands", sorted(documented), sorted(actual)
    )
    wrong = {
        " ".join(words): (sorted(documented[words]), sorted(options))
        for words, options in actual.items()
        if documented[words] != options
    }
    assert not wrong, f"command: (documented options, the parser's): {wrong}"


# -- tasks and their results ---------------------------------------------------


def registered_tasks() -> set[str]:
    """The names given to ``@app.task(name=...)`` in reaper/tasks.py."""
    tree = ast.parse((ROOT / "reaper" / "tasks.py").read_text())
    return {
        str(keyword.value.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for keyword in node.keywords
        if keyword.arg == "name"
        and isinstance(keyword.value, ast.Constant)
        and str(keyword.value.value).startswith("reaper.")
    }


def tasks() -> dict[str, list[str]]:
    return {names(cells[0])[0]: cells for cells in table(DESIGN, "Tasks")}


def a_cycle_result() -> list[str]:
    counted = Counts(**{key: 0 for key in COUNT_KEYS})  # type: ignore[typeddict-item]
    return list(
        cycle_result(
            "r", datetime.now(UTC), skipped=False, counted=counted, duration_ms=0, paused=[]
        )
    )


def test_every_task_is_documented_and_nothing_else():
    assert set(tasks()) == registered_tasks(), difference(
        "the tasks", sorted(tasks()), sorted(registered_tasks())
    )


def test_the_result_keys_of_each_task_are_the_code_s():
    rows = tasks()
    results = {
        "reaper.relay_outbox": list(RelayTaskResult.__annotations__),
        "reaper.stop_recordings": list(StopPassResult().to_json()),
    }
    assert list(RelayResult().to_json()) == results["reaper.relay_outbox"]
    for task, keys in results.items():
        documented = names(rows[task][3])
        assert sorted(documented) == sorted(keys), difference(f"{task}'s result", documented, keys)


def test_the_result_keys_of_a_cycle_are_listed_in_their_order():
    lines = DESIGN.read_text().split("Result keys of a cycle:", 1)[1].splitlines()
    documented: list[str] = []
    for line in lines[1:]:
        if line and not line.startswith(("- ", "  ")):
            break
        if line.startswith("- "):
            documented += names(line.split(":", 1)[0])
    assert documented == a_cycle_result(), difference(
        "the result keys of a cycle", documented, a_cycle_result()
    )


# -- the spellings of a phase --------------------------------------------------


def test_the_phase_table_of_the_glossary_is_the_phases():
    header, *rows = table(DESIGN, "Glossary", header=True)
    columns = [name for cell in header[1:-1] for name in names(cell)]
    assert columns == list(ORDER), difference("the phases' columns", columns, list(ORDER))
    wrong = {}
    for cells in rows:
        attributes = [a.removeprefix("Phase.") for a in names(cells[0])]
        for phase, cell in zip((PHASES[name] for name in ORDER), cells[1:-1], strict=True):
            actual = [str(getattr(phase, attribute)) for attribute in attributes]
            if names(cell) != actual:
                wrong[f"{phase.name}.{'/'.join(attributes)}"] = (names(cell), actual)
    assert not wrong, f"phase.attribute: (documented, the Phase's): {wrong}"


# -- the layers ----------------------------------------------------------------


def test_the_structure_table_is_the_layers_contract():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    layers = [sorted(layer.split(" | ")) for layer in contract["layers"]]
    documented = [sorted(names(cells[1])) for cells in table(DESIGN, "Structure")]
    assert documented == layers, difference("the layers, from the top", documented, layers)


# -- alerts --------------------------------------------------------------------


def test_the_alerts_table_is_the_rules_with_their_severity():
    rules = yaml.safe_load((ROOT / "ops" / "prometheus" / "alerts.yml").read_text())
    actual = {
        rule["alert"]: rule["labels"]["severity"]
        for group in rules["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    documented = {names(cells[0])[0]: cells[2] for cells in table(DESIGN, "Alerts")}
    assert documented == actual, difference("alert: severity", documented, actual)
