-- group_dead_letters: list a group's dead letters on one shard. Writes nothing.
--
-- KEYS[1..13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] group
-- KEYS[4] lease
-- KEYS[5] owed
-- KEYS[6] attempts
-- KEYS[7] done
-- KEYS[8] redo
-- KEYS[9] dead
-- KEYS[10] owner
-- KEYS[11] byowner
-- KEYS[12] wake
-- KEYS[13] held
-- (no ARGV)
--
-- Returns: flat list OFFSET, "ATTEMPTS|MS|REASON", ... in no particular order.
-- Errors: FELIX_NOT_FOUND, FELIX_WRONGTYPE.
--- @include "group"
local K = group_keys()
load_group(K)
return redis.call('HGETALL', K.dead)
