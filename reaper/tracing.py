"""OpenTelemetry traces: a span per cycle, per phase and per conference.

A subscriber of the engine's facts (:func:`subscribe`). A cycle's phases run as
separate Celery tasks, often in different processes, so no span object can
cover the cycle while it runs. Instead every span's ids are derived: the trace
id is the run id (a UUID is 128 bits), the cycle span's id a hash of it, a
phase span's id a hash of the run id and the phase. Each span is recorded when
its fact arrives (a batch committed, a phase completed, the cycle finished),
with those ids and the real start and end times, wherever it ran. Every span
carries ``correlationId = run_id``. The Kafka records carry the cycle's trace
on (``traceparent``, :func:`traceparent`).

Off unless an OTLP endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``OTEL_SDK_DISABLED=true`` wins): then
spans go out over OTLP/HTTP in a batch. Off, every call here is a no-op.
Configured per process after the fork (the batch processor has a thread).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import datetime

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

from reaper.events import BatchSelected, Bus, CycleCompleted, PhaseCompleted, PhaseFailed
from reaper.logs import get_logger, log
from reaper.traceids import cycle_span_id_for, phase_span_id_for, trace_id_for

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


def _remote(run_id: str, span_id: int) -> Context:
    parent = SpanContext(
        trace_id_for(run_id),
        span_id,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(NonRecordingSpan(parent))


def cycle_context(run_id: str) -> Context:
    return _remote(run_id, cycle_span_id_for(run_id))


def _ns(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000_000)


# -- the subscriber: facts to spans -------------------------------------------


def subscribe(bus: Bus) -> None:
    bus.subscribe(BatchSelected, _conference_spans)
    bus.subscribe(PhaseCompleted, _phase_span)
    bus.subscribe(PhaseFailed, _phase_span)
    bus.subscribe(CycleCompleted, _cycle_span)


def _conference_spans(fact: BatchSelected) -> None:
    """One span per conference a committed batch reaped, or found poison."""
    if not enabled():
        return
    context = _remote(fact.run_id, phase_span_id_for(fact.run_id, fact.phase))
    common = {"correlationId": fact.run_id, "reaper.phase": fact.phase}
    for item in fact.reaped:
        attributes: dict[str, str | float] = {
            **common,
            "conference_id": item.conference_id,
            "chat_id": item.chat_id,
            "deal_id": item.deal_id,
            "status": item.status,
            "end_reason": item.end_reason,
        }
        if item.tenant_id:
            attributes["tenant_id"] = item.tenant_id
        if item.lateness_seconds is not None:
            attributes["reaper.lateness_seconds"] = float(item.lateness_seconds)
        span = _tracer.start_span(
            "reaper.conference", context=context, start_time=fact.started_ns, attributes=attributes
        )
        span.end(end_time=fact.ended_ns)
    for poison in fact.poison:
        span = _tracer.start_span(
            "reaper.conference",
            context=context,
            start_time=fact.started_ns,
            attributes={**common, "conference_id": poison.conference_id},
        )
        span.set_status(Status(StatusCode.ERROR, poison.error))
        span.end(end_time=fact.ended_ns)


def _phase_span(fact: PhaseCompleted | PhaseFailed) -> None:
    if not enabled() or not fact.phase:
        return
    attributes: dict[str, str | int | bool] = {
        "correlationId": fact.run_id,
        "reaper.phase": fact.phase,
        "reaper.reaped": fact.reaped,
    }
    if isinstance(fact, PhaseCompleted):
        attributes.update(
            {
                "reaper.batches": fact.batches,
                "reaper.poison": fact.poison,
                "reaper.skipped_locked": fact.skipped_locked,
                "reaper.blocked": fact.blocked,
                "reaper.lost": fact.lost,
            }
        )
    with _forced_ids(trace_id_for(fact.run_id), phase_span_id_for(fact.run_id, fact.phase)):
        span = _tracer.start_span(
            "reaper.phase",
            context=cycle_context(fact.run_id),
            kind=SpanKind.INTERNAL,
            start_time=fact.started_ns,
            attributes=attributes,
        )
    if isinstance(fact, PhaseFailed):
        span.set_status(Status(StatusCode.ERROR, fact.error))
    span.end(end_time=max(fact.ended_ns, fact.started_ns))


def _cycle_span(fact: CycleCompleted) -> None:
    """The cycle's own span, recorded at its end with the ids its phases used."""
    if not enabled():
        return
    result = fact.result
    with _forced_ids(trace_id_for(fact.run_id), cycle_span_id_for(fact.run_id)):
        span = _tracer.start_span(
            "reaper.cycle",
            context=Context(),
            kind=SpanKind.INTERNAL,
            start_time=_ns(fact.started_at),
            attributes={
                "correlationId": fact.run_id,
                "reaper.as_of": result["as_of"],
                **{
                    f"reaper.{k}": v
                    for k, v in result.items()
                    if k not in ("run_id", "as_of") and isinstance(v, str | int | float | bool)
                },
            },
        )
    if fact.errors:
        span.set_status(Status(StatusCode.ERROR, fact.error or f"{fact.errors} error(s)"))
    span.end(end_time=max(_ns(fact.finished_at), _ns(fact.started_at)))


@contextlib.contextmanager
def _forced_ids(trace_id: int, span_id: int) -> Iterator[None]:
    token = _forced.set((trace_id, span_id))
    try:
        yield
    finally:
        _forced.reset(token)
