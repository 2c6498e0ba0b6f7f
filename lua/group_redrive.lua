-- group_redrive: make dead letters owed again, due now, with attempts starting over. A
-- redriven record is unfinished again, so the reported position is never above it.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[14] due        zset: the shard's due index (lua/includes/group.lua)
-- ARGV[1] mode        'all' (a chunk of all dead letters) or 'list' (the offsets given)
-- ARGV[2] cursor      HSCAN cursor for 'all' ('0' to start), ignored for 'list'
-- ARGV[3..] offsets   for 'list': 1..10000 offsets (integers) of dead letters
--
-- Role: group.manage, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:manage, derived from KEYS[3]; never passed nor accessed.
-- Returns: {records redriven, next cursor ('0' when done)}.
-- Errors: FELIX_NOPERM (no group.manage role), FELIX_NOT_FOUND (group; an offset that is not a dead letter; for redrive, a
-- record trimmed from the log), FELIX_INVALID, FELIX_WRONGTYPE. In 'list' mode every
-- offset is checked before anything is written.
--- @include "group"
--- @include "dead_letters"
require_group_role('group.manage')
local K = group_role_keys()
local S = load_group(K)
local targets, cursor = dead_targets(K, 'redrive', true)
local now = now_ms()
local count = 0
for _, m in ipairs(targets) do
  if redis.call('HDEL', K.dead, m) == 1 then
    local off = tonumber(m)
    if off < S.pos then redis.call('ZADD', K.redo, off, m) else unfinish_above(K, S, off) end
    redis.call('HDEL', K.attempts, m)
    redis.call('ZADD', K.owed, now, m)
    count = count + 1
  end
end
if count > 0 then wake(K, S) end
save_group(K, S)
return {count, cursor}
