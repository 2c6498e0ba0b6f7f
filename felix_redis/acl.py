"""Redis ACL rules for felix-redis roles (docs/security.md, "Roles and tenants").

A role is held on one group (``group.consume``, ``group.manage``) or one stream
(``stream.publish``, ``stream.admin``). :func:`rules` builds the ``ACL SETUSER`` rules that
grant it, least privilege first:

* the root rules give ``+fcall`` (the library's functions, which an administrator
  installs: no role may load code, ``function|load``/``script|load``, nor run its own,
  ``eval``/``evalsha``), the read commands the scripts and the client use, the keyless
  commands redis-py's Cluster client routes with (:data:`CLUSTER_CLIENT_COMMANDS`), and
  read access to every key the role's operations touch, including the role's capability
  key (:func:`felix_redis.keys.capability_key`), which every script checks with
  ``redis.acl_check_cmd`` before it does anything;
* selectors ``(...)`` give the write commands the scripts use, only on the keys the role
  writes: a consumer its group's keys; a manager also ``SADD`` (never ``SREM``) on the
  groups set; a publisher ``HSET``/``HDEL`` on meta, ``XADD``/``XTRIM`` on the log and
  ``ZADD``/``ZREMRANGEBYSCORE`` on the shard's due index, ``HSET``/``HDEL`` and
  ``ZADD``/``ZREM`` on the shard's schedules (docs/schedules.md)
  (never ``DEL``, never the settings in conf); an admin every key of its stream and its
  tenant's registry.

Redis 7 runs a script's ``redis.call`` with the caller's ACL, so the commands a script uses
must be granted, and a user can run them directly too: within the keys a role writes, ACL
cannot tell a consumer's ``HDEL`` from a redrive's. The role check in the scripts is what
separates ``group.consume`` from ``group.manage`` on the same group; key patterns are what
separate groups, streams and tenants, and those hold against raw commands as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from felix_redis.constants import DEFAULT_PREFIX
from felix_redis.errors import InvalidArgument
from felix_redis.keys import (
    GROUP_ROLE_CAPS,
    STREAM_ROLE_CAPS,
    capability_key,
    check_name,
    registry_key,
    tenants_key,
)

__all__ = [
    "CLUSTER_CLIENT_COMMANDS", "READ_COMMANDS", "ROLES", "WRITE_COMMANDS", "NodeResult", "deployment_nodes",
    "format_command", "grant", "grant_everywhere", "rules", "setuser_args",
]

#: Every role :func:`rules` knows.
ROLES = (*GROUP_ROLE_CAPS, *STREAM_ROLE_CAPS)

#: Granted on every key of a role (root rules): what the scripts and the client read with.
#: TIME: the scripts' clock; WAIT: quorum/all streams; XREAD: long polls and subscribers.
READ_COMMANDS = (
    "ping", "time", "wait", "fcall", "type", "exists", "get",
    "hget", "hmget", "hgetall", "hlen", "hexists", "hscan",
    "smembers", "sismember", "scard",
    "zrange", "zrangebyscore", "zrangebylex", "zscore", "zmscore", "zcard", "zcount",
    "xrange", "xrevrange", "xinfo|stream", "xlen", "xread",
)
#: Keyless commands redis-py's Redis Cluster client needs to route calls: ``CLUSTER SLOTS``
#: (the slot map, read on connect and after a failover or ``MOVED``), ``COMMAND`` (the
#: command table, and ``COMMAND GETKEYS`` for where an ``FCALL`` goes) and ``ASKING``
#: (during a slot migration). They show the cluster's layout and the command table, no
#: data; without them a role user cannot connect to a Cluster at all.
CLUSTER_CLIENT_COMMANDS = ("cluster|slots", "command", "asking")
#: Granted to the group roles on their group's keys only (one selector): what the group
#: scripts write with, and BZPOPMIN: a long poll waits on its group's bell (a zset; from
#: the group's other zsets the role could ZREM already). No role but
#: stream.admin may DEL a key outside its own group.
GROUP_WRITE_COMMANDS = ("hset", "hdel", "zadd", "zrem", "xadd", "del", "bzpopmin")
#: Granted to stream.admin on every key of its stream.
ADMIN_WRITE_COMMANDS = (
    "hset", "hdel", "sadd", "srem", "zadd", "zrem", "zremrangebyscore", "xadd", "xtrim", "del", "bzpopmin",
)
#: Every write command some role holds (on its own keys only).
WRITE_COMMANDS = ADMIN_WRITE_COMMANDS

_GLOB_SPECIAL = "\\*?[]"


def _glob(text: str) -> str:
    """``text`` with Redis glob characters escaped (names cannot hold any; a prefix might)."""
    return "".join("\\" + c if c in _GLOB_SPECIAL else c for c in text)


def rules(
    role: str,
    tenant: str,
    namespace: str,
    stream: str,
    group: str | None = None,
    *,
    prefix: str = DEFAULT_PREFIX,
) -> list[str]:
    """The ACL rules (without ``ACL SETUSER USER``) that grant ``role`` on a group (group
    roles: ``group`` required) or a stream (stream roles: ``group`` must be None), on every
    shard of the stream. Rules only add; they never take anything away."""
    if role not in ROLES:
        raise InvalidArgument(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")
    check_name(tenant, "tenant")
    check_name(namespace, "namespace")
    check_name(stream, "stream")
    if role in GROUP_ROLE_CAPS:
        if group is None:
            raise InvalidArgument(f"role {role} is granted on one group: name the group")
        check_name(group, "group")
    elif group is not None:
        raise InvalidArgument(f"role {role} is granted on a whole stream: leave the group out")
    p = _glob(prefix)
    base = f"{p}:{{{_glob(f'{tenant}/{namespace}/{stream}')}/*}}"
    cap = capability_key(p, f"{_glob(f'{tenant}/{namespace}/{stream}')}/*", role, group)
    # the schedules' keys too: a worker of any role ticks them, and the script's role check
    # (stream.publish or stream.admin) is what refuses a consumer (docs/schedules.md)
    shard_patterns = [f"{base}:meta", f"{base}:log", f"{base}:groups", f"{base}:conf", f"{base}:due",
                      f"{base}:sched", f"{base}:schedules"]
    writes: list[tuple[tuple[str, ...], list[str]]]  # (commands, key patterns) per selector
    if role in GROUP_ROLE_CAPS:
        assert group is not None
        group_patterns = [f"{base}:g:{_glob(group)}", f"{base}:g:{_glob(group)}:*"]
        read = [*shard_patterns, *group_patterns, cap]
        writes = [(GROUP_WRITE_COMMANDS, group_patterns)]
        if role == "group.manage":
            # names may be added to the groups set, never removed: SREM would let a
            # manager of one group hide another from retention (docs/security.md)
            writes.append((("sadd",), [f"{base}:groups"]))
    elif role == "stream.publish":
        # trimming (after a publish, when the stream has retention) reads every group's
        # position; the producers' states live in meta; the settings (conf) are read only
        read = [*shard_patterns, f"{base}:g:*", cap]
        # the due index: delayed publishes add to its chunks (ZREM of the old, ZADD of the
        # longer), trimming prunes what every group passed
        writes = [(("hset", "hdel"), [f"{base}:meta"]), (("xadd", "xtrim"), [f"{base}:log"]),
                  (("zadd", "zrem", "zremrangebyscore"), [f"{base}:due"]),
                  (("hset", "hdel"), [f"{base}:schedules"]), (("zadd", "zrem"), [f"{base}:sched"])]
    else:  # stream.admin: every key of the stream, and its tenant's registry
        read = [f"{base}:*", cap, registry_key(p, _glob(tenant))]
        writes = [
            (ADMIN_WRITE_COMMANDS, [f"{base}:*"]),
            (("zadd", "zrem"), [registry_key(p, _glob(tenant))]),
            (("sadd",), ["%W~" + tenants_key(p)]),
        ]
    out = ["on", *(f"+{c}" for c in (*READ_COMMANDS, *CLUSTER_CLIENT_COMMANDS)), *(f"~{k}" for k in read)]
    for commands, keys in writes:
        patterns = [k if k.startswith("%") else f"~{k}" for k in keys]
        out.append("(" + " ".join([*(f"+{c}" for c in commands), *patterns]) + ")")
    return out


def setuser_args(user: str, rule_list: Sequence[str], *, reset: bool = False, password: str | None = None) -> list[str]:
    """``ACL SETUSER`` arguments: ``reset`` first when asked (it also drops the user's
    passwords), then the password (``>password``) when given, then the rules."""
    if not user or any(c.isspace() for c in user):
        raise InvalidArgument(f"bad Redis user name {user!r}")
    args = ["ACL", "SETUSER", user]
    if reset:
        args.append("reset")
    if password is not None:
        if not password:
            raise InvalidArgument("the password must not be empty")
        args.append(">" + password)
    return args + list(rule_list)


def format_command(args: Sequence[str]) -> str:
    """``args`` as one line for redis-cli, the password (``>...``) shown as ``>***``."""
    shown = []
    for arg in args:
        if arg.startswith(">") or arg.startswith("#"):
            arg = arg[0] + "***"
        needs_quotes = any(c in arg for c in " \"'(){}\\") or not arg
        shown.append('"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"' if needs_quotes else arg)
    return " ".join(shown)


def grant(redis_client: Any, args: Sequence[str]) -> None:
    """Runs ``ACL SETUSER`` (``args`` from :func:`setuser_args`) on the one server
    ``redis_client`` (a redis-py client, or a :class:`felix_redis.Client`) talks to. ACL
    rules are per server and ``ACL SETUSER`` is not replicated: on Sentinel and Cluster
    use :func:`grant_everywhere`."""
    raw = getattr(redis_client, "redis", redis_client)
    raw.execute_command(*args)


@dataclass(frozen=True)
class NodeResult:
    """What :func:`grant_everywhere` did on one node."""

    host: str
    port: int
    role: str
    """``primary``, ``replica`` or ``server`` (a standalone server, or one whose role is unknown)."""
    error: str | None = None
    """Why the command was not applied there (the node could not be reached, or refused); None: applied."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}" if self.port else self.host

    @property
    def ok(self) -> bool:
        return self.error is None

    def __str__(self) -> str:
        return f"{self.address} ({self.role})"


