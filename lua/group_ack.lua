-- group_ack: finish records: acked records leave no group state behind and the position
-- advances over any contiguous run of finished records. Idempotent: acking a finished
-- record changes nothing and says so; acking a stale claim whose record is still
-- unfinished (owed or in flight under a newer lease) finishes it.
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
-- ARGV[1..] offsets   1..10000 offsets (integers) of delivered records
--
-- Role: group.consume, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:consume, derived from KEYS[3]; never passed nor accessed.
-- Returns: one status per offset: 1 acked now, 0 already finished.
-- Errors: FELIX_NOPERM (no group.consume role), FELIX_NOT_FOUND (stream, shard, group; an offset never delivered), FELIX_INVALID,
-- FELIX_WRONGTYPE. All offsets are checked before anything is written.
--- @include "group"
require_group_role('group.consume')
if #ARGV < 1 or #ARGV > 10000 then fail('INVALID', 'ack takes 1 to 10000 offsets') end
local ms, offs = offset_args(1)
local K = group_keys()
local S = load_group(K)
local out = ack_many(K, S, ms, offs, true)
save_group(K, S)
return out
