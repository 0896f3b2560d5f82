"""The ids of a cycle's trace, derived from its run id (no OpenTelemetry here).

The phases of a cycle run as separate tasks, often in other processes, and the
Kafka records leave for consumers long after: every span id is derived from
the run id, so each part finds its parent without being told. The trace id is
the run id itself (a UUID is 128 bits).
"""

from __future__ import annotations

import hashlib
import uuid
from functools import lru_cache


def trace_id_for(run_id: str) -> int:
    try:
        return uuid.UUID(run_id).int or 1
    except ValueError:
        return uuid.uuid5(uuid.NAMESPACE_URL, f"reaper-run:{run_id}").int


def cycle_span_id_for(run_id: str) -> int:
    return _hash_id(run_id)


def phase_span_id_for(run_id: str, phase: str) -> int:
    return _hash_id(f"{run_id}/{phase}")


# The relay asks for it once per record, and a batch's records come from a few
# cycles: parsing and hashing the run id for each was a tenth of a send.
@lru_cache(maxsize=1024)
def traceparent(run_id: str) -> str:
    """The W3C trace context of the cycle's span: a consumer that extracts it
    continues the cycle's trace (version 00, sampled)."""
    return f"00-{trace_id_for(run_id):032x}-{cycle_span_id_for(run_id):016x}-01"


def _hash_id(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1
