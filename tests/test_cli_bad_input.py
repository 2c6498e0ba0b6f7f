"""Bad input through felixctl: generated names, claims and numbers for every command that
takes them. Each must exit 1 with one ``felixctl: error:`` line (or 2 for a usage error
click catches), print no traceback, and leave the keyspace exactly as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import felix_redis
from felixctl.cli import cli

T, N, S, G = "acme", "prod", "jobs", "workers"
HYPO = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

bad_names = st.one_of(
    st.sampled_from(["", "a b", "a:b", "{x}", "a/b", "a|b", "x" * 65, "é", "a\tb", "-lead"]),
    st.text(min_size=1, max_size=80).filter(lambda s: not s.replace("_", "").replace(".", "").replace("-", "").isalnum()
                                            or not s.isascii() or len(s) > 64 or s[:1] in "_.-"),
).filter(lambda s: "\x00" not in s and not s.startswith("-"))
bad_claims = st.one_of(
    st.sampled_from(["", "0", "0:1", "a:b:c", "0:1:0", "-1:2:3", "0:1:2:3", " 0:1:1x", "0:99999999999999999:1"]),
    st.text(max_size=30).filter(lambda s: s.count(":") != 2 or not all(p.isdigit() for p in s.split(":"))),
).filter(lambda s: "\x00" not in s and not s.startswith("-"))


def run(url: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--redis-url", url, "--tenant", T, "--namespace", N, *args])


def refused(result: Result) -> None:
    assert result.exit_code in (1, 2), (result.exit_code, result.output)
    assert "Traceback" not in result.output
    if result.exit_code == 1:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("felixctl: error: "), result.stderr


def prepared(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=2)
    client.group_create(T, N, S, G)
    client.publish(T, N, S, b"x", shard=0)


@HYPO
@given(name=bad_names)
def test_bad_names_everywhere(name: str, backend: tuple[str, Any], client: felix_redis.Client,
                              unchanged: Callable[[], Any]) -> None:
    url = backend[0]
    if not client.stream_list():
        prepared(client)
    with unchanged():
        for args in (
            ["stream", "create", name], ["stream", "describe", name], ["stream", "delete", name, "--yes"],
            ["stream", "trim", name], ["pub", name, "x"], ["sub", name],
            ["group", "create", S, name], ["group", "create", name, G], ["group", "describe", S, name],
            ["group", "configure", S, name, "--max-attempts", "3"], ["group", "delete", S, name, "--yes"],
            ["group", "poll", S, name], ["group", "poll", S, G, "--consumer", name],
            ["group", "ack", S, name, "0:0:1"], ["group", "dead-letters", S, name],
            ["group", "redrive", S, name, "--all", "--yes"], ["group", "keys", S, name],
            ["--tenant", name, "stream", "list"],
        ):
            refused(run(url, *args))


@HYPO
@given(claim=bad_claims)
def test_bad_claims_everywhere(claim: str, backend: tuple[str, Any], client: felix_redis.Client,
                               unchanged: Callable[[], Any]) -> None:
    url = backend[0]
    if not client.stream_list():
        prepared(client)
    with unchanged():
        for command in ("ack", "nack", "extend", "dead-letter", "redrive", "discard"):
            refused(run(url, "group", command, S, G, claim))


@HYPO
@given(number=st.sampled_from(["-1", "1e9", "abc", "99999999999999999999", "1.5", "", "0x10", "-0.5"]))
def test_bad_numbers_everywhere(number: str, backend: tuple[str, Any], client: felix_redis.Client,
                                unchanged: Callable[[], Any]) -> None:
    url = backend[0]
    if not client.stream_list():
        prepared(client)
    with unchanged():
        for args in (
            ["group", "poll", S, G, "--max", number], ["group", "poll", S, G, "--wait-ms", number],
            ["group", "poll", S, G, "--shard", number], ["stream", "create", "other", "--shards", number],
            ["group", "nack", S, G, "0:0:1", "--delay-ms", number], ["pub", S, "x", "--shard", number],
            ["group", "configure", S, G, "--max-attempts", number],
            ["group", "create", S, "g2", "--visibility-timeout-ms", number],
        ):
            refused(run(url, *args))
