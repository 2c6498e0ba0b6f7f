"""The mutation check: deliberate bugs in lua/ and felix_redis/ that the tests must catch.

    python -m tests.mutate                 # every mutation; a table; exit 1 unless all are killed
    python -m tests.mutate --list          # the mutations, and whether each still applies
    python -m tests.mutate --only M9 M11   # some of them
    python -m tests.mutate --jobs 2        # two at a time (two copies of the tree)

Each mutation is a search-and-replace in one file (an edit must match exactly once, or
its ``nth`` occurrence) and names the test files (and ``-k`` expression) that must catch
it. The command never touches the working tree: it copies the tracked files into a
temporary directory, checks that Python imports ``felix_redis`` (and the tests) from the
copy, then for each mutation edits the copy, runs pytest there (``-x``: the first failure
kills it), and puts the file back. The copy is removed at the end, also after an error or
Ctrl-C. A mutation whose text no longer matches the code is reported ``stale`` and fails
the run like a survivor: update its edit to the code it guards.

First every test selection runs once on the unmutated copy (the baseline): a selection
that fails there would "kill" any mutation, so its mutations are reported ``unproven``
and fail the run (``--no-baseline`` skips this, for a quick look).

Results: ``killed`` (pytest exit 1), ``SURVIVED`` (exit 0: the tests pass with the bug in),
``stale``, ``unproven``, ``error`` (pytest could not run: exit 2-5) and ``timeout`` (over
``--timeout`` seconds; pytest is interrupted, then killed). Every contract guarantee has at least one
mutation (column ``G``; see docs/reliability.md, "The mutation check").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Edit:
    old: str
    new: str
    nth: int = 0  # 0: ``old`` must occur exactly once; n: its n-th occurrence (from 1)


@dataclass(frozen=True)
class Mutation:
    id: str
    guarantee: str  # the contract guarantee (1-10) or feature it breaks
    path: str
    edits: tuple[Edit, ...]
    tests: str  # pytest arguments: test files, then options such as -k
    what: str

    def apply(self, text: str) -> str:
        """``text`` with the edits made; ValueError when one does not match (stale)."""
        for edit in self.edits:
            count = text.count(edit.old)
            if edit.nth == 0:
                if count != 1:
                    raise ValueError(f"{edit.old!r} occurs {count} times in {self.path}, want exactly once")
                text = text.replace(edit.old, edit.new)
            else:
                if count < edit.nth:
                    raise ValueError(f"{edit.old!r} occurs {count} times in {self.path}, want at least {edit.nth}")
                at = -1
                for _ in range(edit.nth):
                    at = text.index(edit.old, at + 1)
                text = text[:at] + edit.new + text[at + len(edit.old):]
        return text


def mutation(id: str, guarantee: str, path: str, old: str, new: str, tests: str, what: str, nth: int = 0,
             more: tuple[Edit, ...] = ()) -> Mutation:
    return Mutation(id, guarantee, path, (Edit(old, new, nth), *more), tests, what)


G = "tests/test_guarantees.py"
MODEL = "tests/test_model.py -k 'redis and not long'"
TRANSPORT = "tests/test_transport_faults.py"

MUTATIONS: list[Mutation] = [
    # ---- 1. at-least-once
    mutation("M1", "1", "lua/group_poll.lua",
             "        redis.call('ZADD', K.owed, expiry, m)\n", "",
             f"{G} -k 'test_1 and redis'",
             "a lapsed lease is not made owed: the record is never delivered again"),
    mutation("M2", "1", "lua/group_poll.lua",
             "    S.next = first + count\n", "    S.next = first + count + 1\n",
             f"{G} -k 'test_1 and redis'",
             "a poll of new records skips the record after them"),
    mutation("M3", "1", "felix_redis/protocol.py",
             "                return parse_delivered(reply, 5, count, shard)",
             "                return parse_delivered(reply, 5, count, shard)[1:]",
             f"{G} -k 'test_1 and redis'",
             "a poll leases its first record but does not hand it to the caller"),
    # ---- 2. one holder
    mutation("M4", "2", "lua/group_poll.lua",
             "local expiry = fmt(now + S.vt)", "local expiry = fmt(now)",
             f"{G} -k 'test_2 and redis'",
             "a lease expires as it is granted"),
    mutation("M5", "2", "lua/includes/acks.lua",
             "  if tonumber(expiry) <= now then\n", "  if false then\n",
             "tests/test_groups.py -k 'redis and stale'",
             "a claim whose lease lapsed is still accepted (nack/extend/dead-letter)"),
    mutation("M6", "2", "lua/includes/acks.lua",
             "  if current ~= attempts then\n", "  if false then\n",
             f"{G} -k 'test_3_reclaim_returns and redis'",
             "a claim of an older delivery is still accepted"),
    # ---- 3. attempts
    mutation("M7", "3", "lua/group_poll.lua",
             "      local attempts = a + 1\n", "      local attempts = a\n",
             f"{G} -k 'test_3 and redis'",
             "a redelivery does not add one to the attempts"),
    mutation("M8", "3", "lua/group_poll.lua",
             "        redis.call('ZADD', K.owed, 0, m)\n", "        redis.call('ZADD', K.owed, now + 60000, m)\n",
             f"{G} -k 'test_3 and redis'",
             "a reclaimed record is not due at once"),
    mutation("M8b", "3", "lua/group_poll.lua",
             "    if first and fields[1] == 'p' and fields[3] == nil then\n",
             "    if fields[1] == 'p' and fields[3] == nil then\n",
             f"{G} -k 'test_3 and redis'",
             "a plain record delivered again goes out in the first delivery's short form: the "
             "client reads attempts 1"),
    # ---- 4. bounded retries (the `>=` at max attempts)
    mutation("M10", "4", "lua/group_poll.lua",
             "  if a < S.max then return false end", "  if a <= S.max then return false end",
             f"{G} tests/test_model.py -k 'redis and (test_4 or test_group_semantics_match_the_model and not long)'",
             "a record at max_attempts (reclaimed, lapsed, or due past a lowered max) is delivered once more"),
    mutation("M12", "4", "lua/group_nack.lua",
             "if attempts >= S.max and not release then", "if attempts > S.max and not release then",
             f"{G} -k 'test_4 and redis'",
             "a nack at max_attempts makes the record owed instead of a dead letter"),
    mutation("M13", "4", "lua/group_poll.lua",
             "    local a = tonumber(tries[i]) or 0\n",
             "    local a = tonumber(tries[i]) or 1\n",
             f"{G} -k 'test_4 and redis'",
             "a redriven record's attempts do not start over (its first redelivery says 2)"),
    # ---- 5. order of hand-out
    mutation("M14", "5", "lua/group_poll.lua",
             "want = max_records - n\nlocal scanned", "want = max_records\nlocal scanned",
             f"{G} -k 'test_5 and redis'",
             "a poll hands out max_records new records on top of the redeliveries"),
    mutation("M15", "5", "lua/group_poll.lua",
             "  local got = redis.call('ZRANGEBYSCORE', K.owed, '-inf', now_s,",
             "  local got = redis.call('ZRANGEBYSCORE', K.owed, '-inf', '+inf',",
             f"{G} -k 'test_5 and redis'", "once one owed record is due, records nacked with a delay come too"),
    # ---- 6. position never passes an unfinished record
    mutation("M16", "6", "lua/includes/runs.lua",
             "    S.pos = S.top_last + 1\n", "    S.pos = S.top_last + 2\n",
             f"{G} -k 'test_6 and redis'",
             "the position jumps one past a run of finished records"),
    mutation("M17", "6", "lua/group_redrive.lua",
             "if off < S.pos then redis.call('ZADD', K.redo, off, m) else unfinish_above(K, S, off) end",
             "if off >= S.pos then unfinish_above(K, S, off) end",
             f"{G} -k 'test_6 and redis'",
             "a redrive below the position is not remembered: the position stays above it"),
    mutation("M11", "6", "lua/stream_trim.lua",
             "    if pos and #redo > 0 and tonumber(redo[2]) < pos then pos = tonumber(redo[2]) end\n", "",
             "tests/test_retention.py -k redis",
             "(the audit's M11) stream_trim ignores redriven records below the position"),
    mutation("M18", "6", "lua/stream_trim.lua",
             "    if pos and pos < cut then cut = pos end\n", "",
             "tests/test_retention.py -k redis",
             "safe retention trims past a group's position"),
    # ---- 7. idempotent producer
    mutation("M19", "7", "lua/publish.lua",
             "      if seq == last then\n", "      if seq == last + 1000000 then\n",
             f"tests/test_producer.py {G} -k 'redis and (lost or test_7)'",
             "a re-send of the last sequence is refused instead of answered from the shard's memory"),
    mutation("M20", "7", "lua/publish.lua",
             "      elseif seq < last then\n", "      elseif false then\n",
             "tests/test_producer.py -k 'redis and sequence'",
             "an older sequence is not refused"),
    mutation("M9", "7", "felix_redis/plans.py",
             "            return bool(op.args[1])  # a producer id", "            return True  # a producer id",
             f"{TRANSPORT} -k 'sync and plain'",
             "(the audit's M9) a plain publish without a producer is taken as safe to retry"),
    mutation("M21", "7", "felix_redis/plans.py",
             '"group_poll", "group_ack", "group_configure",',
             '"group_poll", "group_ack", "group_configure", "group_nack",',
             f"{TRANSPORT} -k 'sync and nack'",
             "a nack is taken as safe to retry (sent again after a lost reply)"),
    mutation("M22", "7", "felix_redis/plans.py",
             "        if not (self.safe or exc.unsent):", "        if not self.safe:",
             f"{TRANSPORT} -k 'sync and refused'",
             "a call that was certainly not sent is not sent again"),
    mutation("M23", "7", "felix_redis/_driver.py",
             "                                unsent=True)", "                                unsent=False)",
             f"{TRANSPORT} -k 'sync and READONLY'",
             "a refusal reply (READONLY...) is taken for a lost reply", nth=1),
    mutation("M24", "7", "felix_redis/producers.py",
             "        yield Sleep(0.05 + random.random() * 0.1)\n        return (yield op)",
             "        raise exc",
             "tests/test_producer.py -k 'redis and lost'",
             "an idempotent publish whose reply was lost is not sent again"),
    # ---- 8. server time
    mutation("M25", "8", "lua/includes/prelude.lua",
             "  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)",
             "  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + 3600000",
             f"{G} -k 'test_8'",
             "scripts read a clock an hour off the server's TIME"),
    mutation("M26", "8", "felix_redis/models.py",
             "        return ms_to_datetime(self.published_ms)",
             "        import time\n        return ms_to_datetime(int(time.time() * 1000))",
             f"{G} -k 'test_8'",
             "published_at comes from the client's clock"),
    # ---- 9. one atomic script, bad input refused before anything is written
    mutation("M27", "9", "lua/includes/prelude.lua",
             "  if t ~= 'none' and t ~= want then\n", "  if false then\n",
             f"{G} -k 'test_9_wrong and redis'",
             "a key of the wrong type is not refused up front"),
    mutation("M28", "9", "lua/includes/dead_letters.lua",
             "      if redis.call('HEXISTS', K.dead, m) == 0 then\n",
             "      if redis.call('HEXISTS', K.dead, m) == 0 and false then\n",
             f"{G} -k 'test_4_discard and redis'",
             "discard of a list with a record that is not a dead letter discards the others"),
    mutation("M29", "9", "felix_redis/keys.py",
             "    if not _NAME_RE.fullmatch(value):", "    if False:",
             f"{G} -k 'test_9_bad_names and redis'",
             "bad names are not refused"),
    # ---- 10. consistency quorum / all
    mutation("M30", "10", "felix_redis/caches.py",
             "        return replication // 2\n", "        return 0\n",
             "tests/test_consistency.py -k 'unconfirmed and quorum'",
             "a quorum write does not WAIT for replicas"),
    # ---- features the guarantees rest on
    mutation("M31", "ack", "lua/group_ack.lua",
             "return out", "for i = 1, #out do out[i] = 1 end\nreturn out",
             "tests/test_groups.py -k 'redis and ack'",
             "an ack of a finished record says it acked it"),
    mutation("M32", "extend", "lua/group_extend.lua",
             "local expiry = now + (by or S.vt)", "local expiry = now + S.vt",
             "tests/test_groups.py -k 'redis and extend'",
             "extend ignores its by="),
    mutation("M33", "long poll", "lua/group_nack.lua",
             "  wake(K, S)\n", "",
             "tests/test_long_poll.py -k 'redis and nack'",
             "a nack does not wake long-polling consumers"),
    mutation("M34", "retention", "lua/group_poll.lua",
             "      S.trimmed = S.trimmed + 1\n", "",
             "tests/test_retention.py -k 'redis and bounded'",
             "bounded retention does not count an owed record it trimmed"),
    mutation("M35", "dead letter", "lua/group_discard.lua",
             "count = count + redis.call('HDEL', K.dead, m)", "count = count + 1",
             f"{G} -k 'test_4_discard and redis'",
             "discard counts the dead letters but leaves them"),
    mutation("M37", "7", "felix_redis/asyncio.py",
             "                retrying = retrying or Retrying(op, self.core.retry_for)\n",
             "                raise\n",
             f"{TRANSPORT} -k 'async and (after or refused)'",
             "the asyncio client never sends a call again (safe, or certainly not sent)"),
    mutation("M38", "7", "felix_redis/protocol.py",
             "            producer.sequences[slot] = op.args[2]\n            if borrowed:\n",
             "            if borrowed:\n",
             "tests/test_producer.py -k 'redis and dense'",
             "a producer's quick publish does not move its sequence on: the next is taken for a re-send"),
    mutation("M39", "ack", "felix_redis/sharded.py",
             "        if ack_failure is not None:\n            raise ack_failure\n", "",
             "tests/test_plans.py",
             "a sharded poll whose call carrying acks was lost hands out records without saying the acks may be lost"),
    # ---- security (issue 19): what the scripts check beyond ACL
    mutation("S1", "security", "lua/includes/acl.lua",
             "      if KEYS[at + j - 1] ~= want then", "      if false then",
             "tests/test_attacks.py -k 'made_up_group_keys or keys_of_another_group'",
             "stream_trim and stream_delete take group keys that are not the named groups'"),
    mutation("S2", "security", "lua/publish.lua",
             "    if not five or producer_mac(pid, five) ~= mac then", "    if not five then",
             "tests/test_attacks.py -k forged_producer_state",
             "a producer state written by hand (no valid MAC) answers a re-send: the victim's record is dropped"),
    mutation("S3", "security", "lua/group_create.lua",
             "if name ~= group_shape().group then", "if false then",
             "tests/test_attacks.py -k cannot_name_another",
             "group_create with one group's keys may list another name in the groups set"),
    mutation("S4", "security", "felix_redis/acl.py",
             'writes.append((("sadd",), [f"{base}:groups"]))', 'writes.append((("sadd", "srem"), [f"{base}:groups"]))',
             "tests/test_attacks.py -k cannot_remove_another",
             "a group manager may SREM another group from the groups set"),
    mutation("S5", "security", "felix_redis/acl.py",
             '    "ping", "time", "wait", "fcall", "type",',
             '    "ping", "time", "wait", "fcall", "evalsha", "script|load", "type",',
             "tests/test_attacks.py -k 'load_or_run_code or stall'",
             "roles may load and run Lua of their own"),
    # ---- time in the queue (issue 20)
    mutation("D1", "delays", "lua/group_poll.lua",
             "          doff = a + give - 1\n",
             "          doff = a + give\n",
             "tests/test_time_in_queue.py -k sharing_a_due_time",
             "inside a due time split between polls, the record after each poll's last is skipped"),
    mutation("D2", "delays", "lua/includes/due.lua",
             "  return at > 0 and rd[at] == t and ra[at] <= off and off <= rz[at]",
             "  return at > 0 and rd[at] == t and ra[at] < off and off <= rz[at]",
             "tests/test_time_in_queue.py -k 'three_thousand or sharing_a_due_time or not_neighbours'",
             "the due index looks held records up one off: the first record of a delayed batch is handed out early"),
    mutation("D4", "delays", "lua/group_poll.lua",
             "(dt > dnow or (S.doff and dt == dnow))", "dt > dnow",
             "tests/test_time_in_queue.py -k expired_inside",
             "the scan hands out records of the due time the group stands inside, which the due index hands out again"),
    mutation("D5", "delays", "lua/group_poll.lua",
             "local want = max_records - n\nif K.due", "local want = max_records\nif K.due",
             "tests/test_time_in_queue.py -k redeliveries_and_due_delayed",
             "due delayed records are handed out beyond max_records on top of the redeliveries"),
    mutation("D6", "delays", "lua/group_poll.lua",
             "    if not (f[1] == 'p' and f[3] == 'd' and f[5] == nil) and not all_out(es, k, k, due_by) then\n",
             "    if not (f[1] == 'p' and f[3] == 'd') and not all_out(es, k, k, due_by) then\n",
             "tests/test_time_in_queue.py -k 'expires_before_it_is_due'",
             "a delayed record with an expiry is handed out from the due index without its expiry looked at"),
    mutation("D7", "delays", "lua/group_poll.lua",
             "        put(es, 1, #es, 1, t)\n", "        put(es, 1, #es, 1, t + 1)\n",
             "tests/test_time_in_queue.py -k 'carry_their_own_due_time'",
             "a record handed out from the due index shows a due time other than its own"),
    mutation("D8", "delays", "lua/group_poll.lua",
             "elseif K.due and S.dmax > S.dcur and max_records > 0 and n >= max_records then",
             "elseif K.due and S.dmax > S.dcur and n >= 0 then",
             "tests/test_time_in_queue.py -k 'first_record_falls_due or few_script_calls'",
             "a poll that hands out nothing says something is due now while delayed records wait: a long poll spins"),
    mutation("D9", "delays", "lua/group_poll.lua",
             "        if room == 0 then\n", "        if false then\n",
             "tests/test_time_in_queue.py -k filled_by_one_due",
             "a poll filled by one due time leaves the cursor inside the next below its first offset: -1 does not "
             "read back, and the group hands the same delayed record out again and again"),
    mutation("D10", "delays", "lua/publish.lua",
             "extra[#extra + 1] = fmt(due - now) end", "extra[#extra + 1] = fmt(due) end",
             "tests/test_time_in_queue.py -k keeps_its_delay",
             "the log's d field holds the due time, not the delay: readers add the publish time to it"),
    mutation("D11", "delays", "lua/includes/due.lua",
             "        at = a + (tonumber(l) or 1)\n", "        at = a + 1\n",
             "tests/test_time_in_queue.py -k 'small_chunks or keeps_its_delay'",
             "the due index reads an entry after a delayed batch from the batch's second record: "
             "records appended after a batch are not found held, and the scan hands them out early"),
    mutation("D12", "delays", "lua/includes/due.lua",
             "    local g = first - top.last - 1\n", "    local g = first - top.last\n",
             "tests/test_time_in_queue.py -k 'keeps_its_delay or small_chunks'",
             "a delayed publish writes its gap one too long: the index names the next offset, "
             "and the record itself is handed out before it is due"),
    mutation("D13", "delays", "lua/includes/records.lua",
             "  if #v >= 13 then return tonumber(v) end\n", "",
             "tests/test_time_in_queue.py -k format_before",
             "a d field holding a due time (written before the delay was stored) is read as a delay: "
             "the record is due thousands of years on, or handed out at once"),
    mutation("D14", "delays", "lua/includes/due.lua",
             "    if old then f, rest = s_match(m, '^%d+:(%d+):%d+:(.*)$') end\n", "",
             "tests/test_time_in_queue.py -k format_before",
             "a due index chunk of the format before v2 is not read: its records are handed out before they are due"),
    mutation("D15", "delays", "lua/includes/due.lua",
             "  return {k = tonumber(k)}\n", "  fail('WRONGTYPE', 'not a chunk')\n",
             "tests/test_time_in_queue.py -k format_before",
             "a delayed publish into a bucket holding a chunk of the format before v2 fails"),
    mutation("D16", "delays", "lua/includes/due.lua",
             "s_format('v2:%06d', k)", "s_format('%06d', k)",
             "tests/test_time_in_queue.py -k 'keeps_its_delay or small_chunks'",
             "a new due index chunk is written without its format: a client before v2 would read it "
             "as its own and append to it, and the index names the wrong offsets"),
    mutation("D3", "delays", "lua/stream_trim.lua",
             "      if doff and doff ~= '' then dcur = dcur - 1 end\n", "",
             "tests/test_time_in_queue.py -k stands_inside",
             "trimming prunes the due time a group stands inside: its records not handed out yet are never handed out"),
    mutation("M36", "worker", "felix_redis/_runtime.py",
             "                yield Call(self._group.extend, job.item)\n",
             "                yield Call(self._sleep, 0.0)\n",
             "tests/test_worker.py -k extended",
             "the worker never extends the leases of running handlers"),
    # ---- priorities across streams
    mutation("P1", "priorities", "felix_redis/sharded.py",
             "            want = self.max_records - self.count\n"
             "            if want <= 0:\n                return True\n",
             "            want = self.max_records\n",
             "tests/test_priorities.py -k 'strict_order and redis'",
             "a poll takes from every stream, not only what the streams before it could not fill"),
    mutation("P2", "priorities", "felix_redis/sharded.py",
             "            state.left = weights[state.lead]\n", "            state.left = 10**9\n",
             "tests/test_priorities.py -k 'weights_share and redis'",
             "the weighted order never ends a run: the first stream leads every poll, the others starve"),
    mutation("P3", "priorities", "felix_redis/sharded.py",
             "        for other in (self.sources if carry_all else (source,)):\n",
             "        for other in (source,):\n",
             "tests/test_priorities.py -k 'strict_order and redis'",
             "acks of streams a poll does not reach are never sent: those records are redelivered"),
    # ---- queued acks
    mutation("Q1", "queued-acks", "felix_redis/client.py",
             "        queued, acks = self._with_queued(ack)\n        try:\n            return self._client._drive(",
             "        queued, acks = [], ack\n        try:\n            return self._client._drive(",
             "tests/test_queued_acks.py -k readme_loop",
             "queued acks do not ride on the next poll: a call of their own per batch"),
    mutation("Q2", "queued-acks", "felix_redis/client.py",
             "            if queued:\n                self._requeue(queued)\n"
             "                self._client._acks.defer(self)\n",
             "            if queued:\n                pass\n",
             "tests/test_queued_acks.py -k fails_keeps",
             "a poll that fails loses the queued acks it took along"),
    mutation("Q3", "queued-acks", "felix_redis/client.py",
             "    def close(self) -> None:\n        self._acks.release_all()\n",
             "    def close(self) -> None:\n",
             "tests/test_queued_acks.py tests/test_prefetch.py -k 'client and (killed or ends)'",
             "closing the client leaves queued acks unsent and the records fetched ahead leased"),
    mutation("F1", "security", "felix_redis/scripts.py",
             """        return isinstance(error, NoPermissionError) and "'fcall'" in str(error).lower()""",
             "        return isinstance(error, NoPermissionError)",
             "tests/test_overview_reads.py -k refusal",
             "any NOPERM (a refused key, a script's role check) turns the client to EVALSHA for good"),
    mutation("F2", "failover", "felix_redis/connection.py",
             "        if time.monotonic() < until:\n            return True\n",
             "        if time.monotonic() < until:\n            return False\n",
             "tests/test_sentinel_watch.py -k passed_over",
             "a sentinel that has not heard of a failover sends clients back to the old primary"),
    # ---- the Worker's runtime (issue 23): quick handlers on the loop's thread
    mutation("R1", "runtime", "felix_redis/worker.py",
             "        if self._handler_runs >= QUICK_RUNS and self._handler_avg < QUICK_HANDLER_S:\n",
             "        if False:\n",
             "tests/test_worker.py -k quick_handler",
             "a quick handler still costs a thread hop per record"),
    mutation("R2", "runtime", "felix_redis/worker.py",
             "            if took > INLINE_MAX_S:\n", "            if False:\n",
             "tests/test_worker.py -k slow_run",
             "a handler that turned slow keeps running one record at a time on the loop's thread"),
    mutation("R3", "runtime", "felix_redis/aioworker.py",
             "        if self._handler_runs >= _worker.QUICK_RUNS and self._handler_avg < _worker.QUICK_HANDLER_S:\n",
             "        if False:\n",
             "tests/test_worker.py -k async_worker_awaits",
             "a quick async handler still costs a task per record"),
    mutation("R4", "runtime", "felix_redis/aioworker.py",
             "                if took > _worker.INLINE_MAX_S:\n                    runs = 0",
             "                if False:\n                    runs = 0",
             "tests/test_worker.py -k async_worker_awaits",
             "an async handler that turned slow keeps running one record at a time on the loop's task"),
    mutation("R5", "runtime", "felix_redis/aioworker.py",
             "                if task is not None:\n                    task.cancel()\n",
             "                task.cancel()  # type: ignore[union-attr]\n",
             "tests/test_worker.py -k cancelled_during",
             "run() cancelled during a handler on the loop's task breaks the shutdown"),
    # ---- many shards (issue 26): what a sharded group knows of idle shards
    mutation("K1", "shards", "felix_redis/sharded.py",
             "        for shard in moved:\n            idle.pop(shard, None)\n            cands.add(shard)\n",
             "        for shard in ():\n            idle.pop(shard, None)\n            cands.add(shard)\n",
             "tests/test_sharded.py -k 'redis and (busy_elsewhere or quiet_shard or poller_busy)'",
             "a look that finds an idle shard moved is ignored: what lands there waits for the 30 s re-ask"),
    mutation("K2", "shards", "lua/group_create.lua",
             "redis.call('XADD', K.wake, 'MAXLEN', '1', fmt(wseq) .. '-1', 'w', '1')", "",
             "tests/test_sharded.py -k 'redis and made_again'",
             "a group made again under consumers that knew its shards idle is not seen until the 30 s re-ask"),
    mutation("K8", "shards", "felix_redis/sharded.py",
             "    return random.randrange(shards)\n", "    return 0\n",
             "tests/test_sharded.py -k 'fleet_do_not_all_lead'",
             "every consumer of a fleet leads on shard 0 first: they all poll the same shard at once"),
    mutation("K3", "shards", "felix_redis/sharded.py",
             "        if epoch == self.state.epoch:\n            return False\n",
             "        if True:\n            return False\n",
             "tests/test_sharded.py -k rolls_back",
             "a restart from an older snapshot (the client reconnected) keeps the group's stale idle shards"),
    mutation("K4", "shards", "felix_redis/sharded.py",
             "            elif known[1] <= now:\n", "            elif known[1] <= now - 3600:\n",
             "tests/test_sharded.py -k 'redis and (nobody_polled or lease_lapsing)'",
             "a shard known idle is not asked again when its due time (a delayed record, a lease) comes"),
    mutation("K5", "shards", "felix_redis/sharded.py",
             "        urgent.difference_update(beside)\n", "        beside = []\n",
             "tests/test_sharded.py -k 'redis and quiet_shard'",
             "what lands on a quiet shard waits for its turn to lead while 63 busy shards take theirs"),
    mutation("K6", "shards", "lua/group_configure.lua",
             "if rate ~= '' then\n  -- pollers waiting", "if false then\n  -- pollers waiting",
             "tests/test_sharded.py -k 'redis and rate_limit'",
             "removing a rate limit leaves pollers waiting for the old window to end"),
    # ---- fleets: a record wakes one long-poller (tests/test_bell.py)
    mutation("B1", "fleets", "lua/group_poll.lua",
             "      redis.call('ZADD', bell, 0, member)\n",
             "",
             "tests/test_bell.py -k 'busy_watcher or burst'",
             "a poll that takes records while nobody watches rings no bell: the followers sleep through new records"),
    mutation("B2", "fleets", "lua/group_poll.lua",
             "  local live = holder and lexp > now\n", "  local live = holder\n",
             "tests/test_bell.py -k stops_polling",
             "a watch never lapses: a watcher that stopped polling is never replaced, each record waits out a wait"),
    mutation("B3", "fleets", "felix_redis/protocol.py",
             "        self.bells = True\n", "        self.bells = False\n",
             "tests/test_bell.py -k 'one_of_many and False'",
             "every long poll watches the log: each record wakes every idle poller"),
    mutation("B4", "fleets", "felix_redis/sharded.py",
             "        self.state.follow, self.state.watching = role == 2, role == 1\n",
             "        self.state.follow, self.state.watching = False, role == 1\n",
             "tests/test_bell.py -k 'one_of_many and True'",
             "a sharded group's follower blocks on the log like a watcher: each record wakes every idle consumer"),
    mutation("B5", "fleets", "lua/group_poll.lua",
             "  local mine = holder and (holder == waiter or holder == ring)\n",
             "  local mine = holder and holder == ring\n",
             "tests/test_bell.py -k lone_poller",
             "a watcher polling again loses its own watch: it and the others wait on the bell until it lapses"),
    mutation("B6", "fleets", "felix_redis/plans.py",
             "        return f\" @{self.id}\"\n", "        return \"\"\n",
             "tests/test_plans.py tests/test_bell.py -k 'names_the_ring or (one_of_many and False)'",
             "a follower that popped a ring does not name it: the watch it was handed sits unused until it lapses"),
    mutation("B7", "fleets", "lua/group_poll.lua",
             "id .. ' ' .. fmt(S.next) .. ' '", "id .. ' ' .. fmt(S.next + 1) .. ' '",
             "tests/test_bell.py -k 'burst or busy_watcher'",
             "a ring's points skip the first record not handed out: a burst's rest is not seen by the new watcher"),
    mutation("B8", "fleets", "lua/group_poll.lua",
             "    local unpopped = rung and holder and s_sub(holder, 1, 1) == '@'\n",
             "    local unpopped = false\n",
             "tests/test_bell.py -k lone_taker",
             "a poller alone follows its own ring after each record it takes: a BZPOPMIN round trip more per record"),
    mutation("B9", "fleets", "felix_redis/protocol.py",
             "            moved = yield BlockAny(points, block_ms, context, then=then)\n",
             "            moved = yield BlockAny(points, block_ms, context)\n",
             "tests/test_long_poll.py -k one_round_trip",
             "the poll goes after the block returns, not behind it: a wake-up costs a round trip more"),
    mutation("B10", "fleets", "felix_redis/protocol.py",
             "            took = self.reused_look(ring_key, max_records, args[1], wait_ms)\n",
             "            took = None\n",
             "tests/test_long_poll.py -k commandstats",
             "the poll behind a block whose wait ran out is not the next long poll's first: two polls per idle wait"),
    mutation("B11", "fleets", "felix_redis/protocol.py",
             "                ttl = wait_ms if steady and runs_ms >= left_ms else",
             "                ttl = wait_ms if runs_ms >= left_ms else",
             "tests/test_bell.py -k one_more_wait",
             "the poll behind a block whose wait ran out always takes the watch for one more wait: a waiter that "
             "polls the group once, then elsewhere, keeps the watch, and the group's other waiters only follow"),
    mutation("B12", "fleets", "felix_redis/protocol.py",
             "            if watching and not reclaim and not settings.replicas:\n",
             "            if watching and not settings.replicas:\n",
             "tests/test_long_poll.py -k cannot_start_from",
             "a reclaiming long poll sends a poll behind its block that no next long poll starts from: two per wait"),
    mutation("B13", "fleets", "felix_redis/_driver.py",
             "        if isinstance(reply, list) and len(reply) > 4 and int(reply[4]) > 0:\n"
             "            return Took(None, reply)\n",
             "",
             "tests/test_long_poll.py -k refused_block",
             "records the poll behind a refused block handed out are dropped: they wait for their lease"),
    mutation("B14", "fleets", "felix_redis/protocol.py",
             "                block_ms = max(1, min(block_ms, watch_left - C.WATCH_MARGIN_MS // 2))\n", "",
             "tests/test_bell.py -k never_lets",
             "an idle loop's second long poll blocks past the watch the first one's last poll took: it lapses, "
             "and another waiter may watch too"),
    mutation("T1", "1", "felix_redis/testing/server.py",
             "        if between_fsyncs and self.process is not None", "        if False and self.process is not None",
             "tests/test_bench_smoke.py -k aof_loss",
             "the AOF fault tests kill Redis while an fsync runs: under everysec it lost writes it answered "
             "(a repeated attempt, a lost publish) and the tests fail on Redis's loss, not felix's"),
    mutation("B15", "fleets", "felix_redis/sharded.py",
             "            whole = chosen == [0] if shards == 1 else not cluster"
             " and sorted(chosen) == list(range(shards))\n",
             "            whole = chosen == [0]\n",
             "tests/test_bell.py -k any_shard_wakes",
             "a sharded group over several shards keeps out of the group's watch: a record wakes every idle consumer"),
    mutation("B16", "fleets", "felix_redis/sharded.py",
             "                if self.shards > 1 and self.core.bells and"
             " (self.state.watching or (watched and not self.gave_up)):\n"
             "                    yield from self.give_up_watch()\n",
             "",
             "tests/test_bell.py -k busy_sharded_watcher",
             "a sharded watcher that takes records keeps the watch: a record on another shard waits for a follower's "
             "wait to end"),
    mutation("B17", "fleets", "lua/group_poll.lua",
             "  if n == 0 and not busy then\n", "  if n == 0 then\n",
             "tests/test_bell.py -k busy_sharded_watcher",
             "the call giving a sharded group's watch up keeps it: nobody watches while its taker is busy"),
    mutation("B18", "fleets", "felix_redis/sharded.py",
             "        told = read_shards_points(rang.shards, self.shards - 1)\n",
             "        told = None\n",
             "tests/test_bell.py -k any_shard_wakes",
             "a ring's popper watches the other shards from its own old points: it wakes at once and polls them"),
    mutation("B19", "fleets", "felix_redis/sharded.py",
             "            and (self.state.watching or (learn and self.state.quiet))\n",
             "            and self.state.watching\n",
             "tests/test_bell.py -k idle_sharded_followers",
             "an idle sharded follower looks at every shard after each wait on the bell: a command more a wait"),
    mutation("B20", "fleets", "felix_redis/sharded.py",
             "                    looked_long_ago = time.monotonic() - self.state.looked >= KNOWN_IDLE_S\n",
             "                    looked_long_ago = False\n",
             "tests/test_bell.py -k shard_0_only",
             "a sharded follower never looks at the other shards: a watch of shard 0 only leaves their records"),
    mutation("B21", "fleets", "felix_redis/sharded.py",
             "        if state.follow and self.wait_ms > 0 and start >= state.follow_until:\n",
             "        if False:\n",
             "tests/test_bell.py -k long_ago",
             "a follower role learned long ago sends the next long poll to the bell though the watcher died"),
    mutation("B22", "fleets", "felix_redis/plans.py",
             "    return text.isdigit() and text.isascii() and len(text) <= 18\n",
             "    return text.lstrip('-').isdigit()\n",
             "tests/test_bell.py -k forged_ring",
             "a forged ring with points Redis refuses as stream IDs makes its popper's poll raise"),
    mutation("B23", "fleets", "felix_redis/sharded.py",
             "            self.gave_up = self.gave_up or count > 0\n",
             "",
             "tests/test_bell.py -k shard_0_gives",
             "a sharded watcher that took records of shard 0 gives the watch up again: a script call more a record"),
    mutation("B24", "fleets", "felix_redis/sharded.py",
             "(self.state.watching or (watched and not self.gave_up)):\n",
             "(self.state.watching or watched) and not self.gave_up:\n",
             "tests/test_bell.py -k took_its_watch_back",
             "a sharded watcher that took its watch back later in a round keeps it while busy with records"),
    mutation("B25", "fleets", "felix_redis/plans.py",
             "    if len(parts) not in (4, 5) or not _number(parts[1]) or not _number(parts[2]) \\\n",
             "    if len(parts) not in (4, 5) or not _number(parts[1], True) or not _number(parts[2], True) \\\n",
             "tests/test_bell.py -k forged_ring",
             "a forged ring naming offset -1 makes its popper's poll raise"),
    mutation("B26", "fleets", "felix_redis/sharded.py",
             "        if state.follow and self.wait_ms > 0 and start >= state.follow_until:\n",
             "        if state.follow and self.wait_ms > 0:\n",
             "tests/test_bell.py -k spaced_polls",
             "a follower whose polls are spaced asks shard 0 again and looks each poll while its watch lives"),
    mutation("AR1", "2", "lua/includes/runs.lua",
             "  if a == S.pos then\n    S.pos = b + 1\n    advance_done(K, S)\n",
             "  if a == S.pos then\n    S.pos = b + 1\n",
             "tests/test_poll_ack.py -k run_of_acks",
             "a run of acks at the position does not move it over the done runs after it"),
    mutation("AR2", "2", "lua/includes/acks.lua",
             "    if first == a and last == b then\n",
             "    if first == a then\n",
             "tests/test_poll_ack.py -k run_of_acks",
             "a run of acks covering part of a lease takes the whole lease as acked"),
    mutation("AR3", "2", "lua/includes/acks.lua",
             "redis.call('HEXISTS', K.attempts, fmt(a)) == 0) then\n",
             "true) then\n",
             "tests/test_poll_ack.py -k run_of_acks",
             "a run of redelivered records acked by its quick path leaves their attempts behind"),
    mutation("W1", "dashboard", "felix_redis/dashboard/app.py",
             "            if dash.read_only:\n                raise ApiError(403,",
             "            if False:\n                raise ApiError(403,",
             "tests/test_dashboard.py -k read_only",
             "--read-only lets redrive and discard through"),
    mutation("W2", "dashboard", "felix_redis/dashboard/app.py",
             '    if ctype != "application/json":\n',
             '    if False:\n',
             "tests/test_dashboard.py -k not_json",
             "an action takes a form post (what a foreign page can forge)"),
    mutation("W3", "dashboard", "felix_redis/dashboard/app.py",
             "        return is_loopback(name) or name == self.host\n",
             "        return True\n",
             "tests/test_dashboard.py -k loopback_host",
             "without a token, a foreign Host (DNS rebinding) is answered"),
    mutation("W4", "dashboard", "felix_redis/dashboard/app.py",
             "    if self.token is None:\n            return True\n        header",
             "    if True:\n            return True\n        header",
             "tests/test_dashboard.py -k token_guards",
             "a token-protected dashboard answers requests without the token"),
    mutation("W5", "dashboard", "felix_redis/dashboard/templates/dead.html",
             "{% if manage %}\n<div class=\"actions\"",
             "{% if true %}\n<div class=\"actions\"",
             "tests/test_dashboard.py -k consume_only",
             "a consume-only user is shown redrive and discard buttons that would fail"),
    mutation("W6", "dashboard", "felix_redis/dashboard/app.py",
             '                               autoescape=select_autoescape(default=True, default_for_string=True))',
             '                               autoescape=False)',
             "tests/test_dashboard.py -k escaped",
             "pages render payloads, reasons and headers from Redis unescaped"),
    mutation("PF1", "1", "felix_redis/client.py",
             "        if held := self._take_buffer():\n            self._client._drive(",
             "        if held := self._take_buffer()[:0]:\n            self._client._drive(",
             "tests/test_prefetch.py -k 'releases or released'",
             "close drops the records fetched ahead without releasing them: they wait out their lease"),
    mutation("PF2", "1", "felix_redis/_driver.py",
             "        taken, self._buffer = self._buffer[:max_records], self._buffer[max_records:]\n",
             "        taken, self._buffer = self._buffer[:max_records], []\n",
             "tests/test_prefetch.py -k max_records_at_a_time",
             "a poll served from what was fetched ahead drops the rest of it (leased, handed to nobody)"),
    mutation("PF3", "1", "felix_redis/_driver.py",
             "        for ref in refs:\n            self._check_ref(ref)\n        return refs\n",
             "        return refs\n",
             "tests/test_prefetch.py -k bad_arguments",
             "a bad ack given to a poll served from what was fetched ahead raises after queuing the good ones"),
    mutation("PF4", "1", "felix_redis/_driver.py",
             "                self._buffer.extend(items[max_records:])\n",
             "                self._buffer = items[max_records:]\n",
             "tests/test_prefetch.py -k two_polls_at_once",
             "a fetch replaces what another poll of the group left in the buffer: those records are lost to it"),
    mutation("PF5", "1", "felix_redis/client.py",
             "            self.holding.add(group)\n", "",
             "tests/test_prefetch.py -k 'dropped and sync'",
             "a group dropped while holding records fetched ahead is not released at the client's close"),
    mutation("PF7", "queued-acks", "felix_redis/asyncio.py",
             "                self._requeue(refs)  # cancelled: they may not have gone (acks are idempotent)\n",
             "                pass\n",
             "tests/test_prefetch.py -k cancelled",
             "a cancelled flush drops the queued acks it took"),
    mutation("PF8", "1", "felix_redis/asyncio.py",
             "            for ref in self._checked_refs(ack):\n                await self.ack(ref, wait=False)\n"
             "            if taken := self._from_buffer(max_records):\n",
             "            taken = self._from_buffer(max_records)\n            for ref in self._checked_refs(ack):\n"
             "                await self.ack(ref, wait=False)\n            if taken:\n",
             "tests/test_prefetch.py -k cancelled",
             "a buffered poll cancelled while it queues its acks has taken records the caller never gets"),
    mutation("WP1", "1", "felix_redis/worker.py",
             "                self._source._release_buffer()\n",
             "                pass\n",
             "tests/test_worker_prefetch.py -k stop_releases",
             "a stopping Worker leaves what it fetched ahead leased until the leases lapse"),
    mutation("WP2", "1", "felix_redis/aioworker.py",
             "                await self._source._release_buffer()\n",
             "                pass\n",
             "tests/test_worker_prefetch.py -k async_worker",
             "a stopping AsyncWorker leaves what it fetched ahead leased until the leases lapse"),
    mutation("WP3", "1", "felix_redis/_runtime.py",
             "                for job in jobs:\n                    job.renewed = leased_at\n",
             "                pass\n",
             "tests/test_worker_prefetch.py -k heartbeat",
             "the heartbeat counts a record's lease from its start, not its fetch: it lapses while it runs"),
    mutation("WP4", "1", "felix_redis/_runtime.py",
             "            self._requeue(finished)\n            finished = []\n",
             "            pass\n",
             "tests/test_worker_prefetch.py -k fewer_polls",
             "finished jobs are reported acked while their acks are only queued on the group"),
    mutation("WP5", "1", "felix_redis/_runtime.py",
             "            extra = {\"prefetch\": self.prefetch} if self.prefetch else {}\n",
             "            extra = {}\n",
             "tests/test_worker_prefetch.py -k shard_subset",
             "a worker of some shards ignores its prefetch"),
    mutation("WP6", "1", "lua/group_nack.lua",
             "if attempts >= S.max and not release then\n",
             "if attempts >= S.max then\n",
             "tests/test_worker_prefetch.py -k last_attempt",
             "a record fetched ahead on its last attempt and released at stop becomes a dead letter without running"),
    mutation("PF9", "1", "lua/group_nack.lua",
             "    redis.call('HSET', K.attempts, m, attempts - 1)  -- its next delivery is this one again\n",
             "    redis.call('HSET', K.attempts, m, attempts)  -- its next delivery is this one again\n",
             "tests/test_prefetch.py -k release_does_not_count",
             "a release counts the delivery of a redelivered record fetched ahead and never handed out"),
    mutation("PF10", "bad input", "lua/group_nack.lua",
             "if release ~= '' and release ~= '1' then fail(",
             "if false then fail(",
             "tests/test_prefetch.py -k crafted_release",
             "a crafted release flag other than '1' is taken as a nack instead of refused"),
    mutation("PF11", "1", "felix_redis/client.py",
             "            if taken := self._from_buffer(max_records):\n                return taken\n",
             "            return self._from_buffer(max_records)\n",
             "tests/test_prefetch.py -k emptied_under",
             "a poll whose buffer another poll emptied under it returns nothing while records are due"),
    mutation("PF12", "1", "felix_redis/_driver.py",
             "        if self._buffer_pid != (pid := os.getpid()):\n",
             "        if False and self._buffer_pid != (pid := os.getpid()):\n",
             "tests/test_prefetch.py -k forked",
             "a forked child (of the sync or the asyncio client) hands out its parent's records fetched ahead"),
    mutation("PF13", "1", "felix_redis/asyncio.py",
             "    task = asyncio.ensure_future(release)\n",
             "    task = asyncio.ensure_future(release)\n    return await task\n",
             "tests/test_prefetch.py -k cancelled_before_its_call",
             "an asyncio release cancelled before its call went leaves the records leased until their leases lapse"),
    mutation("PF14", "1", "felix_redis/asyncio.py",
             "            await asyncio.wait(list(self._releases), timeout=5.0)\n",
             "            pass\n",
             "tests/test_prefetch.py -k cancelled_before_its_call",
             "an asyncio client closed while a release cut off from its caller runs leaves its connection open"),
    mutation("WP8", "1", "felix_redis/_runtime.py",
             "        if self.prefetch and self._source.fetched_ahead and now - self._source.fetched_at >= self._late",
             "        if False and self._source.fetched_ahead and now - self._source.fetched_at >= self._late",
             "tests/test_worker_prefetch.py -k most_of_its_lease",
             "the heartbeat leaves records fetched ahead in the buffer until their leases lapse there"),
    mutation("WP9", "1", "felix_redis/_runtime.py",
             "        if leased_at is not None and time.monotonic() - leased_at >= self._late_after():\n",
             "        if False:\n",
             "tests/test_worker_prefetch.py -k held_up",
             "with its heartbeat held up, a Worker runs records that waited in its buffer past their leases"),
    mutation("WS3", "1", "felix_redis/worker.py",
             "        self._release_many(given_up)\n        self._done.set()\n",
             "        self._done.set()\n",
             "tests/test_worker.py -k worker_interrupted_again",
             "a Worker whose shutdown was cut short keeps the given-up jobs' slots: run() again handles nothing"),
    mutation("WS1", "1", "felix_redis/aioworker.py",
             "            await self._shut_down()\n        except BaseException:\n            self._cut_short()\n",
             "            await self._shut_down()\n        except BaseException:\n            pass\n",
             "tests/test_worker.py -k async_worker_cancelled_again",
             "an AsyncWorker cancelled again in its shutdown leaves its heartbeat extending the given-up leases"),
    mutation("WS2", "1", "felix_redis/worker.py",
             "        self._release_many(given_up)\n        self._done.set()\n",
             "        self._release_many(given_up)\n",
             "tests/test_worker.py -k worker_interrupted_again",
             "a Worker interrupted again in its shutdown keeps its heartbeat thread extending the given-up leases"),
]


# ------------------------------------------------------------------------- running


@dataclass
class Result:
    mutation: Mutation
    outcome: str  # killed, SURVIVED, stale, unproven, error, timeout
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Copy:
    """A copy of the tracked files in a temporary directory."""

    root: Path
    lock: threading.Lock = field(default_factory=threading.Lock)


def tracked_files() -> list[str]:
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    return [p for p in done.stdout.decode().split("\0") if p]


def make_copy(files: list[str], into: Path) -> Copy:
    for rel in files:
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree
            continue
        dst = into / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    return Copy(into)


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_copy_is_what_runs(copy: Path) -> None:
    """Python started as the runs are imports felix_redis, felixctl and the tests'
    helpers from the copy, not from the working tree (an editable install would)."""
    probe = ("import felix_redis, felixctl, tests.conftest, felix_redis.scripts as s; "
             "print(felix_redis.__file__); print(felixctl.__file__); print(tests.conftest.__file__); "
             "print(s.lua_dir())")
    done = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=environment(copy),
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"mutate: the copy does not import: {done.stderr.strip()}")
    for line in done.stdout.split():
        if not Path(line).resolve().is_relative_to(copy.resolve()):
            raise SystemExit(f"mutate: {line} is imported from outside the copy {copy}; refusing to run")


def run_pytest(copy: Path, tests: str, timeout: float) -> tuple[int | None, str]:
    """(pytest's exit code, or None on a timeout; the tail of its output)."""
    args = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--hypothesis-profile", "mutate",
            *shlex.split(tests)]
    proc = subprocess.Popen(args, cwd=copy, env=environment(copy), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        # SIGINT first: pytest runs its fixtures' teardown (servers it started stop)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        return None, out


def run_one(copy: Copy, m: Mutation, timeout: float) -> Result:
    target = copy.root / m.path
    with copy.lock:
        pristine = target.read_text()
        try:
            mutated = m.apply(pristine)
        except ValueError as exc:
            return Result(m, "stale", 0.0, str(exc))
        start = time.monotonic()
        target.write_text(mutated)
        try:
            code, out = run_pytest(copy.root, m.tests, timeout)
        finally:
            target.write_text(pristine)
        took = time.monotonic() - start
    tail = "\n".join(out.strip().splitlines()[-3:])
    if code is None:
        return Result(m, "timeout", took, tail)
    outcome = {0: "SURVIVED", 1: "killed"}.get(code, "error")
    return Result(m, outcome, took, tail if outcome != "killed" else _first_failure(out))


def _first_failure(out: str) -> str:
    for line in out.splitlines():
        if line.startswith("FAILED ") or line.startswith("ERROR "):
            return line[:160]
    return ""


def table(results: list[Result]) -> str:
    rows = [("id", "G", "file", "result", "secs", "what")]
    rows += [(r.mutation.id, r.mutation.guarantee, r.mutation.path, r.outcome, f"{r.seconds:.0f}", r.mutation.what)
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(widths[i]) if i < 5 else cell for i, cell in enumerate(row)) for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these mutations only")
    parser.add_argument("--list", action="store_true", help="list the mutations and whether each applies")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at once, each in its own copy")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutation (default 600)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="do not first run each test selection on the unmutated code")
    args = parser.parse_args(argv)

    chosen = MUTATIONS
    if args.only:
        unknown = set(args.only) - {m.id for m in MUTATIONS}
        if unknown:
            parser.error(f"no such mutation: {', '.join(sorted(unknown))}")
        chosen = [m for m in MUTATIONS if m.id in args.only]
    if len({m.id for m in MUTATIONS}) != len(MUTATIONS):
        raise SystemExit("mutate: two mutations share an id")

    if args.list:
        stale = 0
        for m in chosen:
            try:
                m.apply((ROOT / m.path).read_text())
                state = "applies"
            except (ValueError, OSError) as exc:
                state, stale = f"STALE: {exc}", stale + 1
            print(f"{m.id:5} G{m.guarantee:11} {m.path:28} {state}\n      {m.what}\n      pytest {m.tests}")
        return 1 if stale else 0

    started = time.monotonic()
    files = tracked_files()
    with tempfile.TemporaryDirectory(prefix="felix-mutate-") as tmp:
        copies = []
        for i in range(max(1, args.jobs)):
            copies.append(make_copy(files, Path(tmp) / f"tree{i}"))
        check_copy_is_what_runs(copies[0].root)
        print(f"mutate: {len(chosen)} mutations, {len(copies)} cop{'y' if len(copies) == 1 else 'ies'} under {tmp}",
              flush=True)
        results: list[Result] = []
        free = list(copies)
        free_lock = threading.Lock()
        failing: dict[str, str] = {}  # test selection -> why it fails without a mutation

        def baseline(tests: str) -> None:
            with free_lock:
                copy = free.pop()
            try:
                with copy.lock:
                    start = time.monotonic()
                    code, out = run_pytest(copy.root, tests, args.timeout)
            finally:
                with free_lock:
                    free.append(copy)
            state = "passes" if code == 0 else f"FAILS (exit {code})"
            print(f"  baseline {state:15} {time.monotonic() - start:5.0f}s  pytest {tests}", flush=True)
            if code != 0:
                failing[tests] = f"without the mutation: exit {code}\n{_first_failure(out) or out[-500:]}"

        if not args.no_baseline:
            selections = list(dict.fromkeys(m.tests for m in chosen))
            with concurrent.futures.ThreadPoolExecutor(len(copies)) as pool:
                list(pool.map(baseline, selections))

        def work(m: Mutation) -> Result:
            if m.tests in failing:
                result = Result(m, "unproven", 0.0, failing[m.tests])
            else:
                with free_lock:
                    copy = free.pop()
                try:
                    result = run_one(copy, m, args.timeout)
                finally:
                    with free_lock:
                        free.append(copy)
            first = result.detail.splitlines()[0] if result.detail else ""
            print(f"  {m.id:5} {result.outcome:8} {result.seconds:5.0f}s  {first}", flush=True)
            return result

        with concurrent.futures.ThreadPoolExecutor(len(copies)) as pool:
            results = list(pool.map(work, chosen))
    print()
    print(table(results))
    counts = {o: sum(r.outcome == o for r in results)
              for o in ("killed", "SURVIVED", "stale", "unproven", "error", "timeout")}
    print(f"\n{counts['killed']} of {len(results)} killed; " + ", ".join(f"{n} {o}" for o, n in counts.items()
                                                                        if o != "killed" and n)
          + f" ({time.monotonic() - started:.0f} s)")
    for r in results:
        if r.outcome not in ("killed",):
            print(f"\n{r.mutation.id} {r.outcome}: {r.mutation.what}\n{r.detail}")
    return 0 if counts["killed"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
