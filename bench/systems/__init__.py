"""The registry of systems under test: name -> ``module:Class``.

Modules are imported lazily, so a peer whose package is missing costs nothing until it
is asked for, and then it is reported as unavailable.
"""

from __future__ import annotations

import importlib

from bench.core import System

SYSTEMS: dict[str, str] = {
    "raw": "bench.systems.raw_streams:RawStreams",
    "felix": "bench.systems.felix:Felix",
    "felix-async": "bench.systems.felix:FelixAsync",
    "felix-sharded": "bench.systems.felix:FelixSharded",
    "felix-readme": "bench.systems.felix:FelixReadme",
    "felix-readme-plain": "bench.systems.felix:FelixReadmePlain",
    "felix-worker": "bench.systems.felix:FelixWorker",
    "felix-async-worker": "bench.systems.felix:FelixAsyncWorker",
    "felix-worker-prefetch": "bench.systems.felix:FelixWorkerPrefetch",
    "felix-async-worker-prefetch": "bench.systems.felix:FelixAsyncWorkerPrefetch",
    "dramatiq": "bench.systems.dramatiq_:Dramatiq",
    "taskiq": "bench.systems.taskiq_:Taskiq",
    "bullmq": "bench.systems.bullmq_:BullMQ",
    "saq": "bench.systems.saq_:Saq",
    "arq": "bench.systems.arq_:Arq",
    "rq": "bench.systems.rq_:RQ",
    "celery": "bench.systems.celery_:Celery",
    "streaq": "bench.systems.streaq_:Streaq",
    "rabbitmq": "bench.systems.rabbitmq:RabbitMQ",
    "nats": "bench.systems.nats_:NatsJetStream",
}

#: The system every ratio is taken against.
FLOOR = "raw"


def load(name: str) -> type[System]:
    """The class registered under ``name``."""
    module, _, attr = SYSTEMS[name].partition(":")
    cls: type[System] = getattr(importlib.import_module(module), attr)
    return cls
