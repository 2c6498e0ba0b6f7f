-- group_nack: hand a record back: owed again after delay_ms, or a dead letter when its
-- deliveries reached max_attempts. Needs the current claim.
--
-- KEYS[1] meta       hash: shard settings, tail (next offset), first (first offset kept)
-- KEYS[2] log        stream: the records, entry ID OFFSET-PUBLISHMS
-- KEYS[3] group      hash: vt (ms), max (attempts), pos, next, wseq, cons, trimmed, top
--                    (FIRST-LAST: the highest finished run above pos), created
-- KEYS[4] lease      zset: leases, member = the FIRST offset of a range of in-flight
--                    records (KEYS[13]), score = its expiry (ms)
-- KEYS[5] owed       zset: offsets waiting for redelivery, score = due time (ms)
-- KEYS[6] attempts   hash: offset -> deliveries so far, for unfinished delivered records
-- KEYS[7] done       zset: runs of finished offsets above the position (below top),
--                    member FIRST scored LAST
-- KEYS[8] redo       zset: redriven offsets below the position, score = offset
-- KEYS[9] dead       hash: offset -> "ATTEMPTS|MS|REASON" dead-letter pointers
-- KEYS[10] owner     hash: offset -> consumer name holding the lease (named consumers)
-- KEYS[11] byowner   zset: "CONSUMER|OFFSET" members, score 0, for reclaim
-- KEYS[12] wake      stream: one entry per wake-up, long-polling consumers block on it
-- KEYS[13] held      zset: the leases' ranges, member FIRST offset scored LAST offset
-- ARGV[1] offset      integer, the record
-- ARGV[2] attempts    integer >= 1, the claim's attempts
-- ARGV[3] delay_ms    integer 0..604800000, redeliver no sooner than this
--
-- Role: group.consume, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:consume, derived from KEYS[3]; never passed nor accessed.
-- Returns: 1 when owed again, 2 when it became a dead letter.
-- Errors: FELIX_NOPERM (no group.consume role), FELIX_STALE_CLAIM (lease lapsed, redelivered or finished), FELIX_NOT_FOUND,
-- FELIX_INVALID (negative or huge delay, bad number), FELIX_WRONGTYPE.
--- @include "group"
require_group_role('group.consume')
local off = int_arg(ARGV[1], 'offset', 0, 2 ^ 52)
local attempts = int_arg(ARGV[2], 'attempts', 1, 2 ^ 52)
local delay = int_arg(ARGV[3], 'delay_ms', 0, 604800000)
local K = group_keys()
local S = load_group(K)
local now = now_ms()
local m, lease = check_claim(K, S, off, attempts, now)
local status
if attempts >= S.max then
  dead_letter(K, S, off, attempts, 'max_attempts reached: nacked', now)
  status = 2
else
  unlease(K, {off}, lease)
  release_owner(K, S, m)
  redis.call('HSET', K.attempts, m, attempts)
  redis.call('ZADD', K.owed, now + delay, m)
  wake(K, S)
  status = 1
end
save_group(K, S)
return status
