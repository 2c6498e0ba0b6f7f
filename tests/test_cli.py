"""felixctl through click's CliRunner, on a real Redis and on memory://."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

import felix_redis
import felixctl.common as felixctl_common
from felix_redis import shard_for_key
from felixctl.cli import cli
from felixctl.common import escape_payload
from tests.support.payloads import unescape_payload

Run = Callable[..., Result]


@pytest.fixture
def url(backend: tuple[str, Any]) -> str:
    return backend[0]


@pytest.fixture
def felixctl(url: str) -> Run:
    """Runs felixctl with --redis-url pointing at the test backend."""
    runner = CliRunner()

    def run(*args: str, input: str | bytes | None = None, env: dict[str, str] | None = None) -> Result:
        result = runner.invoke(cli, ["--redis-url", url, *args], input=input, env=env)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result

    return run


@pytest.fixture
def jobs(felixctl: Run) -> Run:
    """A one-shard queue ``jobs`` with group ``workers`` (3 attempts)."""
    assert felixctl("stream", "create", "jobs").exit_code == 0
    assert felixctl("group", "create", "jobs", "workers", "--max-attempts", "3").exit_code == 0
    return felixctl


@pytest.fixture
def client(url: str) -> Iterator[felix_redis.Client]:
    c = felix_redis.connect(url)
    yield c
    c.close()


W = ("default", "default", "jobs")


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result.stdout


def failed(result: Result, *words: str) -> str:
    """The error line of a result that must have failed with exit 1."""
    assert result.exit_code == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("felixctl: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[-1], (word, lines[-1])
    return lines[-1]


def claims(stdout: str) -> list[str]:
    return [line.split("\t", 1)[0] for line in stdout.splitlines()]


# -- global behaviour


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, command in group.commands.items():
        yield (*prefix, name)
        if isinstance(command, click.Group):
            yield from _commands(command, (*prefix, name))


@pytest.mark.parametrize("path", [(), *_commands(cli)], ids=lambda p: " ".join(p) or "felixctl")
def test_every_command_has_help_with_an_example(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.stdout
    assert f"felixctl {' '.join(path)}".strip() in result.stdout


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert felix_redis.__version__ in result.stdout


def test_bad_option_is_a_usage_error(felixctl: Run) -> None:
    result = felixctl("group", "poll", "jobs", "workers", "--max", "0")
    assert result.exit_code == 2
    assert "felixctl: error" not in result.stderr
    assert felixctl("stream", "create", "jobs", "--kind", "nope").exit_code == 2
    assert felixctl("no-such-command").exit_code == 2
    assert felixctl("group", "poll", "jobs").exit_code == 2


def test_env_selects_url_tenant_and_namespace(url: str) -> None:
    env = {"FELIX_REDIS_URL": url, "FELIX_TENANT": "acme", "FELIX_NAMESPACE": "prod"}
    runner = CliRunner()
    assert runner.invoke(cli, ["stream", "create", "jobs"], env=env).exit_code == 0
    assert ok(runner.invoke(cli, ["stream", "list", "--all"], env=env)).split() == ["acme/prod/jobs"]
    assert ok(runner.invoke(cli, ["--tenant", "acme", "--namespace", "prod", "stream", "list"], env=env)) == "jobs\n"
    assert ok(runner.invoke(cli, ["stream", "list"], env={**env, "FELIX_TENANT": "other"})) == ""


def test_unreachable_redis_names_the_url_but_not_the_password() -> None:
    result = CliRunner().invoke(cli, ["--redis-url", "redis://admin:hunter2pw@127.0.0.1:1/0", "stream", "list"])
    line = failed(result, "127.0.0.1:1")
    assert "hunter2pw" not in result.stderr + result.stdout
    assert "***" in line


def test_unreachable_redis_for_a_group_command() -> None:
    result = CliRunner().invoke(cli, ["--redis-url", "redis://127.0.0.1:1/0", "group", "poll", "jobs", "w"])
    failed(result, "redis://127.0.0.1:1/0")


def test_unsupported_url_scheme() -> None:
    failed(CliRunner().invoke(cli, ["--redis-url", "http://example.com", "stream", "list"]), "scheme")


# -- streams


def test_stream_create_describe_list_delete(felixctl: Run) -> None:
    out = ok(felixctl("stream", "create", "jobs", "--kind", "queue", "--shards", "3"))
    assert "created" in out
    assert "exists already" in ok(felixctl("stream", "create", "jobs", "--kind", "queue", "--shards", "3"))
    failed(felixctl("stream", "create", "jobs", "--shards", "2"))
    ok(felixctl("stream", "create", "audit", "--kind", "stream", "--retention-max-len", "100"))
    assert ok(felixctl("stream", "list")).split() == ["audit", "jobs"]
    listing = json.loads(ok(felixctl("stream", "list", "-o", "json")))
    assert {"tenant": "default", "namespace": "default", "stream": "jobs"} in listing

    text = ok(felixctl("stream", "describe", "jobs"))
    assert "default/default/jobs" in text
    assert "SHARD" in text and "TAIL" in text
    doc = json.loads(ok(felixctl("stream", "describe", "audit", "-o", "json")))
    assert doc["kind"] == "stream"
    assert doc["retention_max_len"] == 100
    assert [s["shard"] for s in doc["shard_states"]] == [0]

    assert ok(felixctl("stream", "delete", "jobs", "--yes")).startswith("stream default/default/jobs deleted")
    assert ok(felixctl("stream", "list")).split() == ["audit"]
    failed(felixctl("stream", "delete", "jobs", "--yes"), "does not exist")
    failed(felixctl("stream", "describe", "jobs"), "jobs")


@pytest.mark.parametrize("answer", ["n", "y"])
def test_all_asks_a_person_at_a_terminal(jobs: Run, monkeypatch: pytest.MonkeyPatch, answer: str) -> None:
    """At a terminal, discard --all asks first; anything but yes changes nothing."""
    ok(jobs("pub", "jobs", "a"))
    ok(jobs("group", "poll", "jobs", "workers"))
    ok(jobs("group", "dead-letter", "jobs", "workers", "0:0:1"))
    asked: list[str] = []

    def fake_confirm(question: str, default: bool, err: bool) -> bool:
        asked.append(question)
        return answer == "y"

    monkeypatch.setattr(felixctl_common, "at_terminal", lambda: True)
    monkeypatch.setattr(felixctl_common.click, "confirm", fake_confirm)
    result = jobs("group", "discard", "jobs", "workers", "--all")
    assert asked and "every dead letter" in asked[0]
    monkeypatch.undo()
    letters = json.loads(ok(jobs("group", "dead-letters", "jobs", "workers", "-o", "json")))
    if answer == "y":
        assert ok(result) == "discarded 1 dead letter\n" and letters == []
    else:
        failed(result, "not confirmed")
        assert [d["offset"] for d in letters] == [0]


def test_stream_delete_from_a_script_needs_no_confirmation(felixctl: Run) -> None:
    """Only a person at a terminal is asked (CliRunner's stdin is not one)."""
    ok(felixctl("stream", "create", "jobs"))
    ok(felixctl("stream", "create", "other"))
    ok(felixctl("stream", "delete", "jobs"))
    ok(felixctl("stream", "delete", "other", "--yes"))
    assert ok(felixctl("stream", "list")) == ""


def test_bad_names_are_operation_errors(felixctl: Run) -> None:
    failed(felixctl("stream", "create", "bad name"), "stream name")
    failed(felixctl("--tenant", "a/b", "stream", "create", "jobs"), "tenant")


# -- pub


def test_pub_prints_shard_and_offset(felixctl: Run, client: felix_redis.Client) -> None:
    ok(felixctl("stream", "create", "jobs", "--shards", "4"))
    assert ok(felixctl("pub", "jobs", '{"order":42}', "--shard", "2")) == "2:0\n"
    assert ok(felixctl("pub", "jobs", "again", "--shard", "2")) == "2:1\n"
    keyed = shard_for_key(b"order-42", 4)
    assert ok(felixctl("pub", "jobs", "keyed", "--key", "order-42")) == f"{keyed}:{2 if keyed == 2 else 0}\n"
    record = client.read(*W, 2, 0, 1)[0]
    assert record.payload == b'{"order":42}'
    failed(felixctl("pub", "jobs", "x", "--shard", "9"), "shard 9")
    failed(felixctl("pub", "nope", "x"), "nope")


def test_pub_reads_stdin_dropping_one_newline(jobs: Run, client: felix_redis.Client) -> None:
    assert ok(jobs("pub", "jobs", "-", input=b"line one\nline two\n\n")) == "0:0\n"
    assert ok(jobs("pub", "jobs", "-", input=b"\x00\xff binary")) == "0:1\n"
    records = client.read(*W, 0, 0, 10)
    assert [r.payload for r in records] == [b"line one\nline two\n", b"\x00\xff binary"]


def test_pub_needs_a_payload(jobs: Run) -> None:
    assert jobs("pub", "jobs").exit_code == 2


def test_pub_file_publishes_a_record_per_line(jobs: Run, client: felix_redis.Client, tmp_path: Any) -> None:
    ok(jobs("stream", "create", "multi", "--shards", "2"))
    path = tmp_path / "tasks.txt"
    path.write_bytes(b"".join(b"task-%d\n" % i for i in range(25)) + b"last-no-newline")
    out = ok(jobs("pub", "multi", "--file", str(path), "--batch-size", "10"))
    assert "published 26 records in 3 atomic batches" in out
    records = [r for shard in (0, 1) for r in client.read("default", "default", "multi", shard, 0, 100)]
    assert sorted(r.payload for r in records) == sorted([b"task-%d" % i for i in range(25)] + [b"last-no-newline"])
    # One batch lands on one shard, in order.
    first_batch = [r.payload for r in records if r.payload in {b"task-%d" % i for i in range(10)}]
    assert first_batch == [b"task-%d" % i for i in range(10)]
    assert jobs("pub", "jobs", "x", "--file", str(path)).exit_code == 2


def test_pub_file_from_stdin_with_key(jobs: Run, client: felix_redis.Client) -> None:
    ok(jobs("stream", "create", "multi", "--shards", "3"))
    out = ok(jobs("pub", "multi", "--file", "-", "--key", "order-7", input="a\r\nb\nc\n"))
    shard = shard_for_key(b"order-7", 3)
    assert f"shard {shard} offsets 0..2" in out
    assert [r.payload for r in client.read("default", "default", "multi", shard, 0, 10)] == [b"a", b"b", b"c"]
    assert [r.key for r in client.read("default", "default", "multi", shard, 0, 10)] == ["order-7"] * 3


def test_pub_file_empty(jobs: Run, tmp_path: Any) -> None:
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    assert "published 0 records" in ok(jobs("pub", "jobs", "--file", str(path)))


# -- sub


def test_sub_replays_with_escaping(felixctl: Run) -> None:
    ok(felixctl("stream", "create", "jobs", "--shards", "2"))
    ok(felixctl("pub", "jobs", "one", "--shard", "0"))
    ok(felixctl("pub", "jobs", "two\nlines\\and\ttab", "--shard", "0"))
    ok(felixctl("pub", "jobs", "other", "--shard", "1"))
    out = ok(felixctl("sub", "jobs"))
    assert out == "0:0\tone\n0:1\ttwo\\nlines\\\\and\\ttab\n1:0\tother\n"
    assert ok(felixctl("sub", "jobs", "--from", "1", "--shard", "0")) == "0:1\ttwo\\nlines\\\\and\\ttab\n"
    assert ok(felixctl("sub", "jobs", "--from", "latest")) == ""
    assert ok(felixctl("sub", "jobs", "--max", "1")) == "0:0\tone\n"
    docs = json.loads(ok(felixctl("sub", "jobs", "-o", "json")))
    assert [d["payload"] for d in docs] == ["one", "two\nlines\\and\ttab", "other"]
    lines = ok(felixctl("sub", "jobs", "-o", "jsonl")).splitlines()
    assert [json.loads(line)["offset"] for line in lines] == [0, 1, 0]
    failed(felixctl("sub", "jobs", "--shard", "5"), "shard 5")
    assert felixctl("sub", "jobs", "--from", "yesterday").exit_code == 2
    assert felixctl("sub", "jobs", "--follow", "-o", "json").exit_code == 2
    failed(felixctl("sub", "nope"), "nope")


def test_sub_follow_prints_new_records(felixctl: Run, url: str) -> None:
    ok(felixctl("stream", "create", "jobs"))
    ok(felixctl("pub", "jobs", "old"))

    def later() -> None:
        time.sleep(0.3)
        with felix_redis.connect(url) as c:
            c.publish(*W, b"new-1")
            c.publish(*W, b"new-2")

    thread = threading.Thread(target=later, daemon=True)
    thread.start()
    out = ok(felixctl("sub", "jobs", "--from", "latest", "--follow", "--max", "2"))
    thread.join(10)
    assert not thread.is_alive()
    assert out == "0:1\tnew-1\n0:2\tnew-2\n"


def test_sub_binary_payload_json_is_base64(felixctl: Run, client: felix_redis.Client) -> None:
    ok(felixctl("stream", "create", "jobs"))
    client.publish(*W, b"\xff\x00")
    doc = json.loads(ok(felixctl("sub", "jobs", "-o", "json")))[0]
    assert doc["payload_base64"] == "/wA="
    assert "payload" not in doc


# -- groups


def test_group_create_list_describe_configure_delete(felixctl: Run) -> None:
    ok(felixctl("stream", "create", "jobs", "--shards", "2"))
    ok(felixctl("pub", "jobs", "before", "--shard", "0"))
    assert "created" in ok(felixctl("group", "create", "jobs", "workers", "--from", "latest",
                                    "--visibility-timeout-ms", "5000", "--max-attempts", "4"))
    failed(felixctl("group", "create", "jobs", "workers"), "exists")
    ok(felixctl("group", "create", "jobs", "audit", "--from", "earliest"))
    ok(felixctl("group", "create", "jobs", "late", "--from", "0"))
    failed(felixctl("group", "create", "jobs", "later", "--from", "7"), "beyond the tail")
    assert felixctl("group", "create", "jobs", "x", "--from", "soon").exit_code == 2
    failed(felixctl("group", "create", "nope", "x"), "nope")
    assert ok(felixctl("group", "list", "jobs")).split() == ["audit", "late", "workers"]
    assert json.loads(ok(felixctl("group", "list", "jobs", "-o", "json"))) == ["audit", "late", "workers"]

    text = ok(felixctl("group", "describe", "jobs", "audit"))
    header = text.splitlines()[1].split()
    assert header == ["SHARD", "POSITION", "TAIL", "LAG", "UNFINISHED", "PENDING", "IN-FLIGHT", "OWED", "DEAD",
                      "OLDEST-UNFINISHED"]  # UNFINISHED since issue 25
    assert "all" in text
    doc = json.loads(ok(felixctl("group", "describe", "jobs", "workers", "-o", "json")))
    assert (doc["visibility_timeout_ms"], doc["max_attempts"]) == (5000, 4)
    assert doc["lag"] == 0 and doc["owed"] == 0
    assert [s["shard"] for s in doc["shards"]] == [0, 1]
    assert json.loads(ok(felixctl("group", "describe", "jobs", "audit", "-o", "json")))["lag"] == 1

    assert "max attempts 9" in ok(felixctl("group", "configure", "jobs", "workers", "--max-attempts", "9"))
    assert felixctl("group", "configure", "jobs", "workers").exit_code == 2
    failed(felixctl("group", "describe", "jobs", "nope"), "nope")

    ok(felixctl("group", "create", "jobs", "scratch"))
    ok(felixctl("group", "delete", "jobs", "scratch"))  # a script is not asked
    ok(felixctl("group", "delete", "jobs", "audit", "--yes"))
    assert ok(felixctl("group", "list", "jobs")).split() == ["late", "workers"]
    failed(felixctl("group", "delete", "jobs", "audit", "--yes"), "audit")


def test_poll_nothing_due_prints_nothing(jobs: Run) -> None:
    result = jobs("group", "poll", "jobs", "workers")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")
    assert json.loads(ok(jobs("group", "poll", "jobs", "workers", "-o", "json"))) == []


def test_poll_prints_claims_and_escaped_payloads(jobs: Run) -> None:
    ok(jobs("pub", "jobs", "a\tb\nc\\d\re"))
    ok(jobs("pub", "jobs", "second"))
    out = ok(jobs("group", "poll", "jobs", "workers"))
    assert out == "0:0:1\ta\\tb\\nc\\\\d\\re\n"
    line = out.encode().rstrip(b"\n").split(b"\t", 1)[1]
    assert unescape_payload(line) == b"a\tb\nc\\d\re"
    doc = json.loads(ok(jobs("group", "poll", "jobs", "workers", "--max", "5", "-o", "json")))
    assert [(d["claim"], d["payload"]) for d in doc] == [("0:1:1", "second")]


def test_poll_prints_json_and_text_payloads_as_published(jobs: Run) -> None:
    """Without a line break a payload is printed as it is: JSON escapes, Windows paths
    and tabs come out unchanged, and the line splits at its first tab."""
    payloads = ['{"note":"say \\"hi\\"\\nbye","path":"C:\\\\tmp"}', "a\tb\\tc"]
    for payload in payloads:
        ok(jobs("pub", "jobs", payload))
    out = ok(jobs("group", "poll", "jobs", "workers", "--max", "5"))
    lines = [line.split("\t", 1) for line in out.splitlines()]
    assert lines == [["0:0:1", payloads[0]], ["0:1:1", payloads[1]]]
    assert json.loads(lines[0][1]) == {"note": 'say "hi"\nbye', "path": "C:\\tmp"}


def test_poll_unknown_stream_and_group(jobs: Run) -> None:
    failed(jobs("group", "poll", "nope", "workers"), "nope")
    failed(jobs("group", "poll", "jobs", "nope"), "nope")
    failed(jobs("group", "poll", "jobs", "workers", "--shard", "3"), "shard 3")


def test_poll_all_shards_and_one_shard(felixctl: Run) -> None:
    ok(felixctl("stream", "create", "jobs", "--shards", "3"))
    ok(felixctl("group", "create", "jobs", "workers"))
    for shard in (0, 1, 2):
        ok(felixctl("pub", "jobs", f"s{shard}", "--shard", str(shard)))
    assert claims(ok(felixctl("group", "poll", "jobs", "workers", "--shard", "1", "--max", "5"))) == ["1:0:1"]
    assert sorted(claims(ok(felixctl("group", "poll", "jobs", "workers", "--max", "5")))) == ["0:0:1", "2:0:1"]


def test_poll_waits_for_a_record(jobs: Run, url: str) -> None:
    def later() -> None:
        time.sleep(0.3)
        with felix_redis.connect(url) as c:
            c.publish(*W, b"late")

    thread = threading.Thread(target=later, daemon=True)
    thread.start()
    started = time.monotonic()
    out = ok(jobs("group", "poll", "jobs", "workers", "--wait-ms", "5000"))
    thread.join(10)
    assert not thread.is_alive()
    assert out == "0:0:1\tlate\n"
    assert time.monotonic() - started < 4


def test_poll_wait_times_out_empty(jobs: Run) -> None:
    started = time.monotonic()
    assert ok(jobs("group", "poll", "jobs", "workers", "--wait-ms", "200")) == ""
    assert time.monotonic() - started >= 0.15


def test_poll_as_consumer_with_reclaim(jobs: Run) -> None:
    ok(jobs("pub", "jobs", "x"))
    assert claims(ok(jobs("group", "poll", "jobs", "workers", "--consumer", "w-7"))) == ["0:0:1"]
    assert ok(jobs("group", "poll", "jobs", "workers", "--consumer", "w-7")) == ""
    assert claims(ok(jobs("group", "poll", "jobs", "workers", "--consumer", "w-7", "--reclaim"))) == ["0:0:2"]
    assert claims(ok(jobs("group", "poll", "jobs", "workers", "--shard", "0", "--consumer", "w-7",
                          "--reclaim"))) == ["0:0:3"]
    assert jobs("group", "poll", "jobs", "workers", "--reclaim").exit_code == 2
    failed(jobs("group", "poll", "jobs", "workers", "--consumer", "bad name"), "consumer")


def test_ack_nack_extend(jobs: Run) -> None:
    for payload in ("a", "b", "c"):
        ok(jobs("pub", "jobs", payload))
    assert claims(ok(jobs("group", "poll", "jobs", "workers", "--max", "3"))) == ["0:0:1", "0:1:1", "0:2:1"]
    assert "extended 0:2:1 until" in ok(jobs("group", "extend", "jobs", "workers", "0:2:1", "--by-ms", "60000"))
    ok(jobs("group", "extend", "jobs", "workers", "0:2:1"))
    assert ok(jobs("group", "ack", "jobs", "workers", "0:0:1", "0:2:1")) == "acked 0:0:1\nacked 0:2:1\n"
    assert "finished already" in ok(jobs("group", "ack", "jobs", "workers", "0:0:1"))
    assert ok(jobs("group", "nack", "jobs", "workers", "0:1:1")) == "nacked 0:1:1\n"
    assert claims(ok(jobs("group", "poll", "jobs", "workers"))) == ["0:1:2"]
    assert "redelivered in 60000 ms" in ok(jobs("group", "nack", "jobs", "workers", "0:1:2", "--delay-ms", "60000"))
    assert ok(jobs("group", "poll", "jobs", "workers")) == ""
    doc = json.loads(ok(jobs("group", "describe", "jobs", "workers", "-o", "json")))
    assert (doc["owed"], doc["in_flight"], doc["lag"]) == (1, 0, 2)


def test_stale_and_malformed_claims(jobs: Run, client: felix_redis.Client) -> None:
    ok(jobs("pub", "jobs", "a"))
    ok(jobs("group", "poll", "jobs", "workers"))
    ok(jobs("group", "nack", "jobs", "workers", "0:0:1"))
    ok(jobs("group", "poll", "jobs", "workers"))
    failed(jobs("group", "nack", "jobs", "workers", "0:0:1"), "stale")
    failed(jobs("group", "extend", "jobs", "workers", "0:0:1"), "stale")
    def state() -> list[tuple[int, ...]]:
        return [(s.position, s.owed, s.in_flight, s.dead) for s in client.group_describe(*W, "workers").shards]

    before = state()
    for command in ("nack", "extend", "dead-letter"):
        failed(jobs("group", command, "jobs", "workers", "0:0:2", "not-a-claim"), "malformed claim")
    failed(jobs("group", "nack", "jobs", "workers", "0:0"), "malformed claim")
    assert state() == before
    # ack settles each claim on its own (CONTRACT): the malformed one is reported, 0:0:2 acked
    result = jobs("group", "ack", "jobs", "workers", "0:0:2", "not-a-claim")
    failed(result, "malformed claim")
    assert result.stdout == "acked 0:0:2\n"
    assert state() == [(1, 0, 0, 0)]
    failed(jobs("group", "ack", "jobs", "nope", "0:0:2"), "nope")
    assert jobs("group", "ack", "jobs", "workers").exit_code == 2


def test_several_claims_keep_going_after_one_fails(jobs: Run) -> None:
    ok(jobs("pub", "jobs", "a"))
    ok(jobs("pub", "jobs", "b"))
    ok(jobs("group", "poll", "jobs", "workers", "--max", "2"))
    result = jobs("group", "nack", "jobs", "workers", "0:0:9", "0:1:1")
    failed(result, "0:0")
    assert result.stdout == "nacked 0:1:1\n"


def test_dead_letter_list_redrive_discard(jobs: Run) -> None:
    for payload in ("a", "b", "c"):
        ok(jobs("pub", "jobs", payload))
    ok(jobs("group", "poll", "jobs", "workers", "--max", "3"))
    assert ok(jobs("group", "dead-letter", "jobs", "workers", "0:0:1", "0:1:1", "--reason", "bad card")) == (
        "dead-lettered 0:0:1\ndead-lettered 0:1:1\n")
    ok(jobs("group", "nack", "jobs", "workers", "0:2:1"))
    assert claims(ok(jobs("group", "poll", "jobs", "workers"))) == ["0:2:2"]
    ok(jobs("group", "nack", "jobs", "workers", "0:2:2"))
    assert claims(ok(jobs("group", "poll", "jobs", "workers"))) == ["0:2:3"]
    assert "now a dead letter" in ok(jobs("group", "nack", "jobs", "workers", "0:2:3"))

    text = ok(jobs("group", "dead-letters", "jobs", "workers"))
    assert "RECORD" in text and "bad card" in text
    doc = json.loads(ok(jobs("group", "dead-letters", "jobs", "workers", "-o", "json", "--payloads")))
    assert [(d["offset"], d["attempts"], d["payload"]) for d in doc] == [(0, 1, "a"), (1, 1, "b"), (2, 3, "c")]
    assert doc[0]["reason"] == "bad card"
    assert "0:2\tc" in ok(jobs("group", "dead-letters", "jobs", "workers", "--payloads"))

    assert ok(jobs("group", "redrive", "jobs", "workers", "0:2")) == "redriven 1 dead letter\n"
    assert claims(ok(jobs("group", "poll", "jobs", "workers"))) == ["0:2:1"]
    failed(jobs("group", "redrive", "jobs", "workers", "0:2"), "not a dead letter")
    assert ok(jobs("group", "discard", "jobs", "workers", "0:0")) == "discarded 1 dead letter\n"
    assert jobs("group", "redrive", "jobs", "workers").exit_code == 2
    assert jobs("group", "redrive", "jobs", "workers", "0:1", "--all").exit_code == 2
    failed(jobs("group", "redrive", "jobs", "workers", "zero"), "malformed")

    assert json.loads(ok(jobs("group", "dead-letters", "jobs", "workers", "-o", "json")))[0]["offset"] == 1
    # run from a script (CliRunner's stdin is not a terminal) --all needs no --yes
    assert ok(jobs("group", "redrive", "jobs", "workers", "--all")) == "redriven 1 dead letter\n"
    assert ok(jobs("group", "dead-letters", "jobs", "workers")) == "no dead letters\n"
    assert ok(jobs("group", "discard", "jobs", "workers", "--all", "--yes")) == "discarded 0 dead letters\n"
    failed(jobs("group", "redrive", "jobs", "nope", "--all", "--yes"), "nope")
    failed(jobs("group", "redrive", "jobs", "nope", "--all"), "nope")


def test_group_keys(jobs: Run, backend: tuple[str, Any]) -> None:
    raw = backend[1]
    ok(jobs("pub", "jobs", "a"))
    ok(jobs("group", "poll", "jobs", "workers"))
    rows = json.loads(ok(jobs("group", "keys", "jobs", "workers", "-o", "json")))
    roles = {r["role"]: r["key"] for r in rows}
    assert {"meta", "log", "group", "lease", "dead"} <= set(roles)
    assert raw.type(roles["log"]) in (b"stream", "stream")
    assert raw.exists(roles["meta"]) and raw.exists(roles["lease"])
    assert all("{default/default/jobs/0}" in r["key"] for r in rows)
    assert ok(jobs("group", "keys", "jobs", "workers", "--role", "log")).strip() == roles["log"]
    assert "ROLE" in ok(jobs("group", "keys", "jobs", "workers"))
    failed(jobs("group", "keys", "jobs", "nope"), "nope")
    failed(jobs("group", "keys", "nope", "workers"), "nope")


# -- escaping


@pytest.mark.parametrize("payload", [b"", b"plain", b"\\n", b"a\tb", b"\xff\\\\x", b"end\\", "caf\u00e9".encode()])
def test_a_payload_without_a_control_character_is_printed_as_it_is(payload: bytes) -> None:
    assert escape_payload(payload) == payload


@pytest.mark.parametrize("payload", [b"a\nb", b"\t\r\n\\", b"\\n\n", b"x\r", b"\xff\n\\\\x", b"\xff\x00\\\\x",
                                     b"\x1b[0m\\x1b", "\u009b\\u009b".encode(), b"\x9b\\x9b"])
def test_a_payload_with_a_control_character_round_trips_on_one_line(payload: bytes) -> None:
    escaped = escape_payload(payload)
    assert b"\n" not in escaped and b"\t" not in escaped and b"\r" not in escaped
    assert unescape_payload(escaped) == payload


def test_group_describe_watch_refreshes(felixctl: Run) -> None:
    ok(felixctl("stream", "create", "jobs"))
    ok(felixctl("group", "create", "jobs", "workers"))
    out = ok(felixctl("group", "describe", "jobs", "workers", "--watch", "0.1", "--count", "3"))
    assert out.count("group workers, every 0.1 s") == 3
    assert out.count("LAG") == 3
    usage = felixctl("group", "describe", "jobs", "workers", "--watch", "-o", "json")
    assert usage.exit_code == 2 and "--watch" in usage.stderr


def test_several_claims_fail_in_one_error_line_and_bad_shards_change_nothing(felixctl: Run) -> None:
    """An unknown group, or (for nack, extend, dead-letter) a claim of a shard the stream
    lacks, fails before anything is done; claims that fail on their own are reported
    together in one line, after the others were settled. ack settles each claim on its
    own (CONTRACT): a shard the stream lacks is one more claim that failed."""
    ok(felixctl("stream", "create", "s2", "--shards", "2"))
    ok(felixctl("group", "create", "s2", "g"))
    for shard in (0, 0, 1):
        ok(felixctl("pub", "s2", "x", "--shard", str(shard)))
    polled = sorted(claims(ok(felixctl("group", "poll", "s2", "g", "--max", "5"))))
    assert polled == ["0:0:1", "0:1:1", "1:0:1"]

    failed(felixctl("group", "ack", "s2", "nope", "0:0:1", "1:0:1"), "nope")
    line = failed(felixctl("group", "nack", "s2", "g", "0:0:1", "2:0:1"), "shard 2 does not exist", "nothing")
    assert "2:0:1" in line
    describe = json.loads(ok(felixctl("group", "describe", "s2", "g", "-o", "json")))
    assert [s["in_flight"] for s in describe["shards"]] == [2, 1]  # nothing was acked nor nacked

    result = felixctl("group", "ack", "s2", "g", "0:0:1", "7:0:1", "1:5:1")
    assert result.stdout == "acked 0:0:1\n"
    line = failed(result, "2 of 3 failed", "7:0:1", "shard 7 does not exist", "1:5:1")
    assert len(result.stderr.strip().splitlines()) == 1

    result = felixctl("group", "nack", "s2", "g", "0:1:1", "0:1:9", "1:0:9")
    assert result.stdout == "nacked 0:1:1\n"
    line = failed(result, "2 of 3 failed", "0:1:9", "1:0:9")
    assert len(result.stderr.strip().splitlines()) == 1


def test_redrive_across_shards_reports_the_shard_that_refused(felixctl: Run) -> None:
    ok(felixctl("stream", "create", "s2", "--shards", "2"))
    ok(felixctl("group", "create", "s2", "g"))
    for shard in (0, 1):
        ok(felixctl("pub", "s2", "x", "--shard", str(shard)))
    ok(felixctl("group", "poll", "s2", "g", "--max", "5"))
    ok(felixctl("group", "dead-letter", "s2", "g", "0:0:1"))
    failed(felixctl("group", "redrive", "s2", "g", "0:0", "5:0"), "shard 5 does not exist")
    assert json.loads(ok(felixctl("group", "dead-letters", "s2", "g", "-o", "json")))[0]["offset"] == 0
    result = felixctl("group", "redrive", "s2", "g", "0:0", "1:0")
    assert result.stdout == "redriven 1 dead letter\n"
    failed(result, "1 of 2 failed", "shard 1", "not a dead letter")
    assert json.loads(ok(felixctl("group", "dead-letters", "s2", "g", "-o", "json"))) == []


def test_an_answer_waiting_on_stdin_decides(jobs: Run) -> None:
    """No terminal, but an answer piped in (echo n | felixctl ...): it decides."""
    ok(jobs("pub", "jobs", "a"))
    ok(jobs("group", "poll", "jobs", "workers"))
    ok(jobs("group", "dead-letter", "jobs", "workers", "0:0:1"))
    failed(jobs("group", "discard", "jobs", "workers", "--all", input="n\n"), "not confirmed", "'n'")
    assert len(json.loads(ok(jobs("group", "dead-letters", "jobs", "workers", "-o", "json")))) == 1
    assert ok(jobs("group", "discard", "jobs", "workers", "--all", input="yes\n")) == "discarded 1 dead letter\n"


def test_a_lost_connection_still_reports_the_claims_that_failed_before(
    jobs: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(3):
        ok(jobs("pub", "jobs", "x"))
    assert claims(ok(jobs("group", "poll", "jobs", "workers", "--max", "3"))) == ["0:0:1", "0:1:1", "0:2:1"]
    real = felix_redis.Client.group_nack

    def flaky(self: felix_redis.Client, *args: Any, **kwargs: Any) -> bool:
        if str(args[5]) == "0:2:1":
            raise felix_redis.ConnectionFailed("cannot reach Redis at redis://127.0.0.1:1/0: simulated")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(felix_redis.Client, "group_nack", flaky)
    result = jobs("group", "nack", "jobs", "workers", "0:0:1", "0:1:7", "0:2:1")
    assert result.stdout == "nacked 0:0:1\n"
    line = failed(result, "2 of 3 failed", "0:1:7", "0:2:1", "cannot reach Redis", "stopped there")
    assert len(result.stderr.strip().splitlines()) == 1, line
