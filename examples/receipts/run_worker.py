"""The worker from Python instead of felixctl: the same runtime, with metrics on :9100.

    python run_worker.py
"""

from __future__ import annotations

import logging

from prometheus_client import start_http_server
from tasks import send_receipt

import felix_redis
from felix_redis.metrics import default_worker_metrics
from felix_redis.worker import Backoff, Worker


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start_http_server(9100, "127.0.0.1")
    client = felix_redis.connect()
    worker = Worker(
        client, "default", "default", "receipts", "senders", send_receipt,
        concurrency=8,
        consumer="receipts-1",  # stable: a restart takes its unfinished records back at once
        backoff=Backoff(base_s=2, factor=2, max_s=120, jitter=0.2),
        hard_limit_s=600,
        metrics=default_worker_metrics(),
    )
    worker.run()  # until SIGTERM / Ctrl-C; then a 30 s grace period
    print(worker.stats)


if __name__ == "__main__":
    main()
