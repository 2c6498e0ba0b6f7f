"""Every default, limit and environment variable of felix-redis, in one place."""

from __future__ import annotations

import os

#: Prefix of every key felix-redis writes (``felix:{acme/prod/jobs/0}:log``).
DEFAULT_PREFIX = "felix"

#: Used when neither ``url`` nor ``$FELIX_REDIS_URL`` is given.
DEFAULT_URL = "redis://localhost:6379/0"

ENV_URL = "FELIX_REDIS_URL"
#: A file holding the Redis URL (read when ``$FELIX_REDIS_URL`` is not set).
ENV_URL_FILE = "FELIX_REDIS_URL_FILE"
#: The password used when the Redis URL carries none.
ENV_PASSWORD = "FELIX_REDIS_PASSWORD"
ENV_VISIBILITY_TIMEOUT_MS = "FELIX_GROUP_VISIBILITY_TIMEOUT_MS"
ENV_MAX_ATTEMPTS = "FELIX_GROUP_MAX_ATTEMPTS"
ENV_PRODUCER_IDLE_MS = "FELIX_PRODUCER_IDLE_MS"

#: Socket timeouts of the connections ``felix_redis.connect`` makes, unless the URL's
#: ``socket_timeout`` / ``socket_connect_timeout`` say otherwise: a server that stops
#: answering (paused, cut off) fails a call after this long instead of hanging it, so
#: the client can go on to a promoted replica. Longer than any call felix-redis makes
#: (its blocking reads and WAITs stay below it).
SOCKET_TIMEOUT_S = 10.0
SOCKET_CONNECT_TIMEOUT_S = 2.0
#: The same for the connections to Sentinel processes (each answers at once or is skipped).
SENTINEL_SOCKET_TIMEOUT_S = 1.0

DEFAULT_VISIBILITY_TIMEOUT_MS = 30_000
DEFAULT_MAX_ATTEMPTS = 5
#: How long one worker poll waits for records (it bounds how soon a worker sees a stop).
DEFAULT_POLL_WAIT_S = 1.0
#: How long a stopped worker's running handlers may finish before their records are handed back.
DEFAULT_GRACE_S = 30.0
#: Largest payload a stream accepts unless created with another ``max_payload``.
DEFAULT_MAX_PAYLOAD = 1024 * 1024
#: How long a shard remembers an idle producer's last sequence (one hour).
DEFAULT_PRODUCER_IDLE_MS = 3_600_000

MAX_SHARDS = 1024
MAX_RECORDS_PER_POLL = 10_000
MAX_BATCH = 10_000
MAX_VISIBILITY_TIMEOUT_MS = 7 * 24 * 3_600_000
MAX_ATTEMPTS_LIMIT = 1_000_000
#: Largest nack delay / lease extension: 7 days.
MAX_DELAY_MS = 7 * 24 * 3_600_000
MAX_REASON_BYTES = 4096

KINDS = ("queue", "stream")
CONSISTENCY_LEVELS = ("leader", "quorum", "all")
#: 'safe': a queue's retention never trims a record any group has not finished;
#: 'bounded': the limits win, and groups count the records they lose.
RETENTION_MODES = ("safe", "bounded")
STARTS = ("earliest", "latest")

#: Names (tenant, namespace, stream, group, consumer): ASCII letters, digits and ``_.-``,
#: starting with a letter or digit, at most this long.
NAME_MAX_LEN = 64
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
#: Record keys (``publish_keyed``): any non-empty UTF-8 string up to this many bytes.
KEY_MAX_BYTES = 1024


def env_int(name: str, default: int) -> int:
    """An integer from the environment, or ``default`` when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        from felix_redis.errors import InvalidArgument

        raise InvalidArgument(f"${name} must be an integer, got {raw!r}") from None

#: How many times one poll asks a shard again at once when it handed out nothing but
#: said something is due now (its scan stopped at its bound in a long run of delayed
#: records), before it blocks or returns.
POLL_AGAIN_MAX = 64

#: How many polls in a row one shard of a sharded group leads (is asked for the whole
#: batch) while it fills them, before the next shard that may have work leads. Longer
#: runs let more acks ride on their shard's next poll; with every shard busy, a shard
#: waits at most this many polls times the number of other shards.
LEAD_RUN = 4

#: Seconds a sharded poll trusts that a shard has nothing to hand out (learned from
#: its last reply, kept while no wake-up and no due time says otherwise) before it asks
#: the shard again; at most one shard per round is asked for this reason.
KNOWN_IDLE_S = 30.0

#: Most streams one group polls in priority order, and the largest weight one may have.
MAX_PRIORITY_STREAMS = 64
MAX_STREAM_WEIGHT = 1000

#: A ShardedGroup's ``ack(item)`` is queued: it rides on the group's next poll, or is
#: sent this many seconds after the first queued ack at the latest (far below any
#: visibility timeout), or at once when this many are queued.
ACK_LINGER_S = 0.005
QUEUED_ACKS_MAX = 1_000

#: How long a group's watch outlives the watcher's wait (ms): the gap a watcher may leave
#: between one long poll and the next before another waiter takes the watch over.
WATCH_MARGIN_MS = 1000

#: How soon (s) a waiter's next long poll may start from the reply of the poll that ran
#: behind its last block when that wait ran out, instead of polling first (an idle loop:
#: one poll and one block per wait, as without that poll); and how many such replies a
#: client keeps (one per thread or task that long-polls a group).
LOOK_REUSE_S = 0.05
LOOKS_KEPT_MAX = 1024

#: The longest SHARDS a sharded group's ring may carry (lua/group_poll.lua refuses more)
MAX_RING_SHARDS = 16000
