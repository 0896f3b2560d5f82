"""The one place subscribers are connected (reaper/wiring.py)."""

from __future__ import annotations

import gc

from reaper.events import BatchSelected, ConferenceReaped, CycleCompleted
from tests.support.facts import wired_bus


def test_every_new_bus_is_wired_even_on_a_collected_bus_address(settings, engine):
    """Measured before: install() remembered buses by id(); a new bus at a
    collected one's address was taken for wired and got no subscriber (the
    recorder tests then saw no stop signal, at random)."""
    addresses = set()
    for _ in range(50):
        bus = wired_bus(settings, engine)
        addresses.add(id(bus))
        assert bus.wants(CycleCompleted) and bus.wants(BatchSelected)
        assert bus.wants(ConferenceReaped)
        del bus
        gc.collect()
    assert len(addresses) < 50  # addresses were reused: the case above was exercised
