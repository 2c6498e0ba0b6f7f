"""Real worker processes (``felixctl worker``) against a real Redis: crashes, signals,
long jobs, retries and poison records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import felix_redis
from tests.support.worker_jobs import events

ROOT = Path(__file__).resolve().parent.parent
T, N, S, G = "acme", "prod", "jobs", "workers"


class Proc:
    """A worker subprocess whose stderr goes to a file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        self.pid = self.popen.pid

    def output(self) -> str:
        return self.log.read_text()

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {self.pid} did not exit in {timeout}s:\n{self.output()}") from None

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


@pytest.fixture
def spawn(redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """``spawn(*options, handler=...)`` starts a worker process; all are killed at the end."""
    procs: list[Proc] = []
    env = {**os.environ, "WORKER_JOBS_URL": redis_url, "PYTHONPATH": str(ROOT)}

    def start(*options: str, handler: str = "tests.support.worker_jobs:handle") -> Proc:
        args = [sys.executable, "-m", "felixctl.worker_cmd", "worker", "--redis-url", redis_url,
                "--tenant", T, "--namespace", N, "--poll-wait", "0.2", *options, S, G, handler]
        proc = Proc(args, env, tmp_path / f"worker-{len(procs)}.log")
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()


@pytest.fixture
def queue(redis_client: felix_redis.Client) -> Callable[..., felix_redis.Client]:
    """``queue(vt_ms, max_attempts)`` creates the stream and group; returns the client."""

    def make(vt_ms: int = 1000, max_attempts: int = 5, shards: int = 1) -> felix_redis.Client:
        redis_client.stream_create(T, N, S, shards=shards)
        redis_client.group_create(T, N, S, G, visibility_timeout_ms=vt_ms, max_attempts=max_attempts)
        return redis_client

    return make


def wait_until(check: Callable[[], Any], timeout: float, what: str, proc: Proc | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f"\n{proc.output()}" if proc else ""))


def test_sigkill_mid_job_is_redelivered_to_another_worker(
    queue: Callable[..., felix_redis.Client], spawn: Callable[..., Proc], raw: redis.Redis
) -> None:
    client = queue(vt_ms=1000)
    client.publish(T, N, S, '{"sleep_first": 60}')
    a = spawn()
    wait_until(lambda: events(raw, "start"), 10, "the first worker to start the job", a)
    b = spawn()
    a.signal(signal.SIGKILL)
    a.wait(5)
    done = wait_until(lambda: events(raw, "done"), 10, "the job to be redone", b)
    assert [(e["pid"], e["attempts"]) for e in done] == [(b.pid, 2)]
    wait_until(lambda: client.group_describe(T, N, S, G).lag == 0, 5, "lag 0", b)


def test_sigterm_hands_back_unfinished_jobs_and_loses_none(
    queue: Callable[..., felix_redis.Client], spawn: Callable[..., Proc], raw: redis.Redis
) -> None:
    client = queue(vt_ms=10_000)
    for i in range(8):
        client.publish(T, N, S, '{"sleep_first": 60}' if i % 2 else '{"sleep": 0.3}')
    w = spawn("--concurrency", "8", "--grace", "1.5")
    wait_until(lambda: len(events(raw, "start")) == 8, 10, "eight jobs to start", w)
    w.signal(signal.SIGTERM)
    assert w.wait(10) == 0
    out = w.output()
    assert out.count("outcome=handed_back") == 4, out
    assert sorted(e["offset"] for e in events(raw, "done")) == [0, 2, 4, 6]
    info = client.group_describe(T, N, S, G)
    # Offsets 1, 3, 5, 7 are owed again; the position waits at 1.
    assert (info.in_flight, info.owed, info.dead, info.lag) == (0, 4, 0, 7)
    # A second worker finishes what was handed back, at once (no lease to wait out).
    started = time.monotonic()
    assert spawn("--burst", "--concurrency", "4").wait(15) == 0
    assert time.monotonic() - started < 8
    assert sorted(e["offset"] for e in events(raw, "done")) == list(range(8))
    assert client.group_describe(T, N, S, G).lag == 0


def test_a_job_three_times_longer_than_the_visibility_timeout_is_not_redelivered(
    queue: Callable[..., felix_redis.Client], spawn: Callable[..., Proc], raw: redis.Redis
) -> None:
    client = queue(vt_ms=1000)
    client.publish(T, N, S, '{"sleep": 3.2}')
    a = spawn()
    wait_until(lambda: events(raw, "start"), 10, "the job to start", a)
    b = spawn()
    done = wait_until(lambda: events(raw, "done"), 10, "the long job to finish", a)
    assert [(e["pid"], e["attempts"]) for e in done] == [(a.pid, 1)]
    assert len(events(raw, "start")) == 1, "the record was redelivered while its worker lived"
    wait_until(lambda: client.group_describe(T, N, S, G).lag == 0, 5, "the ack", a)
    assert b.popen.poll() is None