#: Pool options that belong to the pool or to one address, not to a node's connection.
_NOT_FOR_A_NODE = ("host", "port", "connection_pool", "connection_class", "redis_connect_func")


def _node_options(pool: Any) -> tuple[type, dict[str, Any]]:
    """The connection class and options (credentials, TLS, timeouts) of ``pool``'s
    connections, to reach other nodes of the same deployment with."""
    import redis

    cls = redis.SSLConnection if issubclass(pool.connection_class, redis.SSLConnection) else redis.Connection
    options = {k: v for k, v in pool.connection_kwargs.items() if k not in _NOT_FOR_A_NODE}
    return cls, options


def _sentinel_nodes(raw: Any) -> list[tuple[str, int, str]]:
    """The primary the sentinels name and every replica any sentinel knows, down ones too
    (they are tried, and reported when they cannot be reached)."""
    import redis

    manager, service = raw.connection_pool.sentinel_manager, raw.connection_pool.service_name
    host, port = manager.discover_master(service)
    nodes = [(str(host), int(port), "primary")]
    seen = {(str(host), int(port))}
    replicas = [(str(h), int(p)) for h, p in manager.discover_slaves(service)]
    for sentinel in manager.sentinels:
        try:
            known = sentinel.sentinel_slaves(service)
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            continue
        replicas += [(str(r["ip"]), int(r["port"])) for r in known]
    for address in replicas:
        if address not in seen:
            seen.add(address)
            nodes.append((*address, "replica"))
    return nodes


