-- group_delete: delete a consumer group on one shard with all its state. The records
-- stay in the log. Safe to run twice. The name stays in the groups set: a group manager
-- may add names to it but never remove one (that could make retention drop another
-- group's records); a name without a group hash counts as no group (stream_info,
-- stream_trim); stream_delete (stream.admin) removes the set.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[14] due        zset: the shard's due index (not touched)
-- KEYS[15] groups    set: names of the groups on this shard
-- ARGV[1] name       the group name: the one KEYS[3] is of
-- ARGV[2] check      '1': validate only and write nothing; '0': delete
--
-- Role: group.manage, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:manage, derived from KEYS[3]; never passed nor accessed.
-- Returns: 1 when deleted (or, with check=1, when it exists), 0 when it does not.
-- Errors: FELIX_NOPERM (no group.manage role), FELIX_INVALID (keys of another shard or group, a name not the
-- group's), FELIX_WRONGTYPE.
--- @include "group"
require_group_role('group.manage')
local K = group_role_keys()
if ARGV[1] ~= group_shape().group then
  fail('INVALID', 'ARGV[1] names group ' .. tostring(ARGV[1]) .. ', KEYS are those of group ' .. group_shape().group)
end
for _, kt in ipairs(GROUP_KEY_TYPES) do expect_type(K[kt[1]], kt[2]) end
expect_type(KEYS[#KEYS], 'set')
local existed = redis.call('EXISTS', K.group)
if ARGV[2] == '1' then return existed end
for i = 3, 13 do redis.call('DEL', KEYS[i]) end
return existed
