"""A worker of this release with a phase less (tests/support/phase_variants.py)."""

from tests.support.phase_variants import less

less()
