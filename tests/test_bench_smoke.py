"""The benchmark harness runs end to end in smoke mode, so it never rots.

Tiny numbers, one round, no timing assertions: only that every system is reported
(measured, or unavailable with a reason), and that measured numbers are positive.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from shutil import which as shutil_which

import pytest
import redis

import felix_redis
from felix_redis.testing.server import RedisServer, redis_server_binary

ROOT = Path(__file__).resolve().parent.parent
FELIX = ["felix", "felix-async", "felix-sharded", "felix-readme", "felix-readme-plain", "felix-worker",
         "felix-async-worker", "felix-worker-prefetch", "felix-async-worker-prefetch"]
# Peers run only when their package is importable here (the test venv has none).
PEERS = {
    "dramatiq": "dramatiq",
    "taskiq": "taskiq_redis",
    "bullmq": "bullmq",
    "saq": "saq",
    "arq": "arq",
    "rq": "rq",
    "celery": "celery",
    "streaq": "streaq",
}

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server")


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    systems = ["raw", *FELIX] + [name for name, mod in PEERS.items() if _importable(mod)]
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "--smoke",
        "--systems",
        ",".join(systems),
        "--out",
        str(out),
        "--chart",
        "none",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data: dict[str, object] = json.loads(out.read_text())
    data["_stdout"] = proc.stdout
    data["_systems"] = systems
    return data


def test_json_structure(smoke: dict[str, object]) -> None:
    meta = smoke["meta"]
    assert isinstance(meta, dict)
    assert meta["jobs"] == 200 and meta["repeat"] == 1
    assert {"nproc", "redis", "python", "cpu"} <= set(meta["machine"])
    assert meta["command"].startswith("python -m bench")
    rows = smoke["results"]
    assert isinstance(rows, list)
    reported = {row["system"] for row in rows}
    assert reported == set(smoke["_systems"])  # type: ignore[arg-type]
    for row in rows:
        assert row["status"] in {"ok", "failed", "unavailable"}
        assert {"system", "scenario", "kind", "status", "reason"} <= set(row)
        if row["status"] != "ok":
            assert row["reason"], row


def test_floor_measured(smoke: dict[str, object]) -> None:
    rows = [r for r in smoke["results"] if r["system"] == "raw"]  # type: ignore[union-attr]
    by_name = {r["scenario"]: r for r in rows}
    assert set(by_name) == {"enqueue", "enqueue-pipelined", "drain-1p", "drain-2p", "latency"}
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ratio"] == 1.0
        if row["kind"] == "latency":
            assert row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"]
            assert row["samples"] > 0
        else:
            assert row["rate"] > 0 and row["seconds"] > 0 and row["jobs"] == 200
            assert len(row["runs"]) == 1


def test_felix_publish_variants_measured(smoke: dict[str, object]) -> None:
    """The client's default publish (producer sequence), the plain one without producer
    state, the idempotent producer and batches: each its own row, each measured."""
    rows = {r["scenario"]: r for r in smoke["results"] if r["system"] == "felix"}  # type: ignore[union-attr]
    for scenario in ("enqueue", "enqueue-plain", "enqueue-idempotent", "enqueue-batch"):
        row = rows[scenario]
        assert row["status"] == "ok", row
        assert row["rate"] > 0 and row["jobs"] == 200, row


def test_paired_enqueue_takes_its_ratio_from_its_own_xadds(smoke: dict[str, object]) -> None:
    """enqueue-paired times publish and XADD in alternating slices in one process; its
    ratio is against the XADDs of those slices, not the raw system's enqueue row."""
    rows = [r for r in smoke["results"]  # type: ignore[union-attr]
            if r["system"] in ("felix", "felix-async") and r["scenario"] == "enqueue-paired"]
    assert sorted(row["system"] for row in rows) == ["felix", "felix-async"]  # (asyncio: against redis.asyncio)
    for row in rows:
        assert row["status"] == "ok", row
        assert row["jobs"] == 500 and row["rate"] > 0 and row["paired_floor_rate"] > 0
        assert row["ratio"] == round(row["rate"] / row["paired_floor_rate"], 3)


def test_others_measured_or_explained(smoke: dict[str, object]) -> None:
    for row in smoke["results"]:  # type: ignore[union-attr]
        if row["system"] == "raw":
            continue
        if row["status"] == "ok":
            assert row["ratio"] is not None and row["ratio"] > 0
            value = row["p50_ms"] if row["kind"] == "latency" else row["rate"]
            assert value > 0, row
        else:
            # A peer or a felix feature that is missing is reported, not fatal; a crash
            # or a timeout of an installed system is a broken harness.
            assert row["status"] == "unavailable", row


