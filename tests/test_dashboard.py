"""The web dashboard (docs/dashboard.md) over HTTP against a real Redis: the JSON API
of the contract, the server-rendered pages, the security rules, ACL roles, errors in
place. The browser test is tests/test_dashboard_browser.py."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from click.testing import CliRunner

import felix_redis
from felix_redis import acl
from felix_redis.dashboard import check_bind
from felix_redis.errors import InvalidArgument
from felix_redis.testing.server import RedisServer, free_port
from felixctl.cli import cli
from tests.conftest import dump_keyspace
from tests.support.dashboard import serving

T, N, S, G = "acme", "prod", "jobs", "workers"
A = (T, N, S)
API = f"/api/streams/{T}/{N}/{S}"
TOKEN = "t0k-" + "x" * 28
PW = "dash-pw-1"
_users = itertools.count()


@pytest.fixture
def filled(raw: redis.Redis, redis_url: str) -> Iterator[felix_redis.Client]:
    """acme/prod/jobs (2 shards, group workers with 2 dead letters, one with a hostile
    payload and reason, one binary), acme/prod/other (1 shard, group audit)."""
    c = felix_redis.connect(redis_url)
    c.stream_create(*A, shards=2)
    c.group_create(*A, G)
    c.publish(*A, b"<script>alert(1)</script>", shard=0, headers={"trace": "<i>x</i>"})
    c.publish(*A, b"\xff\xfe\x00binary", shard=0)
    c.publish(*A, b"plain", shard=0)
    for i in range(3):
        c.publish(*A, f"s1-{i}".encode(), shard=1)
    got = c.group_poll(*A, 0, G, max_records=2)
    c.group_dead_letter(*A, 0, G, got[0].claim, reason="<b>bad</b> input")
    c.group_dead_letter(*A, 0, G, got[1].claim, reason="timeout")
    c.stream_create(T, N, "other")
    c.group_create(T, N, "other", "audit")
    yield c
    c.close()


def get(base: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.get(base + path, timeout=10, **kw)


def post(base: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    return httpx.post(base + path, timeout=10, **({"json": body} if body is not None else {}), **kw)


# -- the JSON API


def test_api_lists_streams_describes_them_and_their_groups(filled: felix_redis.Client, redis_url: str) -> None:
    with serving(redis_url) as base:
        r = get(base, "/api/streams")
        assert r.status_code == 200
        rows = {(d["tenant"], d["namespace"], d["stream"]): d for d in r.json()}
        assert set(rows) == {A, (T, N, "other")}
        assert rows[A]["kind"] == "queue" and rows[A]["shards"] == 2
        assert rows[(T, N, "other")]["shards"] == 1

        doc = get(base, API).json()
        assert doc["groups"] == [G] and doc["shards"] == 2
        assert [s["tail"] for s in doc["shard_states"]] == [3, 3]

        # the group, exactly as felixctl group describe -o json prints it
        doc = get(base, f"{API}/groups/{G}").json()
        printed = CliRunner().invoke(cli, ["--redis-url", redis_url, "--tenant", T, "--namespace", N,
                                           "group", "describe", S, G, "-o", "json"])
        want = json.loads(printed.output)
        for d in (doc, want):
            for shard in d["shards"]:
                shard.pop("oldest_unfinished_age_ms")
            d.pop("oldest_unfinished_age_ms")
        assert doc == want
        assert doc["dead"] == 2 and doc["pending"] == 4 and doc["lag"] == 4


def test_api_dead_letters_with_escaped_previews(filled: felix_redis.Client, redis_url: str) -> None:
    with serving(redis_url) as base:
        letters = get(base, f"{API}/groups/{G}/dead-letters").json()
        by = {d["record"]: d for d in letters}
        assert set(by) == {"0:0", "0:1"}
        assert by["0:0"]["reason"] == "<b>bad</b> input" and by["0:0"]["attempts"] == 1
        assert by["0:0"]["payload_preview"] == "<script>alert(1)</script>" and not by["0:0"]["payload_hex"]
        assert by["0:0"]["headers"] == {"trace": "<i>x</i>"}
        assert by["0:1"]["payload_hex"] and by["0:1"]["payload_preview"] == b"\xff\xfe\x00binary".hex(" ")
        filtered = get(base, f"{API}/groups/{G}/dead-letters", params={"reason": "time"}).json()
        assert [d["record"] for d in filtered] == ["0:1"]


def test_api_redrive_and_discard(filled: felix_redis.Client, redis_url: str) -> None:
    with serving(redis_url) as base:
        r = post(base, f"{API}/groups/{G}/redrive", {"records": ["0:0"]})
        assert r.status_code == 200 and r.json() == {"redriven": 1}
        assert [d.offset for d in filled.group_dead_letters(*A, 0, G)] == [1]
        # redriven: owed again, handed out again with attempts starting over
        again = filled.group_poll(*A, 0, G, max_records=5)
        assert (0, 1) in [(x.offset, x.attempts) for x in again]
        r = post(base, f"{API}/groups/{G}/discard", {"all": True})
        assert r.status_code == 200 and r.json() == {"discarded": 1}
        assert filled.group_describe(*A, G).dead == 0
        # a record that is no dead letter: refused, JSON error
        r = post(base, f"{API}/groups/{G}/redrive", {"records": ["0:2"]})
        assert r.status_code == 404 and "record 2 is not a dead letter" in r.json()["error"]


@pytest.mark.parametrize(("body", "why"), [
    ({}, "either"),
    ({"records": ["0:0"], "all": True}, "either"),
    ({"all": False}, "must be true"),
    ({"all": "yes"}, "must be true"),
    ({"records": []}, "non-empty"),
    ({"records": "0:0"}, "non-empty"),
    ({"records": ["0:x"]}, "malformed claim"),
    ({"records": [7]}, "must be a string"),
    ({"records": ["0:0"], "extra": 1}, "must be"),
    ([1, 2], "must be"),
])
def test_api_bad_bodies_are_refused_and_change_nothing(
    filled: felix_redis.Client, raw: redis.Redis, redis_url: str, body: Any, why: str,
) -> None:
    before = dump_keyspace(raw)
    with serving(redis_url) as base:
        for verb in ("redrive", "discard"):
            r = post(base, f"{API}/groups/{G}/{verb}", body)
            assert r.status_code == 400, r.text
            assert why in r.json()["error"]
    assert dump_keyspace(raw) == before


def test_api_refuses_what_is_not_json(filled: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    before = dump_keyspace(raw)
    with serving(redis_url) as base:
        path = f"{API}/groups/{G}/redrive"
        # a form post (what a foreign page can forge) and a JSON text sent as text/plain
        r = httpx.post(base + path, data={"all": "true"}, timeout=10)
        assert r.status_code == 400 and "application/json" in r.json()["error"]
        r = httpx.post(base + path, content=b'{"all": true}', headers={"Content-Type": "text/plain"}, timeout=10)
        assert r.status_code == 400
        r = httpx.post(base + path, content=b"{all", headers={"Content-Type": "application/json"}, timeout=10)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
        # a cross-origin request, even well formed
        r = post(base, path, {"all": True}, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403
        # GET on an action
        assert get(base, path).status_code == 405
    assert dump_keyspace(raw) == before


def test_hostile_input_gets_400_never_a_500(filled: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    filled.publish_keyed(*A, b"\xff\xfe-bin-key", b"keyed")  # a key that is not UTF-8
    before = dump_keyspace(raw)
    with serving(redis_url) as base:
        for path in (f"/streams/{T}/{N}/{S}/records", f"{API}/records"):
            for shard in range(2):
                r = get(base, path, params={"shard": str(shard)})
                assert r.status_code == 200, (path, shard, r.text[:200])
            for bad in ("\u00b2", "\u0661", "-1", "1.5", "x", "9" * 30):
                assert get(base, path, params={"shard": bad}).status_code == 400, (path, bad)
                assert get(base, path, params={"from": bad}).status_code == 400, (path, bad)
        shown = get(base, f"{API}/records", params={"shard": "0"}).text + get(
            base, f"{API}/records", params={"shard": "1"}).text
        assert "\\udcff\\udcfe-bin-key" in shown
        action = f"{API}/groups/{G}/redrive"
        r = httpx.post(base + action, content=b"[" * 100_000, headers={"Content-Type": "application/json"},
                       timeout=10)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
        big = b'{"records": ["' + b"0" * (2 << 20) + b'"]}'
        r = httpx.post(base + action, content=big, headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400 and "larger than" in r.json()["error"]
        r = get(base, "/api/nothing/here")
        assert r.status_code == 404 and r.json() == {"error": "no such endpoint"}
        r = httpx.delete(base + action, timeout=10)
        assert r.status_code == 405 and "not allowed" in r.json()["error"]
        assert get(base, "/no/such/page").status_code == 404
    assert dump_keyspace(raw) == before


def test_api_unknown_names_are_404_json(filled: felix_redis.Client, redis_url: str) -> None:
    with serving(redis_url) as base:
        for path in (f"/api/streams/{T}/{N}/nope", f"{API}/groups/nope", f"{API}/groups/nope/dead-letters",
                     f"/api/streams/{T}/{N}/bad%20name"):
            r = get(base, path)
            assert r.status_code == 404, path
            assert r.json()["error"]
        r = post(base, f"{API}/groups/nope/redrive", {"all": True})
        assert r.status_code == 404 and "nope" in r.json()["error"]
        r = post(base, f"{API}/groups/{G}/redrive", {"records": ["7:0"]})
        assert r.status_code == 404 and "shard 7" in r.json()["error"]


# -- pages


def test_pages_render_everything_from_redis_escaped(filled: felix_redis.Client, redis_url: str) -> None:
    filled.group_poll_as(*A, 1, G, "alice-1", max_records=2)
    with serving(redis_url) as base:
        pages = {p: get(base, p) for p in (
            "/", f"/streams/{T}/{N}/{S}", f"/streams/{T}/{N}/{S}/groups/{G}",
            f"/streams/{T}/{N}/{S}/groups/{G}/dead-letters", f"/streams/{T}/{N}/{S}/records?shard=0")}
        for path, r in pages.items():
            assert r.status_code == 200, path
            assert "<script>alert" not in r.text and "<b>bad" not in r.text and "<i>x" not in r.text, path
            assert r.headers["content-security-policy"].startswith("default-src 'self'")
        dead = pages[f"/streams/{T}/{N}/{S}/groups/{G}/dead-letters"].text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dead
        assert "&lt;b&gt;bad&lt;/b&gt; input" in dead
        assert "ff fe 00 62" in dead and "binary, shown as hex" in dead
        assert 'data-verb="redrive"' in dead  # the default user manages every group
        group = pages[f"/streams/{T}/{N}/{S}/groups/{G}"].text
        assert re.search(r'id="dead"><a [^>]*>2</a>', group)
        assert "alice-1" in group and "1:0 1:1" in group  # the named consumer and its leases
        records = pages[f"/streams/{T}/{N}/{S}/records?shard=0"].text
        assert "trace: &lt;i&gt;x&lt;/i&gt;" in records
        overview = pages["/"].text
        assert f'data-group="{T}/{N}/{S}/{G}"' in overview and f'data-group="{T}/{N}/other/audit"' in overview
        # worst first: the group with the unfinished records leads
        assert overview.index(f'data-group="{T}/{N}/{S}/{G}"') < overview.index(f'data-group="{T}/{N}/other/audit"')


def test_overview_flags_ages_past_the_threshold(filled: felix_redis.Client, redis_url: str) -> None:
    time.sleep(1.2)  # the oldest unfinished record is over a second old
    with serving(redis_url) as base:
        flagged = get(base, "/", params={"warn": "1"}).text
        assert re.search(rf'<tr data-group="{T}/{N}/{S}/{G}" class="warn">', flagged)
        calm = get(base, "/", params={"warn": "3600"}).text
        assert f'data-group="{T}/{N}/{S}/{G}">' in calm and 'class="warn"' not in calm
        assert get(base, "/", params={"warn": "-1"}).status_code == 400
        assert get(base, "/", params={"warn": "nan"}).status_code == 400


def test_live_updates_serve_the_fragment_and_new_numbers(filled: felix_redis.Client, redis_url: str) -> None:
    with serving(redis_url, interval=1) as base:
        path = f"/streams/{T}/{N}/{S}/groups/{G}"
        whole = get(base, path).text
        part = get(base, path, headers={"X-Felix-Fragment": "1"}).text
        assert whole.startswith("<!doctype html>") and "<html" not in part and 'id="totals"' in part
        got = filled.group_poll(*A, 1, G, max_records=1)
        filled.group_dead_letter(*A, 1, G, got[0].claim, reason="later")
        assert re.search(r'id="dead"><a [^>]*>3</a>', get(base, path, headers={"X-Felix-Fragment": "1"}).text)
        # the overview shows it within a sampling interval
        deadline = time.monotonic() + 5
        while '<a href="/streams/acme/prod/jobs/groups/workers/dead-letters">3</a>' not in get(base, "/").text:
            assert time.monotonic() < deadline, "the overview never showed the new dead letter"
            time.sleep(0.2)


def test_charts_show_the_sampled_history(filled: felix_redis.Client, redis_url: str) -> None:
    with serving(redis_url, interval=1) as base:
        time.sleep(2.5)  # the sampler runs every second
        page = get(base, f"/streams/{T}/{N}/{S}/groups/{G}").text
        lines = re.findall(r'<polyline points="([^"]+)"', page)
        assert len(lines) == 5
        assert all(len(points.split()) >= 2 for points in lines)
        assert "keeps an hour in its memory" in page


# -- security


def test_non_loopback_needs_a_token() -> None:
    with pytest.raises(InvalidArgument, match="--token"):
        check_bind("0.0.0.0", None)
    with pytest.raises(InvalidArgument, match="--token"):
        check_bind("192.0.2.1", None)
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("0.0.0.0", TOKEN)
    for bad in ("", "two words", "t\u00f6ken"):
        with pytest.raises(InvalidArgument, match="printable ASCII"):
            check_bind("127.0.0.1", bad)
    r = CliRunner().invoke(cli, ["dashboard", "--host", "0.0.0.0", "--port", str(free_port())])
    assert r.exit_code == 2 and "--token" in r.output


def test_token_guards_every_request(filled: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    before_dead = filled.group_describe(*A, G).dead
    with serving(redis_url, token=TOKEN) as base:
        for path in ("/api/streams", API, f"{API}/groups/{G}", f"{API}/groups/{G}/dead-letters"):
            r = get(base, path)
            assert r.status_code == 403 and "token" in r.json()["error"]
            assert get(base, path, headers={"Authorization": "Bearer wrong"}).status_code == 403
            assert get(base, path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        # pages send the browser to the sign-in form
        r = get(base, f"/streams/{T}/{N}/{S}")
        assert r.status_code == 303 and r.headers["location"].startswith("/login?next=")
        for verb in ("redrive", "discard"):
            assert post(base, f"{API}/groups/{G}/{verb}", {"all": True}).status_code == 403
        assert filled.group_describe(*A, G).dead == before_dead
        # the sign-in form sets a session cookie that is not the token
        bad = httpx.post(base + "/login", data={"token": "nope", "next": "/"}, timeout=10)
        assert bad.status_code == 403 and "set-cookie" not in bad.headers
        huge = httpx.post(base + "/login", content=b"token=" + b"x" * (4 << 20), timeout=30,
                          headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert huge.status_code == 400 and "set-cookie" not in huge.headers
        with httpx.Client(base_url=base, timeout=10) as browser:
            r = browser.post("/login", data={"token": TOKEN, "next": f"/streams/{T}/{N}/{S}"})
            assert r.status_code == 303 and r.headers["location"] == f"/streams/{T}/{N}/{S}"
            cookie = r.headers["set-cookie"]
            assert TOKEN not in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict",
                                                                                                       "strict")
            page = browser.get(f"/streams/{T}/{N}/{S}/groups/{G}/dead-letters")
            assert page.status_code == 200 and TOKEN not in page.text
            r = browser.post(f"{API}/groups/{G}/redrive", json={"records": ["0:0"]})
            assert r.status_code == 200 and r.json() == {"redriven": 1}
        # an open redirect is not possible through next=
        r = httpx.post(base + "/login", data={"token": TOKEN, "next": "//evil.example/"}, timeout=10)
        assert r.headers["location"] == "/"


def test_without_a_token_only_loopback_host_names_are_answered(filled: felix_redis.Client, redis_url: str) -> None:
    with serving(redis_url) as base:
        assert get(base, "/api/streams").status_code == 200
        assert get(base, "/api/streams", headers={"Host": "localhost"}).status_code == 200
        # DNS rebinding: a foreign name pointed at 127.0.0.1
        r = get(base, "/api/streams", headers={"Host": "evil.example:8421"})
        assert r.status_code == 403
        assert post(base, f"{API}/groups/{G}/discard", {"all": True},
                    headers={"Host": "evil.example"}).status_code == 403
    assert filled.group_describe(*A, G).dead == 2


def test_read_only_refuses_actions_and_hides_the_buttons(
    filled: felix_redis.Client, raw: redis.Redis, redis_url: str,
) -> None:
    before = dump_keyspace(raw)
    with serving(redis_url, read_only=True) as base:
        for verb in ("redrive", "discard"):
            r = post(base, f"{API}/groups/{G}/{verb}", {"all": True})
            assert r.status_code == 403 and "read-only" in r.json()["error"]
            # every POST, whatever it names
            r = post(base, f"{API}/groups/no%20such/{verb}", {"all": True})
            assert r.status_code == 403 and "read-only" in r.json()["error"]
        page = get(base, f"/streams/{T}/{N}/{S}/groups/{G}/dead-letters").text
        assert "data-verb" not in page and "Read-only dashboard" in page
    after = dump_keyspace(raw)
    assert {k: v for k, v in after.items() if b":wake" not in k} == \
        {k: v for k, v in before.items() if b":wake" not in k}


@pytest.fixture
def consume_only(raw: redis.Redis, redis_url: str) -> Iterator[str]:
    """The URL of a Redis user made the documented way with group.consume on workers."""
    user = f"dashuser{os.getpid()}x{next(_users)}"
    acl.grant(raw, acl.setuser_args(user, acl.rules("group.consume", T, N, S, G), password=PW))
    yield redis_url.replace("redis://", f"redis://{user}:{PW}@", 1)
    raw.execute_command("ACL", "DELUSER", user)


def test_a_consume_only_user_sees_no_redrive_and_cannot_act(
    filled: felix_redis.Client, raw: redis.Redis, consume_only: str,
) -> None:
    with serving(consume_only, streams=[A]) as base:
        # it may read what its role reads
        assert get(base, f"{API}/groups/{G}").json()["dead"] == 2
        page = get(base, f"/streams/{T}/{N}/{S}/groups/{G}/dead-letters")
        assert page.status_code == 200 and "0:0" in page.text
        assert "data-verb" not in page.text and "lacks the group.manage role" in page.text
        # and Redis refuses what the page does not offer
        for verb in ("redrive", "discard"):
            r = post(base, f"{API}/groups/{G}/{verb}", {"all": True})
            assert r.status_code == 403 and "group.manage" in r.json()["error"]
            r = post(base, f"{API}/groups/{G}/{verb}", {"records": ["0:0"]})
            assert r.status_code == 403
        assert PW not in page.text and PW not in r.text
        # a page of a stream the user may not read: refused, and nothing else breaks
        filled.stream_create(T, N, "secret")
        assert get(base, f"/streams/{T}/{N}/secret").status_code == 403
        assert get(base, f"/api/streams/{T}/{N}/secret").status_code == 403
        assert get(base, f"{API}/groups/{G}").status_code == 200
        assert get(base, f"/streams/{T}/{N}/{S}/groups/{G}/dead-letters").status_code == 200
    assert filled.group_describe(*A, G).dead == 2


def test_a_manager_gets_the_buttons(filled: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    user = f"dashmgr{os.getpid()}x{next(_users)}"
    acl.grant(raw, acl.setuser_args(user, acl.rules("group.manage", T, N, S, G), password=PW))
    try:
        with serving(redis_url.replace("redis://", f"redis://{user}:{PW}@", 1), streams=[A]) as base:
            page = get(base, f"/streams/{T}/{N}/{S}/groups/{G}/dead-letters").text
            assert 'data-verb="redrive"' in page
            assert post(base, f"{API}/groups/{G}/redrive", {"records": ["0:1"]}).json() == {"redriven": 1}
    finally:
        raw.execute_command("ACL", "DELUSER", user)
    assert [d.offset for d in filled.group_dead_letters(*A, 0, G)] == [0]


# -- errors in place


def test_a_stream_deleted_while_shown(filled: felix_redis.Client, redis_url: str) -> None:
    with serving(redis_url) as base:
        path = f"/streams/{T}/{N}/{S}/groups/{G}"
        assert get(base, path).status_code == 200
        filled.stream_delete(*A)
        r = get(base, path, headers={"X-Felix-Fragment": "1"})
        assert r.status_code == 404 and "does not exist" in r.text and 'role="alert"' in r.text
        assert get(base, f"{API}/groups/{G}").status_code == 404
        assert [d["stream"] for d in get(base, "/api/streams").json()] == ["other"]


def test_redis_down_is_said_in_place_and_the_dashboard_recovers() -> None:
    with RedisServer(persistence=True) as server:
        c = felix_redis.connect(server.url)
        c.stream_create(*A)
        c.group_create(*A, G)
        c.close()
        with serving(server.url + "?socket_timeout=1&socket_connect_timeout=1", interval=1) as base:
            assert get(base, f"{API}/groups/{G}").status_code == 200
            server.stop(cleanup=False)  # Redis goes away under the running dashboard
            r = get(base, f"{API}/groups/{G}")
            assert r.status_code == 503 and "error" in r.json()
            assert get(base, "/healthz").status_code == 503
            page = get(base, f"/streams/{T}/{N}/{S}/groups/{G}")
            assert page.status_code == 503 and "Redis is unreachable" in page.text
            overview = get(base, "/")
            assert overview.status_code == 200 and "Cannot list the streams" in overview.text
            assert server.url.split("//")[1].split("/")[0] not in page.text or "password" not in page.text
            server.start()  # it comes back: the same dashboard answers again
            deadline = time.monotonic() + 20
            while get(base, f"{API}/groups/{G}").status_code != 200:
                assert time.monotonic() < deadline, "the dashboard did not recover when Redis did"
                time.sleep(0.2)
            assert get(base, f"/streams/{T}/{N}/{S}/groups/{G}").status_code == 200


def test_felixctl_dashboard_serves_until_sigterm(filled: felix_redis.Client, redis_url: str) -> None:
    port = free_port()
    env = {**os.environ, "FELIX_REDIS_URL": redis_url, "FELIX_DASHBOARD_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "felixctl", "dashboard", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/streams", timeout=2,
                              headers={"Authorization": f"Bearer {TOKEN}"})
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "felixctl dashboard did not start"
                time.sleep(0.1)
        assert r.status_code == 200 and {d["stream"] for d in r.json()} == {"jobs", "other"}
        assert httpx.get(f"http://127.0.0.1:{port}/api/streams", timeout=2).status_code == 403
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert TOKEN.encode() not in out + err and b"token required" in err


def test_slow_sweeps_stretch_the_sampling_interval(redis_url: str) -> None:
    """Sampling keeps to a tenth of the time: a sweep that takes 0.3 s with a 1 s
    interval is followed by 2.7 s of waiting, not 0.7 s."""
    import asyncio

    import felix_redis.asyncio as felix_async
    from felix_redis.dashboard.board import Board, Snapshot

    async def run() -> list[float]:
        client = felix_async.connect(redis_url)
        board = Board(client, interval=1.0)
        starts: list[float] = []

        async def slow_sweep() -> Snapshot:
            starts.append(time.monotonic())
            await asyncio.sleep(0.3)
            board.snapshot = Snapshot(time.time(), [])
            return board.snapshot
        board.sweep = slow_sweep  # type: ignore[method-assign]
        sampler = asyncio.ensure_future(board.sample_forever())
        await asyncio.sleep(3.9)
        sampler.cancel()
        await client.close()
        return starts

    starts = asyncio.run(run())
    assert len(starts) == 2, starts
    assert 2.9 <= starts[1] - starts[0] < 3.5


def test_a_tenant_admin_sees_its_tenants_streams(filled: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    """A stream.admin user may read its tenant's registry, not the list of tenants: the
    dashboard lists the tenant it was given (felixctl's --tenant)."""
    filled.stream_create("beta", N, "theirs")
    user = f"dashadmin{os.getpid()}x{next(_users)}"
    for i, stream in enumerate((S, "other")):
        acl.grant(raw, acl.setuser_args(user, acl.rules("stream.admin", T, N, stream),
                                        password=PW if i == 0 else None))
    try:
        url = redis_url.replace("redis://", f"redis://{user}:{PW}@", 1)
        with serving(url, tenant=T) as base:
            listed = get(base, "/api/streams").json()
            assert sorted(d["stream"] for d in listed) == ["jobs", "other"]
            assert "theirs" not in get(base, "/").text
        with serving(url, tenant="beta") as base:  # a tenant it holds nothing in
            r = get(base, "/api/streams")
            assert r.status_code == 403 and "error" in r.json()
            page = get(base, "/")
            assert page.status_code == 200 and "Cannot list the streams" in page.text
    finally:
        raw.execute_command("ACL", "DELUSER", user)
