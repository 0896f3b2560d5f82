"""OpenTelemetry traces: a span per cycle, per phase and per conference.

A cycle's phases run as separate Celery tasks, often in different processes,
so no span object can cover the cycle while it runs. Instead the cycle's ids
are derived from its ``run_id``: the trace id is the run id (a UUID is 128
bits), the cycle span's id a hash of it. Each phase span is started under that
(remote) parent wherever it runs, and :func:`cycle_span` records the cycle span
itself, with those exact ids and the cycle's real start time, when the cycle
finishes. Every span carries ``correlationId = run_id``.

Off unless an OTLP endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``OTEL_SDK_DISABLED=true`` wins): then
spans go out over OTLP/HTTP in a batch. Off, every call here is a no-op.
Configured per process after the fork (the batch processor has a thread).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import uuid
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from reaper.logs import get_logger, log

if TYPE_CHECKING:
    from reaper.cycle import Cycle
    from reaper.phases import BatchOutcome, Phase

logger = get_logger("tracing")

SERVICE_NAME = "conference-room-reaper"
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

_forced: ContextVar[tuple[int, int] | None] = ContextVar("reaper_forced_ids", default=None)


class _RunIds(RandomIdGenerator):
    """Random ids, except the cycle span's own, which come from its run id."""

    def generate_trace_id(self) -> int:
        forced = _forced.get()
        return forced[0] if forced else super().generate_trace_id()

    def generate_span_id(self) -> int:
        forced = _forced.get()
        return forced[1] if forced else super().generate_span_id()


_provider: TracerProvider | None = None
_tracer: trace.Tracer = trace.NoOpTracer()


def endpoint_configured() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(os.environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def configure(exporter: SpanExporter | None = None, *, batch: bool = True) -> bool:
    """Set up this process's tracing; True when spans are recorded.

    Without ``exporter``, OTLP/HTTP when an endpoint is configured, else off.
    Tests pass an in-memory exporter (and ``batch=False``).
    """
    global _provider, _tracer
    shutdown()
    if exporter is None:
        if not endpoint_configured():
            return False
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint, headers, timeout: OTEL_EXPORTER_OTLP_*
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attributes), id_generator=_RunIds())
    processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    _provider = provider
    _tracer = provider.get_tracer("reaper")
    log(logger, "tracing.enabled", exporter=type(exporter).__name__)
    return True


def shutdown() -> None:
    """Flush and stop (worker child exit, end of the CLI)."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider = None
    _tracer = trace.NoOpTracer()


def enabled() -> bool:
    return _provider is not None


# -- ids of a cycle ------------------------------------------------------------


def trace_id_for(run_id: str) -> int:
    try:
        return uuid.UUID(run_id).int or 1
    except ValueError:
        return uuid.uuid5(uuid.NAMESPACE_URL, f"reaper-run:{run_id}").int


def cycle_span_id_for(run_id: str) -> int:
    digest = hashlib.blake2b(run_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def cycle_context(run_id: str) -> Context:
    parent = SpanContext(
        trace_id_for(run_id),
        cycle_span_id_for(run_id),
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(NonRecordingSpan(parent))


def _ns(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000_000)


# -- spans ---------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


def phase_span(method: F) -> F:
    """Decorates ``Reaper.run_phase(name, cycle)``: one span per phase run."""

    @functools.wraps(method)
    def wrapper(self: Any, name: str, cycle: Cycle) -> Any:
        if not enabled():
            return method(self, name, cycle)
        errors, counts = cycle.errors, dict(cycle.counts)
        with _tracer.start_as_current_span(
            "reaper.phase",
            context=cycle_context(cycle.run_id),
            kind=SpanKind.INTERNAL,
            attributes={"correlationId": cycle.run_id, "reaper.phase": name},
        ) as span:
            result = method(self, name, cycle)
            for key, value in cycle.counts.items():
                span.set_attribute(f"reaper.{key}", value - counts.get(key, 0))
            span.set_attribute("reaper.skipped", cycle.skipped)
            if name in cycle.blocked:
                span.set_attribute("reaper.blocked", True)
            if cycle.errors > errors:
                span.set_status(Status(StatusCode.ERROR, "phase failed"))
            return result

    return wrapper  # type: ignore[return-value]


def conference_spans(
    phase: Phase, cycle: Cycle, outcome: BatchOutcome, start_ns: int, end_ns: int
) -> None:
    """One span per conference a committed batch reaped or rejected."""
    if not enabled():
        return
    current = trace.get_current_span().get_span_context()
    context = None if current.is_valid else cycle_context(cycle.run_id)
    common = {"correlationId": cycle.run_id, "reaper.phase": phase.name}
    for item in outcome.reaped:
        attributes = {
            **common,
            "conference_id": item.conference_id,
            "chat_id": item.chat_id,
            "deal_id": item.deal_id,
            "status": phase.status,
            "end_reason": phase.end_reason,
        }
        if item.tenant_id:
            attributes["tenant_id"] = item.tenant_id
        if item.lateness_seconds is not None:
            attributes["reaper.lateness_seconds"] = float(item.lateness_seconds)
        span = _tracer.start_span(
            "reaper.conference", context=context, start_time=start_ns, attributes=attributes
        )
        span.end(end_time=end_ns)
    for poison in outcome.poison:
        span = _tracer.start_span(
            "reaper.conference",
            context=context,
            start_time=start_ns,
            attributes={**common, "conference_id": poison.conference_id},
        )
        span.set_status(Status(StatusCode.ERROR, poison.reason))
        span.end(end_time=end_ns)


def cycle_span(cycle: Cycle, result: dict[str, Any], end: datetime) -> None:
    """The cycle's own span, recorded at its end with the ids its phases used."""
    if not enabled():
        return
    with _forced_ids(trace_id_for(cycle.run_id), cycle_span_id_for(cycle.run_id)):
        span = _tracer.start_span(
            "reaper.cycle",
            context=Context(),
            kind=SpanKind.INTERNAL,
            start_time=_ns(cycle.started_at),
            attributes={
                "correlationId": cycle.run_id,
                "reaper.as_of": result["as_of"],
                **{f"reaper.{k}": v for k, v in result.items() if k not in ("run_id", "as_of")},
            },
        )
    if cycle.errors:
        span.set_status(Status(StatusCode.ERROR, f"{cycle.errors} phase error(s)"))
    span.end(end_time=max(_ns(end), _ns(cycle.started_at)))


@contextlib.contextmanager
def _forced_ids(trace_id: int, span_id: int) -> Iterator[None]:
    token = _forced.set((trace_id, span_id))
    try:
        yield
    finally:
        _forced.reset(token)
