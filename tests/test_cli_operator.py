"""What an operator meets, tried as a new user would (issue 25, "CLI and docs"): the
README's snippet, `--help` texts, exit statuses, what goes to stdout and stderr. Each
CLI check runs ``felixctl`` as a real process, as a person or a script would."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

import felix_redis

ROOT = Path(__file__).resolve().parent.parent


def _env(redis_url: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FELIX_")}
    if redis_url is not None:
        env["FELIX_REDIS_URL"] = redis_url
    return env


def felixctl(*args: str, redis_url: str | None = None, input: bytes | None = None,
             timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
    """One ``felixctl`` run, stdout and stderr pipes (not terminals)."""
    return subprocess.run([sys.executable, "-m", "felixctl", *args], input=input, capture_output=True,
                          timeout=timeout, env=_env(redis_url), cwd=ROOT)


def ok(result: subprocess.CompletedProcess[bytes]) -> str:
    assert result.returncode == 0, (result.stdout, result.stderr)
    return result.stdout.decode()


# -- README


def readme_snippet() -> str:
    """The README's Python snippet, as a reader copies it."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "the README has one Python snippet"
    return str(blocks[0])


def test_readme_snippet_runs_again_and_again(raw: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    """Run twice, as a reader trying it does: the second run finds the stream and group
    and still publishes and handles its job (no GroupExists, no NameError in handle)."""
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippet())
    for run in (1, 2):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                              env=_env(redis_url), cwd=tmp_path)
        assert done.returncode == 0, (run, done.stderr)
        assert "Traceback" not in done.stderr, (run, done.stderr)
        assert done.stdout.count("sending the receipt for") == 1, (run, done.stdout)
    with felix_redis.connect(redis_url) as client:
        info = client.group_describe("acme", "prod", "jobs", "workers")
    # both jobs handled and acked: nothing left, nothing nacked
    assert (info.lag, info.owed, info.in_flight, info.dead) == (0, 0, 0, 0)


# -- --help


def test_worker_and_metrics_help_say_their_defaults_once_and_have_examples() -> None:
    for command in ("worker", "metrics"):
        text = " ".join(ok(felixctl(command, "--help")).split())
        assert "[default: default]" not in text, command  # the default is said in the help itself
        assert "Tenant (default: felixctl's --tenant, else $FELIX_TENANT, else 'default')." in text
        assert "Examples:" in text, command
        assert re.search(rf"felixctl (--tenant \S+ )?{command}\b", text.split("Examples:")[1]), command


# -- metrics


