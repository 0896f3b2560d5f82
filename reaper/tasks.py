"""Celery tasks (CONTRACT §2). Thin: the work is in :mod:`reaper.cycle`.

A cycle is ``reaper.reap`` replaced by the chain
``reap_phase(empty_room) | reap_phase(provision_timeout) | reap_phase(stale_live) | reap``:
each phase is its own task, Celery prepends the previous link's result (the
running :class:`~reaper.cycle.Cycle`) to the next link's arguments, and the
final ``reap(cycle)`` inherits the original task id and reports the totals.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from celery import Task, chain
from sqlalchemy.exc import SQLAlchemyError

from reaper import metrics
from reaper.celery_app import app
from reaper.config import get_settings
from reaper.cycle import Cycle, Reaper
from reaper.phases import ORDER, PHASES
from reaper.relay import Relay

# A relay request nobody picked up within this is dropped: the beat tick and
# the next cycle's request follow anyway.
RELAY_EXPIRES = 30.0


@cache
def get_reaper() -> Reaper:
    return Reaper(get_settings())


@cache
def get_relay() -> Relay:
    return Relay(get_settings())


@app.task(name="reaper.reap", bind=True)
def reap(self: Task, cycle: dict[str, Any] | None = None, as_of: str | None = None) -> Any:
    reaper = get_reaper()
    if cycle is not None:  # the chain's last link
        result = reaper.finish(Cycle.from_json(cycle))
        if result["empty_timeout_count"] + result["stale_timeout_count"] > 0:
            # The cycle wrote integration events: publish them now, not at
            # the next relay tick.
            relay_outbox.apply_async(expires=RELAY_EXPIRES)
        return result
    started = reaper.start(as_of)
    try:
        holder = reaper.lock_holder()
    except SQLAlchemyError:
        started.errors += 1
        metrics.errors()
        return reaper.finish(started)
    if holder is not None:
        return reaper.finish(reaper.skip(started, holder))
    expires = reaper.settings.lock_ttl.total_seconds()
    steps = [
        reap_phase.si(started.to_json(), ORDER[0]).set(expires=expires),
        *(reap_phase.s(name).set(expires=expires) for name in ORDER[1:]),
        reap.s().set(expires=expires),
    ]
    return self.replace(chain(*steps))


@app.task(name="reaper.reap_phase", bind=True)
def reap_phase(
    self: Task, *args: Any, as_of: str | None = None, run_id: str | None = None
) -> dict[str, Any]:
    """``reap_phase(phase)`` by hand, or ``reap_phase(cycle, phase)`` inside a cycle."""
    if len(args) == 2:
        carried, name = args
    elif len(args) == 1:
        carried, name = None, args[0]
    else:
        raise TypeError("reap_phase takes the phase name, e.g. --args '[\"empty_room\"]'")
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; one of {', '.join(ORDER)}")
    reaper = get_reaper()
    if carried is None:
        cycle = reaper.start(as_of, run_id)
        reaper.run_phase(name, cycle)
        return reaper.finish(cycle)
    return reaper.run_phase(name, Cycle.from_json(carried)).to_json()


@app.task(name="reaper.relay_outbox")
def relay_outbox() -> dict[str, int]:
    """Publish pending integration_outbox rows to Kafka (see :mod:`reaper.relay`)."""
    return get_relay().run().to_json()
