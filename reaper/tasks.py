"""The Celery tasks (docs/design.md#tasks). Thin: the work is in :mod:`reaper.cycle`.

A cycle is ``reaper.reap`` taking the run at its head and replacing itself by
the chain ``reap_phase(empty_room) | reap_phase(provision_timeout) |
reap_phase(stale_live) | reap(finish=run_id)``. Each phase is its own task
(visible in Flower) and is given nothing but the run id (``of_run=run_id``),
because the run's state lives in its row (reaper/runs.py). The last link
inherits the original task id and reports the cycle's totals.

The recorder stop signals are ``reaper.stop_recordings``, on a queue of their
own: a pass over the signals due in the database (reaper/recorder.py).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from celery import Task, chain

from reaper.celery_app import app
from reaper.config import get_settings
from reaper.cycle import Reaper
from reaper.events import CycleResult, PhaseResult, RelayTaskResult
from reaper.lifecycle import stopping
from reaper.nudge import RELAY_EXPIRES
from reaper.phases import ORDER, PHASES
from reaper.recorder import StopPass
from reaper.relay import Relay

# Likewise a stop pass: the beat tick sends the signals it would have sent.
STOPS_EXPIRES = 30.0


@cache
def get_reaper() -> Reaper:
    return Reaper(get_settings(), stop_event=stopping())


@cache
def get_relay() -> Relay:
    return Relay(get_settings(), stop_event=stopping())


@cache
def get_stop_pass() -> StopPass:
    return StopPass(get_settings(), stop_event=stopping())


@app.task(name="reaper.reap", bind=True)
def reap(self: Task, as_of: str | None = None, *, finish: str | None = None) -> Any:
    """One cycle. ``finish`` (a run id) is the cycle's own last link: close and report."""
    reaper = get_reaper()
    if finish is not None:
        result = reaper.finish(finish)
        closed = {phase: result[phase.count_key] for phase in PHASES.values()}
        if any(count for phase, count in closed.items() if phase.ends_active):
            # The cycle wrote integration events: publish them now, not at
            # the next relay tick.
            relay_outbox.apply_async(expires=RELAY_EXPIRES)
        stops_due = sum(closed.values()) > 0 and reaper.settings.recorder_url
        if stops_due and not get_stop_pass().running():
            # Rooms it closed may have recordings running: their stop signals
            # are due now, not at the next beat tick. Not while a pass runs:
            # passes queued behind it would take the worker's slots from the
            # next cycles (beside a slow recorder, half of them); the beat tick
            # sends what that pass did not claim.
            stop_recordings.apply_async(expires=STOPS_EXPIRES)
        return result
    cycle = reaper.start(as_of)
    if not cycle.owns_run:
        return reaper.end_unowned(cycle)
    expires = reaper.settings.lock_ttl.total_seconds()
    return self.replace(
        chain(
            *(reap_phase.si(name, of_run=cycle.run_id).set(expires=expires) for name in ORDER),
            reap.si(finish=cycle.run_id).set(expires=expires),
        )
    )


@app.task(name="reaper.reap_phase")
def reap_phase(
    phase: str,
    *,
    as_of: str | None = None,
    run_id: str | None = None,
    of_run: str | None = None,
    cycle: str | None = None,
) -> CycleResult | PhaseResult:
    """One phase. ``of_run`` (the run id a cycle's chain passes): that cycle's phase,
    which does nothing if the run is no longer the cycle's, nor for a phase this
    release does not know (Reaper.run_phase). Otherwise, by hand: a cycle of this
    phase alone (``as_of``, ``run_id`` as for ``reaper.reap``).

    ``cycle`` is ``of_run`` under the name a worker of the release before this one
    queues it with: during a rolling deploy such a chain reaches a new worker (its
    messages expire within REAPER_LOCK_TTL)."""
    reaper = get_reaper()
    of_run = of_run or cycle
    if of_run is not None:
        # a phase this release does not know (a newer release's chain): left
        # out, recorded in the run, and the chain goes on
        return reaper.run_phase(phase, of_run)
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; one of {', '.join(ORDER)}")
    return reaper.run_cycle(as_of, run_id, phases=[phase])


@app.task(name="reaper.relay_outbox")
def relay_outbox() -> RelayTaskResult:
    """Publish pending integration_outbox rows to Kafka (see :mod:`reaper.relay`)."""
    return get_relay().run().to_json()


@app.task(name="reaper.stop_recordings")
def stop_recordings() -> dict[str, int | bool]:
    """Send the recorder stop signals that are due (see :mod:`reaper.recorder`)."""
    return get_stop_pass().run().to_json()
