"""felix-redis: Felix-style work queues on any Redis 7+.

Sharded durable streams; consumer groups with per-record leases, attempts, nack with
delay, lease extension, dead letters and redrive; an idempotent producer. See
docs/concepts.md.
"""

from felix_redis.aioworker import AsyncWorker
from felix_redis.client import Client, IdempotentProducer, Item, ShardedGroup, connect
from felix_redis.errors import (
    ConnectionFailed,
    FelixError,
    GroupExists,
    InvalidArgument,
    MalformedClaims,
    NotDelivered,
    NotFound,
    NotInstalled,
    NotReplicated,
    OutcomeUnknown,
    PermissionDenied,
    SequenceError,
    StaleClaim,
    StreamExists,
    WrongKeyType,
)
from felix_redis.keys import shard_for_key
from felix_redis.models import (
    Claim,
    DeadLetter,
    GroupInfo,
    Published,
    Record,
    ShardState,
    StreamInfo,
    parse_claim,
)
from felix_redis.schedules import Schedule, Ticked
from felix_redis.worker import Backoff, Fatal, Retry, Worker

__version__ = "0.1.0"

__all__ = [
    "AsyncWorker",
    "Backoff",
    "Claim",
    "Client",
    "ConnectionFailed",
    "DeadLetter",
    "Fatal",
    "FelixError",
    "GroupExists",
    "GroupInfo",
    "IdempotentProducer",
    "InvalidArgument",
    "Item",
    "MalformedClaims",
    "NotDelivered",
    "NotFound",
    "NotInstalled",
    "NotReplicated",
    "OutcomeUnknown",
    "PermissionDenied",
    "Published",
    "Record",
    "Retry",
    "Schedule",
    "SequenceError",
    "ShardState",
    "ShardedGroup",
    "StaleClaim",
    "StreamExists",
    "StreamInfo",
    "Ticked",
    "Worker",
    "WrongKeyType",
    "__version__",
    "connect",
    "parse_claim",
    "shard_for_key",
]
