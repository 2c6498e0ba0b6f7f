"""OpenTelemetry traces from publish to handler (``pip install 'felix-redis[otel]'``).

Off until :func:`instrument` is called, like other OpenTelemetry instrumentations. Then:

* every publish made while a span is current (``publish``, ``publish_batch``,
  ``publish_keyed``, of a client or an idempotent producer, sync and asyncio) is a
  PRODUCER span, and the records carry its W3C trace context in their headers
  (``traceparent``, ``tracestate``; headers the caller gave are kept, one it named
  ``traceparent`` itself wins);
* the Worker and AsyncWorker run each handler call inside a CONSUMER span whose parent
  is the context the record carries (a record without one starts a trace of its own). A
  handler that raises sets the span's error status and records the exception; the
  retry or dead letter that follows is an event of the span (``felix_redis.nack``,
  ``felix_redis.dead_letter``). A redelivery is a span of its own in the same trace.

Attributes follow OpenTelemetry's messaging semantic conventions: ``messaging.system``
(``felix_redis``), ``messaging.destination.name`` (``tenant/namespace/stream``),
``messaging.destination.partition.id`` (the shard), ``messaging.operation.type``
(``send`` or ``process``), ``messaging.operation.name``, ``messaging.message.id`` (a
record's ``SHARD:OFFSET``; the claim ``SHARD:OFFSET:ATTEMPTS`` on a consumer span),
``messaging.consumer.group.name``, ``messaging.batch.message_count`` (batches) and
``messaging.felix_redis.attempts``. Spans go to the global tracer provider (or the one
given); set it up as usual (``opentelemetry-sdk``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind, Tracer
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("felix_redis.otel needs OpenTelemetry: pip install 'felix-redis[otel]'") from exc

from felix_redis import _tracing
from felix_redis._runtime import decide
from felix_redis.asyncio import AsyncClient, AsyncIdempotentProducer
from felix_redis.checks import MAX_HEADERS
from felix_redis.client import Client, IdempotentProducer

__all__ = ["SYSTEM", "instrument", "is_instrumented", "uninstrument"]

#: ``messaging.system`` of every span.
SYSTEM = "felix_redis"
_SCOPE = "felix_redis"

#: (class, method name, many records) of the publish calls a span wraps; the others
#: (publish_keyed) call one of these.
_PUBLISHES: list[tuple[type, str, bool]] = [
    (Client, "publish", False), (Client, "publish_batch", True),
    (IdempotentProducer, "publish", False), (IdempotentProducer, "publish_batch", True),
    (AsyncClient, "publish", False), (AsyncClient, "publish_batch", True),
    (AsyncIdempotentProducer, "publish", False), (AsyncIdempotentProducer, "publish_batch", True),
]

_tracer: Tracer | None = None
_originals: dict[tuple[type, str], Callable[..., Any]] = {}


def is_instrumented() -> bool:
    return _tracer is not None


def instrument(tracer_provider: Any = None) -> None:
    """Turns tracing on (again: nothing changes): publishes made in a span become
    PRODUCER spans carrying their context to the records, handler calls CONSUMER spans.
    ``tracer_provider``: where spans go (default: the global one)."""
    global _tracer
    if _tracer is not None:
        return
    _tracer = trace.get_tracer(_SCOPE, tracer_provider=tracer_provider)
    for cls, name, many in _PUBLISHES:
        original = cls.__dict__[name]
        _originals[(cls, name)] = original
        wrap = _async_publish if inspect.iscoroutinefunction(original) else _sync_publish
        setattr(cls, name, wrap(original, many))
    _tracing.process = _process


def uninstrument() -> None:
    """Turns tracing off: the publish calls and the workers are as before."""
    global _tracer
    for (cls, name), original in _originals.items():
        setattr(cls, name, original)
    _originals.clear()
    _tracing.process = None
    _tracer = None


def _send_attributes(tenant: str, namespace: str, stream: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                     many: bool) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.destination.name": f"{tenant}/{namespace}/{stream}",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
    }
    if many and args and isinstance(args[0], (list, tuple)):
        attributes["messaging.batch.message_count"] = len(args[0])
    return attributes


def _with_context(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The publish's keyword arguments with the current trace context added to its
    headers (the caller's headers are kept; room is left for theirs within the limit)."""
    given = kwargs.get("headers")
    if given is not None and not isinstance(given, dict):
        return kwargs  # the call refuses it as it would without tracing
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    headers = dict(given or {})
    for name, value in carrier.items():
        if name not in headers and len(headers) < MAX_HEADERS:
            headers[name] = value
    return {**kwargs, "headers": headers}


