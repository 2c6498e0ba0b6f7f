-- group_configure: change a group's visibility timeout and/or max attempts on one shard.
-- Leases already granted keep their expiry. Safe to run twice.
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
-- ARGV[1] vt_ms         integer 1..604800000, or '' to keep
-- ARGV[2] max_attempts  integer 1..1000000, or '' to keep
-- ARGV[3] check         '1': validate only and write nothing; '0': configure
--
-- Role: group.manage, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:manage, derived from KEYS[3]; never passed nor accessed.
-- Returns: {vt_ms, max_attempts} as now stored.
-- Errors: FELIX_NOPERM (no group.manage role), FELIX_NOT_FOUND, FELIX_INVALID, FELIX_WRONGTYPE.
--- @include "group"
require_group_role('group.manage')
local K = group_keys()
local vt, max
if ARGV[1] ~= '' then vt = int_arg(ARGV[1], 'visibility_timeout_ms', 1, 604800000) end
if ARGV[2] ~= '' then max = int_arg(ARGV[2], 'max_attempts', 1, 1000000) end
local S = load_group(K)
if ARGV[3] == '1' then return {S.vt, S.max} end
if vt then S.vt = vt; redis.call('HSET', K.group, 'vt', fmt(vt)) end
if max then S.max = max; redis.call('HSET', K.group, 'max', fmt(max)) end
return {S.vt, S.max}