def test_retries_follow_the_backoff_policy(
    queue: Callable[..., felix_redis.Client], spawn: Callable[..., Proc], raw: redis.Redis
) -> None:
    client = queue(vt_ms=5000, max_attempts=5)
    client.publish(T, N, S, '{"fail_times": 3}')
    w = spawn("--backoff-base", "0.3", "--backoff-factor", "2", "--backoff-max", "1.0", "--backoff-jitter", "0")
    done = wait_until(lambda: events(raw, "done"), 15, "the job to succeed", w)
    assert done[0]["attempts"] == 4
    errors = {e["attempts"]: e["t"] for e in events(raw, "error")}
    starts = {e["attempts"]: e["t"] for e in events(raw, "start")}
    for attempts, expected in ((1, 0.3), (2, 0.6), (3, 1.0)):
        gap = starts[attempts + 1] - errors[attempts]
        assert expected - 0.05 <= gap <= expected + 0.5, (attempts, gap)
    assert w.output().count("outcome=retried") == 3


def test_a_poison_job_ends_in_the_dead_letters_with_its_reason(
    queue: Callable[..., felix_redis.Client], spawn: Callable[..., Proc], raw: redis.Redis
) -> None:
    client = queue(vt_ms=5000, max_attempts=3)
    client.publish(T, N, S, '{"fatal": "bad card"}')
    client.publish(T, N, S, '{"always_fail": true}')
    client.publish(T, N, S, '{}')
    w = spawn("--backoff-base", "0.05", "--backoff-jitter", "0")
    wait_until(lambda: client.group_describe(T, N, S, G).lag == 0, 10, "every record finished", w)
    dead = {d.offset: d for d in client.group_dead_letters(T, N, S, 0, G)}
    assert dead[0].reason == "bad card" and dead[0].attempts == 1
    assert dead[1].attempts == 3
    assert dead[1].reason == "failed 3 of 3 attempts: ValueError: always fails (attempt 3)"
    assert set(dead) == {0, 1}
    info = client.group_describe(T, N, S, G)
    assert (info.lag, info.dead) == (0, 2)


def test_a_second_signal_exits_at_once_and_the_lease_lapses(
    queue: Callable[..., felix_redis.Client], spawn: Callable[..., Proc], raw: redis.Redis
) -> None:
    client = queue(vt_ms=1000)
    client.publish(T, N, S, '{"sleep_first": 60}')
    w = spawn("--grace", "60")
    wait_until(lambda: events(raw, "start"), 10, "the job to start", w)
    w.signal(signal.SIGTERM)
    time.sleep(0.3)
    w.signal(signal.SIGTERM)
    assert w.wait(3) == 128 + signal.SIGTERM
    assert client.group_describe(T, N, S, G).in_flight == 1
    records = wait_until(lambda: client.group_poll(T, N, S, 0, G, wait=0.5), 5, "the lease to lapse")
    assert records[0].attempts == 2


def test_a_restarted_worker_with_a_stable_name_reclaims_its_records_at_once(
    queue: Callable[..., felix_redis.Client], spawn: Callable[..., Proc], raw: redis.Redis
) -> None:
    client = queue(vt_ms=60_000)
    client.publish(T, N, S, '{"sleep_first": 60}')
    a = spawn("--consumer", "w1")
    wait_until(lambda: events(raw, "start"), 10, "the job to start", a)
    a.signal(signal.SIGKILL)
    a.wait(5)
    started = time.monotonic()
    b = spawn("--consumer", "w1")
    done = wait_until(lambda: events(raw, "done"), 10, "the reclaimed job", b)
    assert [(e["pid"], e["attempts"]) for e in done] == [(b.pid, 2)]
    assert time.monotonic() - started < 10  # far less than the 60 s lease
    wait_until(lambda: client.group_describe(T, N, S, G).lag == 0, 5, "the ack", b)


def test_async_worker_process_extends_leases_and_hands_back_on_sigterm(
    queue: Callable[..., felix_redis.Client], spawn: Callable[..., Proc], raw: redis.Redis
) -> None:
    client = queue(vt_ms=1000, shards=2)
    client.publish(T, N, S, '{"sleep": 2.5}', shard=0)
    client.publish(T, N, S, '{"sleep_first": 60}', shard=1)
    w = spawn("--concurrency", "2", "--grace", "0.5", handler="tests.support.worker_jobs:ahandle")
    done = wait_until(lambda: events(raw, "done"), 10, "the long job", w)
    assert [(e["shard"], e["attempts"]) for e in done] == [(0, 1)]
    assert len(events(raw, "start")) == 2
    w.signal(signal.SIGTERM)
    assert w.wait(10) == 0, w.output()
    assert "outcome=handed_back" in w.output()
    info = client.group_describe(T, N, S, G)
    assert (info.in_flight, info.owed, info.lag) == (0, 1, 1)
