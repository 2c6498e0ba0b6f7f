"""A handler for tests/test_otel.py's worker process: this module sets up the
process's OpenTelemetry SDK (spans written as JSON lines to ``$FELIX_TEST_SPANS`` as
they end) and turns felix-redis tracing on, as an application would where it configures
tracing; ``handle`` does nothing."""

from __future__ import annotations

import os

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from felix_redis import otel
from felix_redis.models import Record

_out = open(os.environ["FELIX_TEST_SPANS"], "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - the process's life


def _line(span: ReadableSpan) -> str:
    return span.to_json(indent=None) + "\n"


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=_out, formatter=_line)))
otel.instrument(tracer_provider=provider)


def handle(record: Record) -> None:
    pass
