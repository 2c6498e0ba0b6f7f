"""felix-redis: Felix-style work queues on any Redis 7+.

Sharded durable streams; consumer groups with per-record leases, attempts, nack with
delay, lease extension, dead letters and redrive; an idempotent producer. See
docs/concepts.md.
"""

from felix_redis.client import Client, IdempotentProducer, Item, ShardedGroup, connect
from felix_redis.errors import (
    ConnectionFailed,
    FelixError,
    GroupExists,
    InvalidArgument,
    NotFound,
    NotReplicated,
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

__version__ = "0.1.0"

__all__ = [
    "Claim",
    "Client",
    "ConnectionFailed",
    "DeadLetter",
    "FelixError",
    "GroupExists",
    "GroupInfo",
    "IdempotentProducer",
    "InvalidArgument",
    "Item",
    "NotFound",
    "NotReplicated",
    "PermissionDenied",
    "Published",
    "Record",
    "SequenceError",
    "ShardState",
    "ShardedGroup",
    "StaleClaim",
    "StreamExists",
    "StreamInfo",
    "WrongKeyType",
    "__version__",
    "connect",
    "parse_claim",
    "shard_for_key",
]
