"""Creates the receipts stream and group and publishes some orders.

    python publish.py 100
"""

from __future__ import annotations

import contextlib
import json
import sys

import felix_redis
from felix_redis import GroupExists

TENANT, NAMESPACE, STREAM, GROUP = "default", "default", "receipts", "senders"


def main(count: int) -> None:
    client = felix_redis.connect()  # $FELIX_REDIS_URL, else redis://localhost:6379/0
    client.stream_create(TENANT, NAMESPACE, STREAM, shards=4)
    with contextlib.suppress(GroupExists):
        client.group_create(TENANT, NAMESPACE, STREAM, GROUP, visibility_timeout_ms=10_000, max_attempts=5)
    for n in range(count):
        order = {"order": n, "email": f"customer{n}@example.com"}
        if n % 25 == 24:
            del order["email"]  # a poison record: it ends in the dead letters
        client.publish_keyed(TENANT, NAMESPACE, STREAM, str(n), json.dumps(order))
    print(f"published {count} orders")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
