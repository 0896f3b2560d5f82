"""``scripts/campaign``: run campaigns from seeds or a plan file, print each
report and, with several seeds, a summary; shrink a failing plan
(docs/campaign.md#running-it). Exit 0 only when every run passed."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.campaign import report as printing
from tests.campaign.bounds import KINDS
from tests.campaign.plan import Plan, draw
from tests.campaign.runner import PLANTS, run
from tests.campaign.shrink import shrink

REGRESSIONS = Path(__file__).parent / "regressions"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/campaign", description=__doc__)
    p.add_argument("--seed", type=int, help="the seed of the (first) plan; fresh when unset")
    p.add_argument("--minutes", type=float, default=3.0, help="length of each campaign")
    p.add_argument("--seeds", type=int, default=1, help="run this many seeds, one after another")
    p.add_argument("--plan", type=Path, help="replay this plan file instead of drawing one")
    p.add_argument("--report", type=Path, help="write the verdict(s) as JSON here")
    p.add_argument("--kinds", help="comma-separated fault kinds to draw from (default: all)")
    p.add_argument(
        "--plant",
        help=f"plant defects the campaign must report (comma-separated: {', '.join(PLANTS)})",
    )
    p.add_argument("--workdir", type=Path, help="where plans, actions and logs go")
    p.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    p.add_argument(
        "--shrink",
        type=int,
        default=0,
        metavar="RUNS",
        help="a failing plan is shrunk with at most RUNS more runs and kept in "
        "tests/campaign/regressions/",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        print(f"unknown fault kinds: {', '.join(unknown)}; known: {', '.join(KINDS)}")
        return 2
    unknown = sorted(set(args.plant.split(",")) - set(PLANTS)) if args.plant else []
    if unknown:
        print(f"unknown plants: {', '.join(unknown)}; known: {', '.join(PLANTS)}")
        return 2
    if args.plan:
        plans = [Plan.read(args.plan)]
    else:
        first = args.seed if args.seed is not None else random.SystemRandom().randrange(10**9)
        plans = [
            draw(first + i, args.minutes, kinds, plant=args.plant or "") for i in range(args.seeds)
        ]
    if args.dry_run:
        for plan in plans:
            print(json.dumps({**plan.to_json(), "sha256": plan.sha256}, indent=2))
        return 0
    base = args.workdir or Path(tempfile.mkdtemp(prefix="reaper-campaign-"))
    reports: list[dict[str, Any]] = []
    for plan in plans:
        print(
            f"campaign: seed {plan.seed}, plan {plan.sha256[:16]}, {len(plan.faults)} faults, "
            f"{plan.duration_s:.0f}s; work in {base / str(plan.seed)}",
            flush=True,
        )
        result = run(plan, base / str(plan.seed))
        reports.append(result)
        print(printing.render(result), flush=True)
        if result["verdict"] == "fail" and args.shrink:
            kept = shrink_and_keep(plan, base / f"{plan.seed}-shrink", args.shrink)
            result["shrunk"] = str(kept)
            print(f"shrunk plan kept: {kept}", flush=True)
    if len(reports) > 1:
        print(printing.summary(reports))
    if args.report:
        args.report.write_text(
            json.dumps(reports[0] if len(reports) == 1 else reports, indent=2, default=str) + "\n"
        )
    return 0 if all(r["verdict"] == "pass" for r in reports) else 1


def shrink_and_keep(plan: Plan, workdir: Path, budget: int) -> Path:
    """Shrink a failing plan by running smaller ones; keep the smallest that fails
    where the suite replays it."""
    tries = iter(range(budget))

    def fails(candidate: Plan) -> bool:
        result = run(candidate, workdir / f"try-{next(tries)}")
        return bool(result["verdict"] == "fail")

    shrunk = shrink(plan, fails, budget)
    REGRESSIONS.mkdir(exist_ok=True)
    path = REGRESSIONS / f"seed-{plan.seed}-{shrunk.plan.sha256[:12]}.json"
    shrunk.plan.notes["shrunk_from"] = plan.sha256
    shrunk.plan.notes["shrinking"] = shrunk.history
    shrunk.plan.write(path)
    shutil.rmtree(workdir, ignore_errors=True)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