def _metrics_run(redis_url: str, listen: str) -> tuple[str, str]:
    """``felixctl metrics --listen LISTEN`` until it has started, then SIGTERM: its stdout
    and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "felixctl", "metrics", "--listen", listen],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(redis_url), cwd=ROOT)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    return first + rest, err


def test_metrics_prints_its_address_once(raw: redis.Redis, redis_url: str) -> None:
    out, err = _metrics_run(redis_url, "127.0.0.1:0")
    assert re.fullmatch(r"127\.0\.0\.1:\d+\n", out), out
    assert err == ""  # no second copy of the address, no warning on loopback


def test_metrics_warns_when_it_listens_beyond_loopback(raw: redis.Redis, redis_url: str) -> None:
    out, err = _metrics_run(redis_url, ":0")
    assert re.fullmatch(r"0\.0\.0\.0:\d+\n", out), out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("felixctl: warning: serving metrics on every interface"), err
    assert "without authentication" in err and "--listen 127.0.0.1:" in err


def test_exposure_warning_only_beyond_loopback() -> None:
    from felixctl.worker_cmd import exposure_warning

    for host in ("127.0.0.1", "127.0.0.53", "::1"):
        assert exposure_warning(host, 9108, "--listen") is None, host
    for host in ("0.0.0.0", "::", "10.0.0.5", "192.168.1.2"):
        said = exposure_warning(host, 9108, "--metrics-listen")
        assert said is not None and "--metrics-listen 127.0.0.1:9108" in said, host


# -- stream kinds


def test_kind_help_says_what_the_kinds_do(raw: redis.Redis, redis_url: str) -> None:
    text = " ".join(ok(felixctl("stream", "create", "--help")).split())
    assert "read by subscribers too" not in text
    assert "Both are read through groups and by `felixctl sub`" in text
    # a queue is read by sub, as the help says
    ok(felixctl("stream", "create", "jobs", "--kind", "queue", redis_url=redis_url))
    ok(felixctl("pub", "jobs", "hello", redis_url=redis_url))
    assert ok(felixctl("sub", "jobs", redis_url=redis_url)) == "0:0\thello\n"
    # they differ in retention: a queue (safe) keeps what its group has not finished,
    # a stream trims to its limits all the same
    for kind in ("queue", "stream"):
        name = f"kept-{kind}"
        ok(felixctl("stream", "create", name, "--kind", kind, "--retention-max-len", "2", redis_url=redis_url))
        ok(felixctl("group", "create", name, "g", redis_url=redis_url))
        ok(felixctl("pub", name, "--file", "-", input=b"1\n2\n3\n4\n5\n", redis_url=redis_url))
        ok(felixctl("stream", "trim", name, redis_url=redis_url))
        described = json.loads(ok(felixctl("stream", "describe", name, "-o", "json", redis_url=redis_url)))
        assert described["shard_states"][0]["first"] == (0 if kind == "queue" else 3), (kind, described)


# -- pub --file


def test_pub_file_shows_progress_only_on_a_terminal(raw: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.txt"
    tasks.write_bytes(b"one\ntwo\nthree\n")
    ok(felixctl("stream", "create", "jobs", redis_url=redis_url))
    done = felixctl("pub", "jobs", "--file", str(tasks), redis_url=redis_url)
    assert ok(done) == "published 3 records in 1 atomic batch: shard 0 offsets 0..2\n"
    assert done.stderr == b""  # stderr is a pipe here: no "publishing FILE", no bar
    # and on a terminal, the bar is there
    primary, secondary = os.openpty()
    try:
        try:
            at_terminal = subprocess.run([sys.executable, "-m", "felixctl", "pub", "jobs", "--file", str(tasks)],
                                         stdout=subprocess.PIPE, stderr=secondary, timeout=30,
                                         env=_env(redis_url), cwd=ROOT)
        finally:
            os.close(secondary)
        shown = b""
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(primary)
    assert at_terminal.returncode == 0
    assert f"publishing {tasks}".encode() in shown


# -- Ctrl-C


def _interrupted(raw: redis.Redis, redis_url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``felixctl ARGS`` sent SIGINT (what Ctrl-C sends) once it waits in Redis."""
    proc = subprocess.Popen([sys.executable, "-m", "felixctl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(redis_url), cwd=ROOT)
    try:
        deadline = time.monotonic() + 20
        while int(raw.info("clients")["blocked_clients"]) < 1:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "felixctl never waited in Redis"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_exits_130_whichever_command_it_stops(raw: redis.Redis, redis_url: str) -> None:
    ok(felixctl("stream", "create", "jobs", redis_url=redis_url))
    ok(felixctl("group", "create", "jobs", "w", redis_url=redis_url))
    ok(felixctl("pub", "jobs", "hello", redis_url=redis_url))
    following = _interrupted(raw, redis_url, "sub", "jobs", "--follow")
    assert following.returncode == 130, following
    assert following.stdout == b"0:0\thello\n"  # what it printed before stays
    ok(felixctl("group", "poll", "jobs", "w", redis_url=redis_url))  # nothing due after this
    waiting = _interrupted(raw, redis_url, "group", "poll", "jobs", "w", "--wait-ms", "60000")
    assert (waiting.returncode, waiting.stdout) == (130, b""), waiting
    assert b"Aborted" not in waiting.stderr and b"Traceback" not in waiting.stderr, waiting.stderr


def test_the_exit_statuses_are_documented_with_130() -> None:
    rows = re.findall(r"^\| (\d+) \|", (ROOT / "docs" / "cli.md").read_text(), re.M)
    assert rows == ["0", "1", "2", "130"]
    text = " ".join(ok(felixctl("--help")).split())
    assert "130 when Ctrl-C interrupts a command" in text
