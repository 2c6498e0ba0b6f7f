-- group_ack: finish records: acked records leave no group state behind and the position
-- advances over any contiguous run of finished records. Idempotent: acking a finished
-- record changes nothing and says so; acking a stale claim whose record is still
-- unfinished (owed or in flight under a newer lease) finishes it. Each offset is
-- settled on its own: one never delivered is reported (-1) and the others are acked.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[14] due        zset: the shard's due index (lua/includes/group.lua)
-- ARGV[1..] offsets   1..10000 offsets (integers) of delivered records
--
-- Role: group.consume, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:consume, derived from KEYS[3]; never passed nor accessed.
-- Returns: one status per offset: 1 acked now, 0 already finished, -1 never delivered to
-- this group (nothing done for it).
-- Errors: FELIX_NOPERM (no group.consume role), FELIX_NOT_FOUND (stream, shard, group), FELIX_INVALID,
-- FELIX_WRONGTYPE. All offsets are checked (well-formed) before anything is written.
--- @include "group"
--- @include "acks"
require_group_role('group.consume')
if #ARGV < 1 or #ARGV > 10000 then fail('INVALID', 'ack takes 1 to 10000 offsets') end
local ms, offs = offset_args(1)
local K = group_role_keys()
local S = load_group(K)
local out = ack_many(K, S, ms, offs, true, true)
save_group(K, S)
return out
