"""Serve felix_redis.dashboard on a free loopback port in a thread, for the tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from felix_redis.dashboard import create_app
from felix_redis.testing.server import free_port


@contextlib.contextmanager
def serving(url: str, **options: Any) -> Iterator[str]:
    """The dashboard over ``url`` (create_app's options), yielding its base URL; stopped
    (lifespan shutdown: sampler cancelled, client closed) on exit."""
    app = create_app(url, **options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name="dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the dashboard did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)
