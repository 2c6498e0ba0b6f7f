"""Redis ACL rules for felix-redis roles (docs/security.md, "Roles and tenants").

A role is held on one group (``group.consume``, ``group.manage``) or one stream
(``stream.publish``, ``stream.admin``). :func:`rules` builds the ``ACL SETUSER`` rules that
grant it, least privilege first:

* the root rules give ``+fcall`` (the scripts as functions, once an administrator's
  client loaded the library: loading one, ``function|load``, is never granted, since it
  could replace the library every user runs), ``+evalsha`` and ``+script|load`` (the
  content-addressed fallback a client uses when it cannot call the functions), the read
  commands the scripts and the client use, and key patterns for
  every key the role's operations touch, including the role's capability key
  (:func:`felix_redis.keys.capability_key`), which every script checks with
  ``redis.acl_check_cmd`` before it does anything;
* one selector ``(...)`` gives the write commands the scripts use, only on the keys the
  role writes (a consumer writes its group's keys, never the log or another group).

Redis 7 runs a script's ``redis.call`` with the caller's ACL, so the commands a script uses
must be granted, and a user can run them directly too: within the keys a role writes, ACL
cannot tell a consumer's ``HDEL`` from a redrive's. The role check in the scripts is what
separates ``group.consume`` from ``group.manage`` on the same group; key patterns are what
separate groups, streams and tenants, and those hold against raw commands as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from felix_redis.constants import DEFAULT_PREFIX
from felix_redis.errors import InvalidArgument
from felix_redis.keys import (
    GROUP_ROLE_CAPS,
    STREAM_ROLE_CAPS,
    capability_key,
    check_name,
    producer_ids_key,
    registry_key,
)

__all__ = ["READ_COMMANDS", "ROLES", "WRITE_COMMANDS", "format_command", "grant", "rules", "setuser_args"]

#: Every role :func:`rules` knows.
ROLES = (*GROUP_ROLE_CAPS, *STREAM_ROLE_CAPS)

#: Granted on every key of a role (root rules): what the scripts and the client read with.
#: TIME: the scripts' clock; WAIT: quorum/all streams; XREAD: long polls and subscribers.
READ_COMMANDS = (
    "ping", "time", "wait", "fcall", "evalsha", "script|load", "type", "exists", "get",
    "hget", "hmget", "hgetall", "hlen", "hexists", "hscan",
    "smembers", "sismember", "scard",
    "zrange", "zrangebyscore", "zrangebylex", "zscore", "zmscore", "zcard", "zcount",
    "xrange", "xlen", "xread",
)
#: Granted only on the keys a role writes (one selector).
WRITE_COMMANDS = ("hset", "hdel", "sadd", "srem", "zadd", "zrem", "xadd", "xtrim", "set", "pexpire", "del")

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
    shard_keys = [f"{base}:meta", f"{base}:log", f"{base}:groups"]
    extra: list[str] = []
    if role in GROUP_ROLE_CAPS:
        assert group is not None
        group_keys = [f"{base}:g:{_glob(group)}", f"{base}:g:{_glob(group)}:*"]
        read = [*shard_keys, *group_keys, cap]
        write = group_keys + ([f"{base}:groups"] if role == "group.manage" else [])
    elif role == "stream.publish":
        # trimming (after a publish, when the stream has retention) reads every group's
        # position; the idempotent producer takes its id from a counter shared by all
        # tenants (and keeps its state in the shard's meta hash)
        read = [*shard_keys, f"{base}:g:*", cap, producer_ids_key(p)]
        write = [f"{base}:meta", f"{base}:log"]
        extra = [f"(+incr ~{producer_ids_key(p)})"]
    else:  # stream.admin: every key of the stream, and the registry all tenants share
        read = [f"{base}:*", cap, registry_key(p)]
        write = [f"{base}:*"]
        extra = [f"(+zadd +zrem ~{registry_key(p)})", "+scan", "+info"]
    out = ["on", *(f"+{c}" for c in READ_COMMANDS), *(f"~{k}" for k in read)]
    out.append("(" + " ".join([*(f"+{c}" for c in WRITE_COMMANDS), *(f"~{k}" for k in write)]) + ")")
    return out + extra


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
    """Runs ``ACL SETUSER`` (``args`` from :func:`setuser_args`) on ``redis_client`` (a
    redis-py client, or a :class:`felix_redis.Client`). On Redis Cluster and with replicas,
    ACL rules are per server: apply them on every node (or keep them in an ACL file)."""
    raw = getattr(redis_client, "redis", redis_client)
    raw.execute_command(*args)
