"""Shrinking: a failing plan reduced to a smaller plan that still fails
(docs/campaign.md#replaying-and-shrinking).

Delta debugging (Zeller's ddmin) over the plan's faults: try halves, then
their complements, then finer pieces, keeping any smaller set that still
fails; then each remaining fault is shortened to half its length while the
plan still fails. Every try is a whole campaign run of the smaller plan
(``fails``), so ``budget`` caps how many runs shrinking may spend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tests.campaign.plan import LENGTH_S, Fault, Plan


@dataclass
class Shrunk:
    plan: Plan
    tries: int = 0
    history: list[str] = field(default_factory=list)


class _Budget(Exception):
    pass


def shrink(plan: Plan, fails: Callable[[Plan], bool], budget: int = 12) -> Shrunk:
    """The smallest plan found (by ddmin, then shorter faults) for which
    ``fails`` still holds; ``plan`` itself when nothing smaller fails.
    ``fails(plan)`` is not asked again for the plan given: it failed."""
    out = Shrunk(plan)

    def still_fails(candidate: Plan, what: str) -> bool:
        if out.tries >= budget:
            raise _Budget
        out.tries += 1
        failed = fails(candidate)
        out.history.append(f"{what}: {'fails' if failed else 'passes'}")
        return failed

    try:
        faults = _ddmin(
            list(plan.faults), lambda fs, what: still_fails(plan.with_faults(tuple(fs)), what)
        )
        out.plan = plan.with_faults(tuple(faults))
        for i, fault in enumerate(faults):
            shorter = max(LENGTH_S[0], round(fault.length / 2, 1))
            if shorter >= fault.length:
                continue
            trial = list(faults)
            trial[i] = replace(fault, length=shorter)
            if still_fails(
                plan.with_faults(tuple(trial)), f"{fault.kind} {fault.length}s -> {shorter}s"
            ):
                faults = trial
                out.plan = plan.with_faults(tuple(faults))
    except _Budget:
        out.history.append(f"budget of {budget} runs spent")
    return out


def _ddmin(faults: list[Fault], fails: Callable[[list[Fault], str], bool]) -> list[Fault]:
    """ddmin: the subsets are tried in order, each one once."""
    n = 2
    while len(faults) >= 2:
        size = len(faults) // n
        chunks = [faults[i : i + size] for i in range(0, len(faults), size)] if size else []
        reduced = False
        for chunk in chunks:
            if fails(chunk, f"keep {len(chunk)} of {len(faults)} faults"):
                faults, n, reduced = chunk, 2, True
                break
        if not reduced:
            for i in range(len(chunks)):
                rest = [f for j, c in enumerate(chunks) if j != i for f in c]
                if len(chunks) > 2 and fails(
                    rest, f"drop {len(chunks[i])} of {len(faults)} faults"
                ):
                    faults, n, reduced = rest, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(faults):
                break
            n = min(len(faults), 2 * n)
    if len(faults) == 1 and fails([], "drop the last fault"):
        return []
    return faults
