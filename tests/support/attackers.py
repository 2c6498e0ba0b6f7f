"""Helpers of the attack suite (tests/test_attacks.py): a password-protected private
server, real ACL users made with ``felixctl acl grant --apply``, raw redis-py
connections as those users, and script calls recorded from a client and replayed
with forged KEYS and ARGV through ``FCALL``."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from click.testing import CliRunner

import felix_redis
from felix_redis import scripts
from felix_redis.keys import StreamName
from felixctl.cli import cli
from tests.conftest import dump_keyspace

#: The default user's password (requirepass) and every role user's.
ADMIN_PW = "admin-pw-7d1c"
USER_PW = "user-pw-59ae"
PW_ENV = "FELIX_ATTACK_PW"

_users = itertools.count()


def url_of(port: int, user: str | None = None, password: str = ADMIN_PW) -> str:
    """``redis://USER:PASSWORD@127.0.0.1:PORT/0`` (the default user without USER)."""
    return f"redis://{user or ''}:{password}@127.0.0.1:{port}/0"


def felixctl(*args: str, env: dict[str, str] | None = None) -> Any:
    """``felixctl ARGS`` through click's CliRunner (stdout and stderr apart)."""
    return CliRunner().invoke(cli, list(args), env=env)


@dataclass
class User:
    """A role user: its name, a felix-redis client and a raw redis-py connection."""

    name: str
    url: str
    client: felix_redis.Client
    raw: redis.Redis


@dataclass
class Users:
    """Makes role users the documented way (``felixctl ... acl grant ... --apply``);
    :meth:`close` deletes them."""

    admin_url: str
    port: int
    admin_raw: redis.Redis
    made: list[User] = field(default_factory=list)

    def make(self, role: str, group: str | None = None, *, tenant: str = "acme", stream: str = "jobs",
             name: str | None = None) -> User:
        """A new user holding ``role`` (run again with ``name`` to add a role)."""
        name = name or f"attacker{os.getpid()}x{next(_users)}"
        args = ["--redis-url", self.admin_url, "--tenant", tenant, "--namespace", "prod", "acl", "grant", name,
                "--stream", stream]
        if group is not None:
            args += ["--group", group]
        args += ["--role", role, "--password-from-env", PW_ENV, "--apply"]
        result = felixctl(*args, env={PW_ENV: USER_PW})
        assert result.exit_code == 0, result.output
        for user in self.made:
            if user.name == name:
                return user
        url = url_of(self.port, name, USER_PW)
        user = User(name, url, felix_redis.connect(url), redis.Redis.from_url(url))
        self.made.append(user)
        return user

    def close(self) -> None:
        for user in self.made:
            user.client.close()
            user.raw.close()
            self.admin_raw.execute_command("ACL", "DELUSER", user.name)
        self.made.clear()


@dataclass(frozen=True)
class Call:
    """One script call a client made: the script's name, its KEYS and its ARGV."""

    script: str
    keys: list[str]
    args: list[Any]

    def forged(self, *, keys: list[str] | None = None, args: list[Any] | None = None) -> Call:
        return Call(self.script, list(self.keys if keys is None else keys), list(self.args if args is None else args))

    def replace(self, old: str, new: str) -> Call:
        """The call with ``old`` replaced by ``new`` in every key and text argument."""
        return self.forged(keys=[k.replace(old, new) for k in self.keys],
                           args=[a.replace(old, new) if isinstance(a, str) else a for a in self.args])


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value
    if isinstance(value, int | float):
        return str(value)
    return value


@contextlib.contextmanager
def recording(client: felix_redis.Client) -> Iterator[list[Call]]:
    """``with recording(client) as calls:`` every script call the client makes in the
    block (the layout of KEYS and ARGV the library really sends, whatever it is)."""
    calls: list[Call] = []
    runner = client._runner
    original = runner.command

    def command(name: str, keys: Any, args: Any) -> tuple[Any, ...]:
        calls.append(Call(name, [str(_text(k)) for k in keys], [_text(a) for a in args]))
        return original(name, keys, args)

    runner.command = command  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del runner.command


def last_call(calls: list[Call], script: str, **where: Any) -> Call:
    """The last recorded call of ``script`` (whose ARGV[i] equals each ``argI=value``)."""
    for call in reversed(calls):
        if call.script == script and all(call.args[int(k[3:]) - 1] == v for k, v in where.items()):
            return call
    raise AssertionError(f"no {script} call among {[c.script for c in calls]}")


def fcall(raw: redis.Redis, call: Call) -> Any:
    """The call as a raw ``FCALL`` of the library's function, as the user of ``raw``."""
    function = scripts.library().functions[call.script]
    return raw.execute_command("FCALL", function, len(call.keys), *call.keys, *call.args)


def shard0(tenant: str = "acme", stream: str = "jobs") -> dict[str, str]:
    """Shard 0's keys of ``tenant/prod/stream`` by role (meta, log, conf, groups)."""
    name = StreamName.of("felix", tenant, "prod", stream)
    meta, log = name.shard_keys(0)
    return {"meta": meta, "log": log, "conf": f"{name.base(0)}:conf", "groups": name.groups_key(0),
            "base": name.base(0)}


def group_key(group: str, part: str = "", tenant: str = "acme") -> str:
    """A key of ``group`` on shard 0 of ``tenant``/prod/jobs: its hash, or its ``part``
    (``dead``, ``owed``, ... as docs/keys.md names them)."""
    return f"{shard0(tenant)['base']}:g:{group}" + (f":{part}" if part else "")


def keys_without(raw: redis.Redis, marker: str) -> dict[bytes, Any]:
    """The keyspace (``dump_keyspace``) but for the keys whose name holds ``marker``."""
    return {k: v for k, v in dump_keyspace(raw).items() if marker.encode() not in k}


@contextlib.contextmanager
def library_loaded(raw: redis.Redis, code: str) -> Iterator[str]:
    """``with library_loaded(admin_raw, "#!lua name=x ...") as name:`` another application's
    function library, loaded by the default user and deleted afterwards (functions
    outlive FLUSHALL, and other tests count the libraries)."""
    name = raw.function_load(code)
    name = name.decode() if isinstance(name, bytes) else str(name)
    try:
        yield name
    finally:
        raw.function_delete(name)


def log_entries(raw: redis.Redis, log: str) -> list[tuple[int, bytes]]:
    """``(offset, payload)`` of every record in a log."""
    return [(int(i.split(b"-")[0]), f[b"p"]) for i, f in raw.xrange(log)]


def payload_at(raw: redis.Redis, log: str, offset: int) -> bytes | None:
    found = raw.xrange(log, str(offset), str(offset))
    return found[0][1][b"p"] if found else None