def _cluster_nodes(raw: Any, cls: type, options: dict[str, Any]) -> list[tuple[str, int, str]]:
    """Every node of ``CLUSTER NODES`` as the first node that answers sees them (failed
    ones too), and any node the client knows that it does not list."""
    import redis

    known = [(str(n.host), int(n.port)) for n in raw.get_nodes()]
    listing = None
    errors = []
    for host, port in known:
        try:
            listing = _send(cls, options, host, port, ("CLUSTER", "NODES"))
            break
        except redis.RedisError as exc:
            errors.append(f"{host}:{port}: {exc}")
    if listing is None:
        raise redis.ConnectionError("no cluster node answered CLUSTER NODES: " + "; ".join(errors))
    text = listing.decode() if isinstance(listing, bytes) else str(listing)
    nodes: list[tuple[str, int, str]] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or "noaddr" in parts[2].split(","):
            continue
        address = parts[1].split("@", 1)[0]
        host, _, port_text = address.rpartition(":")
        if not host or not port_text.isdigit() or int(port_text) == 0:
            continue
        flags = parts[2].split(",")
        role = "primary" if "master" in flags else "replica" if "slave" in flags else "server"
        nodes.append((host, int(port_text), role))
    listed = {(h, p) for h, p, _ in nodes}
    nodes += [(h, p, "server") for h, p in known if (h, p) not in listed]
    return nodes