def _published(span: Any, result: Any) -> None:
    first = result[0] if isinstance(result, list) and result else result
    if first is not None and hasattr(first, "offset"):
        span.set_attribute("messaging.destination.partition.id", str(first.shard))
        if not isinstance(result, list) or len(result) == 1:
            span.set_attribute("messaging.message.id", f"{first.shard}:{first.offset}")


def _sync_publish(original: Callable[..., Any], many: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def publish(self: Any, tenant: str, namespace: str, stream: str, *args: Any, **kwargs: Any) -> Any:
        tracer = _tracer
        if tracer is None or not trace.get_current_span().get_span_context().is_valid:
            return original(self, tenant, namespace, stream, *args, **kwargs)
        attributes = _send_attributes(tenant, namespace, stream, args, kwargs, many)
        with tracer.start_as_current_span(f"publish {tenant}/{namespace}/{stream}", kind=SpanKind.PRODUCER,
                                          attributes=attributes) as span:
            result = original(self, tenant, namespace, stream, *args, **_with_context(kwargs))
            _published(span, result)
            return result
    return publish


def _async_publish(original: Callable[..., Any], many: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    async def publish(self: Any, tenant: str, namespace: str, stream: str, *args: Any, **kwargs: Any) -> Any:
        tracer = _tracer
        if tracer is None or not trace.get_current_span().get_span_context().is_valid:
            return await original(self, tenant, namespace, stream, *args, **kwargs)
        attributes = _send_attributes(tenant, namespace, stream, args, kwargs, many)
        with tracer.start_as_current_span(f"publish {tenant}/{namespace}/{stream}", kind=SpanKind.PRODUCER,
                                          attributes=attributes) as span:
            result = await original(self, tenant, namespace, stream, *args, **_with_context(kwargs))
            _published(span, result)
            return result
    return publish


@contextmanager
def _process(worker: Any, item: Any) -> Iterator[Any]:
    """The CONSUMER span a worker runs one handler call in (the hook of
    :mod:`felix_redis._tracing`)."""
    tracer = _tracer
    if tracer is None:
        yield None
        return
    record = item.record
    where = f"{worker.tenant}/{worker.namespace}/{item.stream}"
    parent = propagate.extract(record.headers or {})
    attributes = {
        "messaging.system": SYSTEM,
        "messaging.destination.name": where,
        "messaging.destination.partition.id": str(record.shard),
        "messaging.consumer.group.name": worker.group,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.message.id": record.claim,
        "messaging.felix_redis.attempts": record.attempts,
    }
    with tracer.start_as_current_span(f"process {where}", context=parent, kind=SpanKind.CONSUMER,
                                      attributes=attributes) as span:
        try:
            yield span
        except BaseException as exc:
            # what the worker does next (it decides the same way once the span is over)
            decision = decide(exc, record.attempts, worker.max_attempts_of(item), worker.backoff, worker.dead_letter_on)
            if decision.dead:
                span.add_event("felix_redis.dead_letter", {"felix_redis.reason": decision.reason})
            else:
                span.add_event("felix_redis.nack", {"felix_redis.reason": decision.reason,
                                                    "felix_redis.retry_in_s": decision.delay_s})
            raise
