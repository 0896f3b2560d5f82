"""The fault campaign in the suite (docs/campaign.md#in-the-suite): one fixed
seed and every regression plan kept in tests/campaign/regressions/ must pass;
and a planted defect must be reported, so the campaign is seen to fail when
an invariant breaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.campaign import report as printing
from tests.campaign.plan import Plan, draw
from tests.campaign.runner import PLANTS, run
from tests.support.figures import figure

pytestmark = pytest.mark.process

REGRESSIONS = sorted((Path(__file__).parent / "campaign" / "regressions").glob("*.json"))
# The seed CI runs, chosen for what its 2.5 minutes hold (8 faults, 3 at once):
# a frozen lock holder, a frozen relay pass, Kafka cut, a worker killed, Redis
# restarted: every recovery path has a fault that leads to it.
FIXED_SEED = 20261337
FIXED_MINUTES = 2.5


def test_the_fixed_seed_and_every_regression_plan_pass(tmp_path):
    """The fixed seed, then each plan kept in tests/campaign/regressions/ (a
    failing plan shrunk, its defect since fixed), all run; every one must pass."""
    plan = draw(FIXED_SEED, FIXED_MINUTES)
    report = run(plan, tmp_path / "fixed")
    failed = []
    for name, result in [
        ("fixed", report),
        *((p.stem, run(Plan.read(p), tmp_path / p.stem)) for p in REGRESSIONS),
    ]:
        text = printing.render(result)
        print(text)
        if result["verdict"] != "pass":
            failed.append(f"{name}:\n{text}")
    assert not failed, "\n\n".join(failed)
    landed = sum(report["faults"]["landed"].values())
    figure(
        f"campaign seed {FIXED_SEED} ({plan.sha256[:12]}): {landed} "
        f"faults, most at once {report['most_at_once']}, recovery max per kind "
        + ", ".join(f"{k} {s['max']:.1f}s/{s['bound']:.0f}s" for k, s in report["recovery"].items())
    )


def test_planted_defects_are_reported(tmp_path):
    """A plan with no fault and every planted defect (runner.PLANTS): the
    campaign fails, and each invariant that guards against one fails with an
    example; the others hold."""
    plan = draw(FIXED_SEED, 1, plant=",".join(PLANTS)).with_faults(())
    report = run(plan, tmp_path / "planted")
    print(printing.render(report))
    assert report["verdict"] == "fail"
    caught = set(PLANTS.values())
    for plant, invariant in PLANTS.items():
        # the planted room itself is among the examples of the guarding invariant
        room = report["planted"][plant]
        assert room in json.dumps(report["invariants"][invariant]["examples"]), (plant, room)
    for name, check in report["invariants"].items():
        if name in caught:
            assert check["verdict"] == "fail", name
        elif name not in ("coverage", "recovery"):  # no fault: nothing to cover or recover
            assert check["verdict"] == "pass", (name, check)
