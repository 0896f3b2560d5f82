"""The campaign's plan: the whole schedule of faults and workload, drawn from a
seed before anything runs (docs/campaign.md#the-plan).

A plan is data: it is written as JSON with its sha256, replayed from that file
(``scripts/campaign --plan FILE``) against any build, and shrunk by dropping
and shortening its faults (tests/campaign/shrink.py). Drawing it is a pure
function of the seed, the minutes and the kinds allowed.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tests.campaign.bounds import KINDS, LAST_IN_EPISODE, RECOVERY_BOUNDS, WORKER_KINDS

PLAN_VERSION = 1
# Before the first fault: the workers start, the first rooms are written and
# the first cycles run, so a fault hits a system that works.
WARM_UP_S = 12.0
# After the last heal: the longest recovery bound, then one interval plus the
# lease before "nothing eligible is left" is checked (runner.py).
COOL_DOWN_S = 40.0
# A fault lasts this long at least (a cut shorter than the TCP bounds tests
# nothing) and at most.
LENGTH_S = (3.0, 12.0)
# Faults of one episode start within this many seconds of each other.
SPREAD_S = 4.0
# The calm window after an episode: its kinds' longest bound times this, so
# the probe of the episode's recovery has time to show it (and a slow one is
# a finding, not a window too short).
CALM_FACTOR = 1.0
WORKERS = ("a", "b")


@dataclass(frozen=True)
class Fault:
    """One fault: its kind, whom it hits ("a"/"b" for a worker, "" otherwise),
    when it starts (seconds from the campaign's start) and how long it lasts
    before it is undone. ``episode``: the faults of one episode overlap."""

    kind: str
    start: float
    length: float
    target: str = ""
    episode: int = 0

    @property
    def end(self) -> float:
        return self.start + self.length


@dataclass(frozen=True)
class Workload:
    """Seeded timings of the rooms the campaign writes (workload.py)."""

    seed: int
    # mean seconds between two rooms written
    gap_s: float = 0.4
    # shares of the kinds of rooms (workload.ROOM_KINDS order)
    mix: tuple[float, ...] = (0.3, 0.15, 0.15, 0.15, 0.15, 0.1)


@dataclass(frozen=True)
class Plan:
    seed: int
    duration_s: float
    faults: tuple[Fault, ...]
    workload: Workload
    # a planted defect (runner.PLANTS), to show an invariant catches it; "" for none
    plant: str = ""
    version: int = PLAN_VERSION
    notes: dict[str, Any] = field(default_factory=dict)

    # -- as a file -----------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["faults"] = [asdict(f) for f in self.faults]
        data["workload"]["mix"] = list(self.workload.mix)
        return data

    def canonical(self) -> str:
        """The text the hash is of: sorted keys, no spaces (notes left out: they
        say where a plan came from, not what it does)."""
        data = self.to_json()
        data.pop("notes")
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({**self.to_json(), "sha256": self.sha256}, indent=2) + "\n")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        if data.get("version") != PLAN_VERSION:
            raise ValueError(
                f"plan version {data.get('version')!r}, this build reads {PLAN_VERSION}"
            )
        workload = dict(data["workload"])
        workload["mix"] = tuple(workload["mix"])
        plan = cls(
            seed=int(data["seed"]),
            duration_s=float(data["duration_s"]),
            faults=tuple(Fault(**f) for f in data["faults"]),
            workload=Workload(**workload),
            plant=data.get("plant", ""),
            notes=dict(data.get("notes", {})),
        )
        for fault in plan.faults:
            if fault.kind not in KINDS:
                raise ValueError(f"unknown fault kind {fault.kind!r}")
        written = data.get("sha256")
        if written is not None and written != plan.sha256:
            raise ValueError(f"plan hash {written} does not match its content ({plan.sha256})")
        return plan

    @classmethod
    def read(cls, path: Path) -> Plan:
        return cls.from_json(json.loads(path.read_text()))

    # -- what it holds -------------------------------------------------------------

    def kinds(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for fault in self.faults:
            counts[fault.kind] = counts.get(fault.kind, 0) + 1
        return dict(sorted(counts.items()))

    def most_at_once(self) -> int:
        """The most faults in force at one moment."""
        edges = sorted(
            [(f.start, 1) for f in self.faults] + [(f.end, -1) for f in self.faults],
            key=lambda e: (e[0], e[1]),  # an end before a start at the same moment
        )
        most = now = 0
        for _, step in edges:
            now += step
            most = max(most, now)
        return most

    def episodes(self) -> dict[int, tuple[Fault, ...]]:
        found: dict[int, list[Fault]] = {}
        for fault in self.faults:
            found.setdefault(fault.episode, []).append(fault)
        return {e: tuple(sorted(fs, key=lambda f: f.start)) for e, fs in sorted(found.items())}

    def with_faults(self, faults: tuple[Fault, ...]) -> Plan:
        """The same plan with these faults, its duration cut to what they need."""
        last = max((f.end for f in faults), default=0.0)
        return replace(
            self,
            faults=faults,
            duration_s=min(self.duration_s, max(WARM_UP_S, last) + COOL_DOWN_S),
        )


def calm_after(faults: tuple[Fault, ...] | list[Fault]) -> float:
    """The calm window an episode of these faults needs to recover."""
    return CALM_FACTOR * max(RECOVERY_BOUNDS[f.kind] for f in faults)


def draw(seed: int, minutes: float, kinds: tuple[str, ...] = KINDS, *, plant: str = "") -> Plan:
    """The whole schedule for ``minutes`` of campaign, from ``seed`` alone.

    Episodes follow each other: 1 to 3 faults of distinct kinds starting
    within SPREAD_S of each other (so they overlap), each lasting LENGTH_S,
    then a calm window long enough for the slowest of them to recover. Kinds
    are dealt from a shuffled deck so that every kind comes up before any
    repeats: a short campaign still covers them."""
    if not kinds:
        raise ValueError("no fault kinds to draw from")
    rng = random.Random(seed)
    total = minutes * 60.0
    deck: list[str] = []
    faults: list[Fault] = []
    t = WARM_UP_S
    episode = 0
    while True:
        size = rng.choice((1, 1, 2, 2, 3))
        chosen: list[str] = []
        while len(chosen) < min(size, len(kinds)):
            if not deck:
                deck = list(kinds)
                rng.shuffle(deck)
            kind = deck.pop()
            if kind in chosen:
                deck.insert(0, kind)  # later, not in this episode
                continue
            chosen.append(kind)
        # stable: the others keep the order they were dealt in
        chosen.sort(key=lambda kind: LAST_IN_EPISODE.get(kind, 0))
        members: list[Fault] = []
        first_length = round(rng.uniform(*LENGTH_S), 1)
        # the others start while the first is in force (so they overlap it)
        latest = min(SPREAD_S, first_length - 0.5)
        offsets = [0.0, *sorted(rng.uniform(0.2, latest) for _ in chosen[1:])]
        for i, (kind, offset) in enumerate(zip(chosen, offsets, strict=True)):
            length = first_length if i == 0 else round(rng.uniform(*LENGTH_S), 1)
            target = rng.choice(WORKERS) if kind in WORKER_KINDS else ""
            if LAST_IN_EPISODE.get(kind) == 1 and any(
                LAST_IN_EPISODE.get(m.kind) == 1 and m.target == target for m in members
            ):  # a worker already down in this episode: the other one goes down too
                target = next(w for w in WORKERS if w != target)
            members.append(Fault(kind, round(t + offset, 1), length, target, episode))
        end = max(f.end for f in members) + calm_after(members)
        if end + COOL_DOWN_S > total and faults:
            break
        faults += members
        t = end
        episode += 1
        if end + COOL_DOWN_S > total:  # the first episode alone overruns: keep it
            break
    duration = max(total, max(f.end for f in faults) + COOL_DOWN_S)
    return Plan(
        seed=seed,
        duration_s=round(duration, 1),
        faults=tuple(faults),
        workload=Workload(seed=rng.randrange(2**31)),
        plant=plant,
        notes={"drawn_from": {"seed": seed, "minutes": minutes, "kinds": list(kinds)}},
    )
