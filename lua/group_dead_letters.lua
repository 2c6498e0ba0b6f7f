-- group_dead_letters: list a group's dead letters on one shard. Writes nothing.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[14] due        zset: the shard's due index (lua/includes/group.lua)
-- (no ARGV)
--
-- Returns: flat list OFFSET, "ATTEMPTS|MS|REASON", ... in no particular order.
-- Errors: FELIX_NOT_FOUND, FELIX_WRONGTYPE.
--- @include "group"
local K = group_role_keys()
load_group(K)
return redis.call('HGETALL', K.dead)
