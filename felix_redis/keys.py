"""The key layout (documented in docs/keys.md) and name validation.

Every key of one shard carries the hash tag ``{tenant/namespace/stream/shard}``, so a
shard lives in one Redis Cluster slot and every script touches one slot. Names may not
contain ``/``, ``:``, braces, ``|`` or spaces, so no two names map to the same key.
"""

from __future__ import annotations

import binascii
import hashlib
import re
import zlib
from dataclasses import dataclass, field, replace
from functools import lru_cache

from felix_redis.constants import KEY_MAX_BYTES, NAME_MAX_LEN, NAME_PATTERN
from felix_redis.errors import InvalidArgument

_NAME_RE = re.compile(NAME_PATTERN)

#: Keys of one shard, in the order scripts receive them.
SHARD_ROLES = ("meta", "log")
#: Keys of one group on one shard, in the order scripts receive them (after SHARD_ROLES).
GROUP_ROLES = (
    "group", "lease", "owed", "attempts", "done", "redo", "dead", "owner", "byowner", "wake", "held",
)


#: Names that passed :func:`check_name` (exact str only), so a name used again is not
#: matched again; bounded, it starts over when full.
_checked: set[str] = set()
_CHECKED_MAX = 4096


def valid_name(value: object) -> bool:
    """True when ``value`` is a valid tenant/namespace/stream/group/consumer name."""
    try:
        check_name(value, "a")
    except InvalidArgument:
        return False
    return True


def check_name(value: object, what: str) -> str:
    """``value`` if it is a valid tenant/namespace/stream/group/consumer name."""
    if type(value) is str and value in _checked:
        return value
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} name must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidArgument(f"{what} name must not be empty")
    if len(value) > NAME_MAX_LEN:
        raise InvalidArgument(
            f"{what} name is {len(value)} characters long; at most {NAME_MAX_LEN} are allowed"
        )
    if not _NAME_RE.fullmatch(value):
        raise InvalidArgument(
            f"{what} name {value!r} is not allowed: use ASCII letters, digits, '_', '.' "
            "and '-', starting with a letter or digit"
        )
    if type(value) is str:
        if len(_checked) >= _CHECKED_MAX:
            _checked.clear()
        _checked.add(value)
    return value


def check_record_key(key: object) -> bytes:
    """A record key (``publish_keyed``) as UTF-8 bytes."""
    if isinstance(key, str):
        raw = key.encode("utf-8")
    elif isinstance(key, bytes):
        raw = key
    else:
        raise InvalidArgument(f"record key must be str or bytes, got {type(key).__name__}")
    if not raw:
        raise InvalidArgument("record key must not be empty")
    if len(raw) > KEY_MAX_BYTES:
        raise InvalidArgument(f"record key is {len(raw)} bytes; at most {KEY_MAX_BYTES}")
    return raw


def shard_for_key(key: bytes, shards: int) -> int:
    """The documented routing of ``publish_keyed``: CRC-32 (IEEE, as zlib) of the key's
    UTF-8 bytes, modulo the shard count."""
    return zlib.crc32(key) % shards


#: Redis Cluster's hash slots.
CLUSTER_SLOTS = 16384
#: How near its target slot a spread shard's tag lands: within this many slots after it.
#: Narrow enough that shards spaced 16384 / N apart keep their order against any
#: Cluster's slot ranges (but for a stream whose targets fall this close to a range's
#: edge); wide enough that a tag is found in about 16384 / 64 = 256 tries.
SPREAD_WINDOW = 64


def key_slot(tag: str) -> int:
    """The Redis Cluster slot of a hash tag (CRC16/XMODEM of its bytes, mod 16384)."""
    return binascii.crc_hqx(tag.encode(), 0) % CLUSTER_SLOTS


