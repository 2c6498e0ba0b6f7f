"""Where the Worker and AsyncWorker look for tracing: None until
:func:`felix_redis.otel.instrument` sets it, so that a worker without OpenTelemetry pays
one attribute read per job. This module imports nothing: ``opentelemetry`` is an
optional extra (``felix-redis[otel]``)."""

from __future__ import annotations

from typing import Any

#: The hook :func:`felix_redis.otel.instrument` installs: ``hook(worker, item)`` returns a
#: context manager the handler call runs in (its CONSUMER span); None: not instrumented.
process: Any = None
