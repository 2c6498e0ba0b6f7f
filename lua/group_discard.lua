-- group_discard: drop dead letters for good. The records were already finished, so the
-- position does not change; the records stay in the log until retention removes them.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[14] due        zset: the shard's due index (lua/includes/group.lua)
-- ARGV[1] mode        'all' (a chunk of all dead letters) or 'list' (the offsets given)
-- ARGV[2] cursor      HSCAN cursor for 'all' ('0' to start), ignored for 'list'
-- ARGV[3..] offsets   for 'list': 1..10000 offsets (integers) of dead letters
--
-- Role: group.manage, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:manage, derived from KEYS[3]; never passed nor accessed.
-- Returns: {records discarded, next cursor ('0' when done)}.
-- Errors: FELIX_NOPERM (no group.manage role), FELIX_NOT_FOUND (group; an offset that is not a dead letter), FELIX_INVALID,
-- FELIX_WRONGTYPE. In 'list' mode every offset is checked before anything is written.
--- @include "group"
--- @include "dead_letters"
require_group_role('group.manage')
local K = group_role_keys()
load_group(K)
local targets, cursor = dead_targets(K, 'discard')
local count = 0
for _, m in ipairs(targets) do count = count + redis.call('HDEL', K.dead, m) end
return {count, cursor}
