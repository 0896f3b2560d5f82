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

pytestmark = [pytest.mark.process, pytest.mark.long]

REGRESSIONS = sorted((Path(__file__).parent / "campaign" / "regressions").glob("*.json"))
# The seed CI runs, for what its 3.5 minutes hold (11 faults, 3 at once): a
# pool child killed, a lock holder frozen past its lease (a takeover), a relay
# pass killed while the broker's answers were dropped (a duplicate publish,
# then a retry), a relay pass frozen, Redis restarted, the beat and a worker's
# parent killed while a run is open (a chain to rescue), a held snapshot and
# held rows, the lock's session ended. The plan is drawn from the kinds in
# tests/campaign/bounds.py: a new kind draws another plan for the same seed.
FIXED_SEED = 20261207
FIXED_MINUTES = 3.5


# Its own bound, over the suite's 300 s: 3.5 minutes of plan, its world's start
# and the verdict's reads (225 s in one fresh-clone run, over 300 s in the next),
# plus a run for every regression plan kept.
@pytest.mark.timeout(900)
def test_the_fixed_seed_and_every_regression_plan_hold(tmp_path):
    """The fixed seed, then each plan kept in tests/campaign/regressions/ (a
    failing plan shrunk, its defect since fixed), all run: no invariant may
    fail, and every one but coverage must pass. Coverage is printed, not
    asserted: on one short seed the duplicate-publish path is left to chance
    (the relay's idempotent producer deduplicates its own retries; a duplicate
    needs another process to send a batch again), and a pass whose target
    was between passes misses. scripts/campaign itself exits non-zero on an
    unknown coverage; the long runs are where it must be met."""
    plan = draw(FIXED_SEED, FIXED_MINUTES)
    report = run(plan, tmp_path / "fixed")
    failed = []
    for name, result in [
        ("fixed", report),
        *((p.stem, run(Plan.read(p), tmp_path / p.stem)) for p in REGRESSIONS),
    ]:
        text = printing.render(result)
        print(text)
        held = {n: c["verdict"] for n, c in result["invariants"].items() if n != "coverage"}
        if result["verdict"] == "fail" or set(held.values()) != {"pass"}:
            failed.append(f"{name}:\n{text}")
    assert not failed, "\n\n".join(failed)
    landed = sum(report["faults"]["landed"].values())
    figure(
        f"campaign seed {FIXED_SEED} ({plan.sha256[:12]}): {landed} "
        f"faults, most at once {report['most_at_once']}, recovery max per kind "
        + ", ".join(f"{k} {s['max']:.1f}s/{s['bound']:.0f}s" for k, s in report["recovery"].items())
        + f"; coverage {report['invariants']['coverage']['verdict']}: "
        + report["invariants"]["coverage"]["detail"]
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
