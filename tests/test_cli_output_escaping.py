"""felixctl's text output cannot be steered by what it prints (issue 19, item 7 d).

Reasons, payloads, names and keys come from Redis, written by whoever may write
there. Text output escapes control characters (C0, DEL, C1, ESC) visibly: a reason
holding a line break or tab stays in its row of ``group dead-letters``, and no ESC
byte from a payload reaches the terminal through ``sub`` or ``group poll``. JSON
output gives the exact values.
"""

from __future__ import annotations

import json

import pytest
import redis
from click.testing import CliRunner, Result

import felix_redis
from felixctl.cli import cli
from felixctl.common import escape_payload, table, visible
from tests.support.payloads import unescape_payload

T, N, S, G = "acme", "prod", "jobs", "workers"
FORGED = "bad card\n0:99   1  2026-01-01T00:00:00+00:00  all fine\tok"
ESC_PAYLOAD = b"\x1b[2J\x1b]0;owned\x07red \x1b[31mtext\x1b[0m"


@pytest.fixture
def run(raw: redis.Redis, redis_url: str) -> object:
    def invoke(*args: str) -> Result:
        result = CliRunner().invoke(cli, ["--redis-url", redis_url, "--tenant", T, "--namespace", N, *args])
        assert result.exit_code == 0, (args, result.output, result.exception)
        return result

    invoke("stream", "create", S, "--shards", "1")
    invoke("group", "create", S, G)
    return invoke


def test_a_reason_cannot_forge_dead_letter_rows(run: object) -> None:
    run("pub", S, "payload")  # type: ignore[operator]
    run("group", "poll", S, G)  # type: ignore[operator]
    run("group", "dead-letter", S, G, "0:0:1", "--reason", FORGED)  # type: ignore[operator]
    out = run("group", "dead-letters", S, G).stdout  # type: ignore[operator]
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("RECORD"), out  # the header and one row
    assert "\t" not in out
    assert lines[1].startswith("0:0 ") and lines[1].endswith(visible(FORGED)), out
    assert "bad card\\n0:99" in lines[1] and "all fine\\tok" in lines[1]
    with_payloads = run("group", "dead-letters", S, G, "--payloads").stdout  # type: ignore[operator]
    assert with_payloads.splitlines()[:2] == lines and with_payloads.splitlines()[2] == "0:0\tpayload"
    docs = json.loads(run("group", "dead-letters", S, G, "-o", "json").stdout)  # type: ignore[operator]
    assert [d["reason"] for d in docs] == [FORGED]


def test_no_escape_byte_reaches_the_terminal(run: object, redis_url: str) -> None:
    payloads = [ESC_PAYLOAD, "\u009b2J".encode(), b"raw C1 \x9b byte", b"nul\x00 del\x7f"]  # C1 CSI in UTF-8, alone
    with felix_redis.connect(redis_url) as client:
        for payload in payloads:
            client.publish(T, N, S, payload)
    controls = [bytes((b,)) for b in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if b not in (0x09, 0x0A)]
    for args in (("sub", S), ("group", "poll", S, G, "--max", "10")):
        out = run(*args).stdout_bytes  # type: ignore[operator]
        lines = out.rstrip(b"\n").split(b"\n")
        assert len(lines) == len(payloads), out
        assert [c for c in controls if c in out] == [] and b"\xc2\x9b" not in out, out
        assert [unescape_payload(line.split(b"\t", 1)[1]) for line in lines] == payloads
    docs = json.loads(run("sub", S, "-o", "json").stdout)  # type: ignore[operator]
    assert docs[0]["payload"] == ESC_PAYLOAD.decode()


@pytest.mark.parametrize("payload, shown", [
    (b"\x1b[31mred", b"\\x1b[31mred"),
    (b"tab\tonly", b"tab\tonly"),  # a tab alone: printed as it is (the line splits at its first tab)
    (b"tab\tand\x00nul", b"tab\\tand\\x00nul"),
    ("csi \u009b".encode(), b"csi \\u009b"),
    (b"byte \x9b \xff", b"byte \\x9b \xff"),
    (b"del\x7f \\x41", b"del\\x7f \\\\x41"),
    ("caf\u00e9 \u2603".encode(), "caf\u00e9 \u2603".encode()),
])
def test_escape_payload(payload: bytes, shown: bytes) -> None:
    assert escape_payload(payload) == shown
    if shown != payload:
        assert unescape_payload(shown) == payload


def test_tables_and_names_are_visible() -> None:
    assert visible("ok name") == "ok name"
    assert visible("a\tb\nc\x1b[0m\u009b\u202e") == "a\\tb\\nc\\x1b[0m\\x9b\\u202e"
    text = table(["NAME", "REASON"], [["x\ty", "line\nbreak"]])
    assert text.splitlines() == ["NAME  REASON", "x\\ty  line\\nbreak"]
