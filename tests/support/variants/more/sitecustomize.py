"""A worker of this release with a phase more (tests/support/phase_variants.py)."""

from tests.support.phase_variants import more

more()