@lru_cache(maxsize=65536)
def spread_tag(path: str, shard: int, shards: int) -> str:
    """The hash tag of shard ``shard`` of a stream of ``shards`` shards whose tags are
    spread over the slots (docs/keys.md). Shard 0's is ``PATH/0``; its slot A anchors the
    stream. Shard i's is ``PATH/i~K``, with the smallest K >= 0 that puts it within
    :data:`SPREAD_WINDOW` slots after A + i * 16384 / shards. So the shards lie evenly
    around the ring of slots, each stream turned by its own A, and a Cluster's primaries,
    each holding a contiguous range of slots, hold shards in proportion to their share
    of the slots. About 256 tries per shard, once per process."""
    if shard == 0 or shards <= 1:
        return f"{path}/{shard}"
    anchor = key_slot(f"{path}/0")
    target = (anchor + shard * CLUSTER_SLOTS // shards) % CLUSTER_SLOTS
    salt = 0
    while (key_slot(f"{path}/{shard}~{salt}") - target) % CLUSTER_SLOTS >= SPREAD_WINDOW:
        salt += 1
    return f"{path}/{shard}~{salt}"


@dataclass(frozen=True, slots=True)
class StreamName:
    """A stream's full name; builds the keys of its shards and groups.

    ``spread``: the shard count the shards' hash tags are spread for (:func:`spread_tag`),
    as the stream's shard 0 records it; 0 for the plain tags ``PATH/SHARD`` (a stream of
    one shard, or one made before tags were spread). Shard 0's keys are the same either
    way, so they can be built before the stream's settings are known."""

    prefix: str
    tenant: str
    namespace: str
    stream: str
    spread: int = 0
    #: ``tenant/namespace/stream``, made once
    path: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", f"{self.tenant}/{self.namespace}/{self.stream}")

    @classmethod
    def of(cls, prefix: str, tenant: str, namespace: str, stream: str) -> StreamName:
        return cls(
            prefix,
            check_name(tenant, "tenant"),
            check_name(namespace, "namespace"),
            check_name(stream, "stream"),
        )

    def laid_out(self, spread: int) -> StreamName:
        """This name with its shards' tags spread for ``spread`` shards (0: plain)."""
        return self if spread == self.spread else replace(self, spread=spread)

    def tag(self, shard: int) -> str:
        """The hash tag of one shard's keys."""
        if self.spread > 1 and shard:
            return spread_tag(self.path, shard, self.spread)
        return f"{self.path}/{shard}"

    def base(self, shard: int) -> str:
        return f"{self.prefix}:{{{self.tag(shard)}}}"

    def shard_keys(self, shard: int) -> list[str]:
        """``[meta, log]`` of one shard."""
        base = self.base(shard)
        return [f"{base}:meta", f"{base}:log"]

    def publish_keys(self, shard: int) -> list[str]:
        """``[meta, log, conf]`` of one shard: what publish and stream_create take."""
        base = self.base(shard)
        return [f"{base}:meta", f"{base}:log", f"{base}:conf"]

    def info_keys(self, shard: int) -> list[str]:
        """``[meta, log, groups, conf]`` of one shard: what stream_info, stream_trim and
        stream_delete take first."""
        base = self.base(shard)
        return [f"{base}:meta", f"{base}:log", f"{base}:groups", f"{base}:conf"]

    def due_key(self, shard: int) -> str:
        """The due index of one shard (docs/keys.md, "The due index"): a sorted set of
        chunks of its delayed records' offsets, by 100 ms due-time bucket. Publishers
        write it; groups read it."""
        return f"{self.base(shard)}:due"

    def conf_key(self, shard: int) -> str:
        """The hash of one shard's settings (only ``stream.admin`` writes it)."""
        return f"{self.base(shard)}:conf"

    def groups_key(self, shard: int) -> str:
        """The set of group names on one shard."""
        return f"{self.base(shard)}:groups"

    def group_key_list(self, shard: int, group: str) -> list[str]:
        """The keys of one group on one shard as scripts take them: a list in
        GROUP_ROLES order. (``Client.group_keys`` gives them by shard and role.)"""
        g = f"{self.base(shard)}:g:{group}"
        return [g] + [f"{g}:{role}" for role in GROUP_ROLES[1:]]



def producer_public_id(secret: str) -> str:
    """The id by which a shard knows an idempotent producer: the first 32 hex digits of
    SHA1 of its secret (lua/includes/producer.lua computes the same from the secret each
    publish presents). Anyone who may read the shard's meta hash sees it; only the
    producer's client holds the secret."""
    return hashlib.sha1(secret.encode()).hexdigest()[:32]


def producer_field(public_id: str) -> str:
    """The meta-hash field holding an idempotent producer's state on a shard:
    ``producer:PUBLIC_ID`` = ``SEQ FIRST COUNT MS IDLE MAC`` (lua/publish.lua)."""
    return f"producer:{public_id}"


def registry_key(prefix: str, tenant: str) -> str:
    """The sorted set of one tenant's streams (``tenant/namespace/stream``), for stream_list."""
    return f"{prefix}:streams:{tenant}"


def tenants_key(prefix: str) -> str:
    """The set of tenant names that have (or had) a registry, for a listing of every tenant."""
    return f"{prefix}:tenants"


#: Roles granted per group and the capability-key suffix that stands for each.
GROUP_ROLE_CAPS = {"group.consume": "consume", "group.manage": "manage"}
#: Roles granted per stream and their capability-key suffixes.
STREAM_ROLE_CAPS = {"stream.publish": "publish", "stream.admin": "admin"}


def capability_key(prefix: str, tag: str, role: str, group: str | None = None) -> str:
    """The capability key of ``role`` (docs/security.md): ``PREFIXcap:{TAG}:g:GROUP:consume``
    or ``...:manage`` for a group role, ``PREFIXcap:{TAG}:publish`` or ``...:admin`` for a
    stream role. ``tag`` is ``tenant/namespace/stream/shard`` (``*`` as the shard gives the
    ACL pattern for every shard). Scripts derive the same name from the shard's hash tag and
    ask Redis ACL whether the caller may access it; the key itself never holds data."""
    if role in GROUP_ROLE_CAPS:
        if group is None:
            raise InvalidArgument(f"role {role} is granted on a group: name the group")
        return f"{prefix}cap:{{{tag}}}:g:{group}:{GROUP_ROLE_CAPS[role]}"
    if role in STREAM_ROLE_CAPS:
        return f"{prefix}cap:{{{tag}}}:{STREAM_ROLE_CAPS[role]}"
    roles = ", ".join([*GROUP_ROLE_CAPS, *STREAM_ROLE_CAPS])
    raise InvalidArgument(f"unknown role {role!r}; the roles are {roles}")