def test_table_printed(smoke: dict[str, object]) -> None:
    out = str(smoke["_stdout"])
    assert out.splitlines()[0].split() == ["system", "scenario", "rate/s", "ratio", "note"]
    assert "raw" in out and "drain-2p" in out


def test_chart_drawn_when_matplotlib_present(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from bench import report

    rows = [
        {
            "system": "raw",
            "scenario": "drain-1p",
            "group": "drain-1p",
            "kind": "rate",
            "status": "ok",
            "rate": 100.0,
        },
        {
            "system": "raw",
            "scenario": "latency",
            "group": "latency",
            "kind": "latency",
            "status": "ok",
            "p50_ms": 0.1,
            "p99_ms": 0.2,
        },
    ]
    meta = {
        "date": "2025-01-01T00:00:00",
        "machine": {"nproc": 2, "redis": "7"},
        "jobs": 1,
        "repeat": 1,
    }
    png = tmp_path / "c.png"
    assert report.chart(png, meta, rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not (shutil_which("valgrind") and shutil_which("callgrind_control")), reason="no valgrind")
def test_instruction_counts_run_end_to_end(tmp_path: Path) -> None:
    """bench/instructions.py (redis-server under callgrind) with tiny numbers."""
    out = tmp_path / "instructions.json"
    kept = tmp_path / "dumps"
    cmd = [sys.executable, "bench/instructions.py", "--batch", "4", "--batches", "3", "--held", "8",
           "--due", "3", "--scheduled", "300", "--out", str(out), "--keep", str(kept)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["scripts"] == "FCALL" and data["redis"]
    for part, per in (("drain_batch_4", "per_batch"), ("publish", "per_call")):
        assert data[part][f"felix_{per}"] > 0 and data[part][f"raw_{per}"] > 0
        assert data[part]["felix_over_raw"] > 0
    # the held-back polls are compared with the same poll on a group holding none, counted
    # in the same steps; 8 is the fewest given, so the second ratio is exactly 1
    assert data["held_back_none"]["felix_per_batch"] > 0
    held = data["held_back_8"]
    assert held["felix_per_batch"] > 0 and held["over_none_held"] > 0 and held["over_8_held"] == 1.0
    # --keep: one callgrind dump per part, named
    assert {p.name for p in kept.iterdir()} == {
        "poll_4.callgrind", "poll_then_ack_4.callgrind", "raw_xreadgroup_xack_4.callgrind", "least_poll_4.callgrind",
        "poll_16_held_0.callgrind", "poll_16_held_8.callgrind", "publish.callgrind",
        "raw_xadd.callgrind", "publish_plain.callgrind", "empty_function.callgrind", "least_publish_script.callgrind",
        "poll_16_due-plain.callgrind", "poll_16_due-passed.callgrind", "poll_16_sched-none.callgrind",
        "poll_16_sched-held.callgrind"}
    # records handed out from the due index, and plain ones beside delayed ones not due:
    # each against the same poll of plain records alone
    due, sched = data["due_passed_over"], data["poll_with_scheduled"]
    assert due["index_entries"] == 3 and sched["scheduled"] == 300
    assert due["plain_per_batch"] > 0 and due["passed_over_per_batch"] > 0 and due["over_plain"] > 0
    assert sched["none_per_batch"] > 0 and sched["scheduled_per_batch"] > 0 and sched["over_none"] > 0
    # handing the records out is part of what a felix poll does, so it costs less
    drain = data["drain_batch_4"]
    assert 0 < drain["least_poll_script_per_batch"] < drain["felix_per_batch"]
    assert drain["least_poll_script_per_job"] * 4 == pytest.approx(drain["least_poll_script_per_batch"], abs=4)
    # the least a publish script does costs less than felix's plain publish, which costs
    # less than the default one (producer state too)
    pub = data["publish"]
    assert pub["empty_function_per_call"] < pub["least_publish_script_per_call"] < pub["felix_plain_per_call"]
    assert pub["felix_plain_per_call"] < pub["felix_per_call"]


def test_delay_figures_run_end_to_end(tmp_path: Path) -> None:
    """bench/delays.py with tiny numbers: every figure is there, memory per record at each
    payload size asked for, and the counts the run checks itself. (The sizes' records are
    2,000 each: at 200, a shift of the server's own buffers could outweigh them, and the
    plain records' memory came out as nothing once.)"""
    out = tmp_path / "delays.json"
    cmd = [sys.executable, "bench/delays.py", "--records", "300", "--single-records", "200", "--scheduled", "300",
           "--drain", "300", "--rounds", "1", "--sizes", "32,64", "--size-records", "2000", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["memory"]["scheduled"] == 300 and data["memory"]["pending"] == 0
    assert data["memory_one_by_one"]["scheduled"] == 200 and data["memory_one_by_one"]["payload_bytes"] == 64
    sizes = data["memory_one_by_one_sizes"]
    assert sizes["sizes"] == [32, 64] and [e["payload_bytes"] for e in sizes["each"]] == [32, 64]
    assert all(e["plain_bytes_per_record"] > 0 and e["ratio"] > 0 for e in sizes["each"])
    assert sizes["min_ratio"] <= sizes["median_ratio"] <= sizes["max_ratio"]
    assert 0 <= sizes["sizes_at_or_below_1_5x"] <= 2
    for part, field in (("poll_with_scheduled", "ratio"), ("due_drain", "passed_over_ratio"),
                        ("due_drain", "met_by_scan_ratio")):
        assert data[part][field] > 0


def test_scale_figures_run_end_to_end() -> None:
    """bench/scale.py with tiny numbers: every figure is there, and the figures that are
    counts, not timings, are exact."""
    sys.path.insert(0, str(ROOT))
    from bench import scale

    data = scale.measure(backlog=2_000, small=1_000, jobs=3_000, dead=300, held=200, polls=20, few=50)
    assert (data["small_backlog"], data["large_backlog"]) == (1_000, 2_000)
    assert (data["dead_letters"], data["in_flight_elsewhere"], data["in_flight_few"]) == (300, 200, 50)
    assert data["group_bytes_left_per_finished_job"] == 0
    assert data["cpu_jobs_per_part"] == 20 * 64
    for figure in ("drain_rate_10k_backlog", "drain_rate_large_backlog", "bytes_per_waiting_job",
                   "redis_usec_per_job", "raw_redis_usec_per_job", "redis_usec_per_job_separate_acks",
                   "least_poll_script_usec_per_job",
                   "poll_ack_usec_plain", "poll_ack_usec_with_dead_and_in_flight", "raw_poll_ack_usec_plain",
                   "raw_poll_ack_usec_with_pending", "poll_cost_ratio_dead_only", "poll_cost_ratio_in_flight_only",
                   "poll_cost_ratio_in_flight_few", "poll_cost_ratio_in_flight_over_few"):
        assert data[figure] > 0, figure


def test_shard_count_figures_run_end_to_end() -> None:
    """bench/shards.py with tiny numbers: the counts (not the timings) are exact: an
    empty poll of a 4-shard group known idle is one plain XREAD (no script call); an
    idle long-poller makes one blocking read and at most one call of the group's watch
    (shard 0's poll) per wait, whatever the shard count."""
    sys.path.insert(0, str(ROOT))
    from bench import shards

    with RedisServer() as server:
        raw = redis.Redis.from_url(server.url)
        raw.config_resetstat()
        drained = shards.drain(4, 400, server.url, raw, "k4")
        row = shards.idle_costs(4, 2, 2.5, server.url, raw, "k4")  # past one 2 s wait of each poller
        raw.close()
    assert drained["jobs_per_s"] > 0 and drained["commands_per_job"] > 0
    assert 0 < drained["script_calls_per_job"] < 0.2  # 16 records per call, acks riding
    assert row["script_calls_per_empty_poll"] == 0.0 and row["commands_per_empty_poll"] == 1.0
    # one call of the watch a wait (2 s): at most 0.5 a second, with the commands it runs
    assert 0 < row["idle_script_calls_per_s_per_poller"] <= 0.6
    assert 0 < row["idle_commands_per_s_per_poller"] <= 10.0


def test_fleet_figures_run_end_to_end() -> None:
    """bench/fleet.py with tiny numbers: every record published to a few idle pollers is
    handed out, and the per-record figures count the publishes' own script calls."""
    sys.path.insert(0, str(ROOT))
    from bench import fleet

    with RedisServer() as server:
        raw = redis.Redis.from_url(server.url)
        row = fleet.fleet(3, "poll", 3, 0.1, 1.0, server.url, raw, "f0")
        sharded = fleet.fleet(3, "sharded", 3, 0.1, 1.0, server.url, raw, "f1")
        # records 0 of shards 0-2: told apart by their shards, not their offsets
        shards = fleet.fleet(3, "sharded", 3, 0.1, 1.0, server.url, raw, "f2", shards=4)
        raw.close()
    for r in (row, sharded, shards):
        assert r["handed_out"] == r["published"] == 3
        assert r["script_calls_per_record"] >= 2  # the publish, and the poll that handed it out
        assert r["xread_per_record"] >= 1


def test_runtime_cpu_figures_run_end_to_end() -> None:
    """bench/runtime_cpu.py with tiny numbers: every way drains every record, and reports
    a rate and a CPU time per job."""
    sys.path.insert(0, str(ROOT))
    from bench import runtime_cpu

    with RedisServer() as server:
        for i, way in enumerate(runtime_cpu.WAYS):
            rate, cpu = runtime_cpu.measure(way, server.url, f"r{i}", 320, 4, 1)
            assert rate > 0 and cpu > 0, way
        with felix_redis.connect(server.url) as client:
            for i in range(len(runtime_cpu.WAYS)):
                assert client.group_describe(runtime_cpu.T, runtime_cpu.N, f"r{i}", runtime_cpu.G).lag == 0


def test_plan_cpu_figures_run_end_to_end() -> None:
    """bench/plan_cpu.py with tiny numbers: the canned client answers every poll with 16
    records and sends nothing to Redis; every way reports a CPU time per poll."""
    sys.path.insert(0, str(ROOT))
    from bench import plan_cpu

    with RedisServer() as server, felix_redis.connect(server.url) as client:
        plan_cpu.fill(client, plan_cpu.STREAM, 64, 1)
        plan_cpu.canned(client)
        for way in plan_cpu.WAYS:
            assert plan_cpu.run(way, client, 50) > 0, way
        assert len(client.group_poll(plan_cpu.T, plan_cpu.N, plan_cpu.STREAM, 0, plan_cpu.G, 16)) == 16
        with felix_redis.connect(server.url) as real:
            # what Redis saw: the capture's two polls only (the second acked the first's 16)
            info = real.group_describe(plan_cpu.T, plan_cpu.N, plan_cpu.STREAM, plan_cpu.G)
            assert (info.lag, info.shards[0].in_flight) == (48, 16)


def test_round_trip_figures_run_end_to_end() -> None:
    """bench/roundtrip.py with tiny numbers: every part reports a round trip and a server
    time, and the spinning function's server time grows with its spins."""
    sys.path.insert(0, str(ROOT))
    from bench import roundtrip

    data = roundtrip.measure(calls=20, rounds=1)
    parts = ["xadd", "xadd_kept_connection", "publish", "publish_plain", "producer_publish_keyed", "bare_publish_fcall",
             "async_xadd", "async_publish",
             *(f"spin_{n}" for n in roundtrip.SPINS)]
    for part in parts:
        assert data[part]["round_trip_usec"] > 0 and data[part]["server_usec"] > 0, part
    plain = data["publish_plain"]["round_trip_usec"]
    for part in ("publish", "producer_publish_keyed"):
        assert data[f"{part}_slower_than_plain"] == round(data[part]["round_trip_usec"] / plain - 1, 3), part
    assert data["spin_10000"]["server_usec"] > data["spin_0"]["server_usec"]
    assert data["publish_over_xadd_rate"] == round(
        data["xadd"]["round_trip_usec"] / data["publish"]["round_trip_usec"], 3)
    assert data["async_publish_over_async_xadd_rate"] == round(
        data["async_xadd"]["round_trip_usec"] / data["async_publish"]["round_trip_usec"], 3)
    assert data["publish_over_xadd_kept_connection_rate"] == round(
        data["xadd_kept_connection"]["round_trip_usec"] / data["publish"]["round_trip_usec"], 3)


def test_held_back_figures_run_end_to_end() -> None:
    """bench/held.py with tiny numbers: every group reports a server time per poll, and
    each ratio is that time over the time of the group with none held back."""
    sys.path.insert(0, str(ROOT))
    from bench import held

    data = held.measure(finished=300, rounds=1)
    base = data["none"]["usec_per_poll"]
    for name in ("none", "held_10000", "held_10000_behind_finished", "held_100_behind_finished"):
        assert data[name]["usec_per_poll"] > 0, name
        assert abs(data[name]["over_none"] - data[name]["usec_per_poll"] / base) < 0.01, name


def test_aof_loss_figures_run_end_to_end() -> None:
    """bench/aof_loss.py with one trial of each way: the answered writes a crash during
    an fsync under everysec loses are counted, and waiting for the fsync to end
    (RedisServer.kill(between_fsyncs=True), which the AOF fault tests use) or
    appendfsync always loses none. Both everysec ways kill once an fsync is pending, so
    a kill that did not wait loses writes here."""
    sys.path.insert(0, str(ROOT))
    from bench import aof_loss

    data = aof_loss.measure(trials=1, max_s=10)
    for way in aof_loss.WAYS:
        assert data[way]["killed"] + data[way]["no_fsync_seen"] == 1, way
        assert len(data[way]["lost_per_trial"]) == data[way]["killed"], way
    assert data["always"]["killed"] == 1 and data["always"]["lost_per_trial"] == [0]
    if not data["everysec_between_fsyncs"]["killed"]:
        pytest.skip("no AOF fsync was seen pending within 10 s (a fast disk): nothing to wait for")
    assert data["everysec_between_fsyncs"]["lost_per_trial"] == [0]
