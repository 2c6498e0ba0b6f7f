"""What a client remembers between calls: checked stream names, built keys and the
settings of the streams it used. No I/O."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from felix_redis import constants as C
from felix_redis.keys import StreamName


def replicas_needed(replication: int, consistency: str) -> int:
    """Replicas WAIT must see: quorum -> a majority of copies, all -> every copy."""
    if consistency == "quorum":
        return replication // 2
    if consistency == "all":
        return replication - 1
    return 0


@dataclass
class StreamSettings:
    """What a client caches about a stream: read again once older than
    :attr:`Caches.settings_ttl_s` (a stream deleted and created again may have other
    settings)."""

    shards: int
    replication: int
    consistency: str
    replicas: int
    max_payload: int = C.DEFAULT_MAX_PAYLOAD
    max_len: int = 0
    max_age: int = 0
    #: the shard count its shards' hash tags are spread for (StreamName.spread); 0: plain
    spread: int = 0
    loaded_at: float = field(default_factory=time.monotonic)


#: Entries each per-client cache of checked names and built keys holds; a client that
#: touches more streams or groups than that starts the cache over.
CACHE_MAX = 1024


def _plain(tenant: object, namespace: object, stream: object, shard: object, group: object) -> bool:
    """True for exact str names and an exact int shard: the calls the caches serve."""
    return (type(shard) is int and type(group) is str and type(tenant) is str
            and type(namespace) is str and type(stream) is str)


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= CACHE_MAX:
        cache.clear()
    cache[key] = value


class Caches:
    """Checked names and built keys, so that a repeated call neither matches a name
    pattern nor builds a key again, and the settings of the streams seen, for
    ``settings_ttl_s``. Only calls whose names are exact str and shard an exact int are
    looked up here (no bool, float or subclass is ever equal to a cached entry);
    anything else takes the checked path. No I/O: :class:`felix_redis.protocol.Core`
    reads settings and stores them in :attr:`settings`."""

    settings_ttl_s = 60.0

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        #: stream path -> its settings as last read
        self.settings: dict[str, StreamSettings] = {}
        #: (tenant, namespace, stream) -> the checked name, laid out as last seen
        self.names: dict[tuple[str, str, str], StreamName] = {}
        #: (path, spread) -> the name laid out for it (:meth:`laid`)
        self.laid_names: dict[tuple[str, int], StreamName] = {}
        #: (tenant, namespace, stream, shard, group) -> (name, path, keys, context)
        self.groups: dict[tuple[str, str, str, int, str], tuple[StreamName, str, list[str], str]] = {}
        #: (path, shard, spread) -> (meta, log and conf keys, context), for publishing
        self.shards: dict[tuple[str, int, int], tuple[list[str], str]] = {}

    def name(self, tenant: str, namespace: str, stream: str) -> StreamName:
        """The checked name of a stream (InvalidArgument for a bad one)."""
        if type(tenant) is str and type(namespace) is str and type(stream) is str:
            where = (tenant, namespace, stream)
            name = self.names.get(where)
            if name is None:
                name = StreamName.of(self.prefix, tenant, namespace, stream)
                _remember(self.names, where, name)
            return name
        return StreamName.of(self.prefix, tenant, namespace, stream)

    def laid(self, name: StreamName, settings: StreamSettings | int) -> StreamName:
        """``name`` with its shards' tags as the stream's settings (or a spread) say
        (StreamName.spread). The name cache learns it: :meth:`name` then gives names laid
        out as the stream was last seen."""
        spread = settings if isinstance(settings, int) else settings.spread
        if name.spread == spread:
            return name
        where = (name.path, spread)
        laid = self.laid_names.get(where)
        if laid is None or laid.prefix != name.prefix:
            laid = name.laid_out(spread)
            _remember(self.laid_names, where, laid)
        key = (name.tenant, name.namespace, name.stream)
        if self.names.get(key) is name:
            self.names[key] = laid
        return laid

    def forget(self, name: StreamName) -> None:
        """Drops a stream's settings (it was created, changed or deleted)."""
        self.settings.pop(name.path, None)

    def fresh_settings(self, path: str) -> StreamSettings | None:
        """The cached settings of stream ``path`` while they are fresh, else None."""
        cached = self.settings.get(path)
        if cached is not None and time.monotonic() - cached.loaded_at < self.settings_ttl_s:
            return cached
        return None

    def group_target(
        self, tenant: Any, namespace: Any, stream: Any, shard: Any, group: Any
    ) -> tuple[StreamName, StreamSettings, int, list[str], str] | None:
        """What :meth:`felix_redis.protocol.Core.group_op` returns, from the cache and without a round trip, for a
        group and shard it checked before while the stream's settings are fresh; else
        None. The keys list is shared: callers must not change it."""
        if not _plain(tenant, namespace, stream, shard, group):
            return None
        hit = self.groups.get((tenant, namespace, stream, shard, group))
        if hit is None:
            return None
        name, path, keys, context = hit
        settings = self.fresh_settings(path)
        if settings is None or shard >= settings.shards or name.spread != settings.spread:
            return None
        return name, settings, shard, keys, context

    def group_shard_keys(self, name: StreamName, shard: int, group: str) -> tuple[list[str], str]:
        """The keys of a group on a shard (shard roles, then group roles, then the shard's
        due index) and the context errors name; ``shard`` and ``group`` must have been
        checked. The keys list is shared: callers must not change it."""
        where = (name.tenant, name.namespace, name.stream, shard, group)
        plain = _plain(*where)
        hit = self.groups.get(where) if plain else None
        if hit is None or hit[0].spread != name.spread:
            keys = [*name.shard_keys(shard), *name.group_key_list(shard, group), name.due_key(shard)]
            hit = (name, name.path, keys, f"group {group} on stream {name.path} shard {shard}")
            if plain:
                _remember(self.groups, where, hit)
        return hit[2], hit[3]

    def shard_target(self, name: StreamName, shard: int) -> tuple[list[str], str]:
        """The keys publish takes (meta, log, conf) of a checked shard, and the context
        errors name."""
        where = (name.path, shard, name.spread)
        hit = self.shards.get(where) if type(shard) is int else None
        if hit is None:
            hit = (name.publish_keys(shard), f"stream {name.path} shard {shard}")
            if type(shard) is int:
                _remember(self.shards, where, hit)
        return hit