def _send(cls: type, options: dict[str, Any], host: str, port: int, args: Sequence[str]) -> Any:
    """One command on a connection of its own to host:port."""
    connection = cls(host=host, port=port, **options)
    try:
        connection.send_command(*args)
        reply = connection.read_response()
    finally:
        connection.disconnect()
    if isinstance(reply, Exception):
        raise reply
    return reply


def deployment_nodes(redis_client: Any) -> list[tuple[str, int, str]]:
    """``(host, port, role)`` of every data node behind ``redis_client``: on Sentinel the
    primary the sentinels name and every replica they know; on Cluster every node of
    ``CLUSTER NODES``; else the one server."""
    raw = getattr(redis_client, "redis", redis_client)
    if hasattr(raw, "get_nodes") and hasattr(raw, "nodes_manager"):
        cls, options = _node_options(raw.get_default_node().redis_connection.connection_pool)
        return _cluster_nodes(raw, cls, options)
    pool = getattr(raw, "connection_pool", None)
    if pool is not None and hasattr(pool, "sentinel_manager"):
        return _sentinel_nodes(raw)
    kwargs = getattr(pool, "connection_kwargs", {}) if pool is not None else {}
    host, port = kwargs.get("host"), kwargs.get("port")
    if host is None or port is None:  # a unix socket, fakeredis
        return [(str(kwargs.get("path") or "memory"), 0, "server")]
    return [(str(host), int(port), "server")]


def grant_everywhere(redis_client: Any, args: Sequence[str], *, timeout: float = 5.0) -> list[NodeResult]:
    """Runs ``ACL SETUSER`` (``args`` from :func:`setuser_args`) on every data node of the
    deployment ``redis_client`` (a sync redis-py client or a :class:`felix_redis.Client`)
    talks to, so a promoted replica knows the user too: on Sentinel the primary and every
    replica the sentinels know (``discover_master``, ``discover_slaves`` and each
    sentinel's replica list, down ones included); on Redis Cluster every node of
    ``CLUSTER NODES``; on a standalone server that server. Each node gets a connection of
    its own with the client's credentials and TLS options.

    A node that cannot be reached or refuses does not stop the others: its
    :class:`NodeResult` holds the error. Failing to find the nodes at all (no sentinel
    names a primary, no cluster node answers) raises the redis-py error."""
    import redis

    raw = getattr(redis_client, "redis", redis_client)
    is_cluster = hasattr(raw, "get_nodes") and hasattr(raw, "nodes_manager")
    pool = raw.get_default_node().redis_connection.connection_pool if is_cluster else getattr(
        raw, "connection_pool", None)
    if pool is None or (not is_cluster and not hasattr(pool, "sentinel_manager")):
        # one server (or fakeredis): the client's own connection
        (host, port, _), = deployment_nodes(raw)
        try:
            raw.execute_command(*args)
        except redis.RedisError as exc:
            return [NodeResult(host, port, "server", _reason(exc))]
        return [NodeResult(host, port, _role(raw))]
    cls, options = _node_options(pool)
    for name in ("socket_timeout", "socket_connect_timeout"):
        if options.get(name) is None:  # a node that does not answer must not hold up the rest
            options[name] = timeout
    results = []
    for host, port, role in deployment_nodes(raw):
        try:
            _send(cls, options, host, port, args)
        except (redis.RedisError, OSError) as exc:
            results.append(NodeResult(host, port, role, _reason(exc)))
        else:
            results.append(NodeResult(host, port, role))
    return results


def _role(raw: Any) -> str:
    """``primary`` or ``replica`` from ROLE, ``server`` when that is not known."""
    try:
        reply = raw.execute_command("ROLE")
    except Exception:
        return "server"
    first = reply[0] if isinstance(reply, list | tuple) and reply else b""
    first = first.decode() if isinstance(first, bytes) else str(first)
    return {"master": "primary", "slave": "replica"}.get(first, "server")


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__
