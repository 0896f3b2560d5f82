"""What a campaign prints (docs/campaign.md#reading-a-report)."""

from __future__ import annotations

import math
from typing import Any


def replay_command(report: dict[str, Any]) -> str:
    return f"scripts/campaign --plan {report.get('workdir', '.')}/plan.json"


def _s(value: float) -> str:
    return "-" if value is None or math.isinf(value) or math.isnan(value) else f"{value:.1f}s"


def render(report: dict[str, Any]) -> str:
    lines = [
        f"campaign seed {report['seed']}  plan {report['plan_sha256'][:16]}  "
        f"{report['duration_s']:.0f}s  verdict: {report['verdict'].upper()}"
        + (f"  (planted: {report['plant']})" if report.get("plant") else ""),
    ]
    faults = report["faults"]
    lines.append(
        "faults per kind (landed/planned"
        + (", missed" if faults["missed"] else "")
        + f"), most at once {report['most_at_once']}:"
    )
    for kind, planned in faults["planned"].items():
        missed = faults["missed"].get(kind, 0)
        lines.append(
            f"  {kind:<24} {faults['landed'].get(kind, 0)}/{planned}"
            + (f"  missed {missed}" if missed else "")
        )
    rooms = report["rooms"]
    lines.append(
        f"rooms written {rooms['written']} {rooms['by_kind']}, joins committed "
        f"{rooms['joined']}, ended by a command {rooms['ended_by_command']}"
    )
    lines.append("invariants:")
    for name, check in report["invariants"].items():
        lines.append(f"  {name:<26} {check['verdict'].upper():<8} {check['detail']}")
        for example in check["examples"][:3]:
            lines.append(f"      e.g. {example}")
    ledger = report["invariants"].get("ledger", {}).get("counts", {})
    if ledger:
        lines.append(
            "delivery: "
            + ", ".join(
                f"{k} {ledger.get(k, 0)}"
                for k in ("lost", "duplicated", "unexpected", "redelivered", "out_of_order")
            )
        )
    lines.append("recovery per kind (p50 / p99 / max against its bound):")
    for kind, s in report["recovery"].items():
        mark = "ok" if s["max"] <= s["bound"] else "OVER"
        lines.append(
            f"  {kind:<24} n={s['n']:<3} {_s(s['p50'])} / {_s(s['p99'])} / {_s(s['max'])}"
            f"  bound {s['bound']:.0f}s  {mark}"
        )
    lines.append(
        "recovery paths taken: " + ", ".join(f"{k} {v}" for k, v in report["paths"].items())
    )
    lines.append(f"replay: {replay_command(report)}")
    return "\n".join(lines)


def summary(reports: list[dict[str, Any]]) -> str:
    """Across seeds: one line each, then the totals."""
    lines = [f"{len(reports)} campaigns:"]
    kinds: dict[str, int] = {}
    worst: dict[str, float] = {}
    for r in reports:
        lost = r["invariants"].get("ledger", {}).get("counts", {}).get("lost", "?")
        failing = [n for n, c in r["invariants"].items() if c["verdict"] != "pass"]
        lines.append(
            f"  seed {r['seed']:<10} {r['verdict'].upper():<8} faults "
            f"{sum(r['faults']['landed'].values())} (most at once {r['most_at_once']}), "
            f"lost {lost}"
            + (f"; not passed: {', '.join(failing)}" if failing else "")
            + f"; replay: {replay_command(r)}"
        )
        for kind, n in r["faults"]["landed"].items():
            kinds[kind] = kinds.get(kind, 0) + n
        for kind, s in r["recovery"].items():
            worst[kind] = max(worst.get(kind, 0.0), s["max"])
    lines.append(f"faults landed: {sum(kinds.values())} {dict(sorted(kinds.items()))}")
    lines.append(
        "worst recovery per kind: " + ", ".join(f"{k} {_s(v)}" for k, v in sorted(worst.items()))
    )
    verdicts = [r["verdict"] for r in reports]
    lines.append(
        f"verdicts: pass {verdicts.count('pass')}, fail {verdicts.count('fail')}, "
        f"unknown {verdicts.count('unknown')}"
    )
    return "\n".join(lines)
