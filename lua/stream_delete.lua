-- stream_delete: delete one shard of a stream with all its groups and records.
-- The caller lists the shard's groups (SMEMBERS groups) and passes their keys; the
-- script refuses if that list is out of date, so no group key is left behind.
--
-- KEYS[1] meta      hash: tail, first, producer states
-- KEYS[2] log       stream: the records
-- KEYS[3] groups    set: names of the groups on this shard
-- KEYS[4] conf      hash: the shard's settings
-- KEYS[5..] group keys, 11 per group in felix_redis.keys.GROUP_ROLES order, exactly the
--                   keys of the groups ARGV names
-- KEYS[last] due    zset (optional, after the group keys): the shard's due index, then
--                   (optional) sched (zset) and schedules (hash), the shard's recurring
--                   schedules (docs/schedules.md); all deleted with the shard
-- ARGV[1] count     integer, number of groups passed
-- ARGV[2..] names   the group names, in the order of their keys
--
-- Role: stream.admin, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:admin, derived from KEYS[1]; never passed nor accessed.
-- Returns: 1 when deleted, 0 when the shard did not exist (safe to run twice).
-- Errors: FELIX_NOPERM (no stream.admin role), FELIX_INVALID (arguments do not match, or a key is not the one
-- the shard and the group names imply), FELIX_CONFLICT (the group list changed
-- since the caller read it: read again and retry), FELIX_WRONGTYPE (any key passed,
-- group keys included, holds another type: nothing is deleted).
--- @include "shard_groups"
require_stream_role('stream.admin')
local count = shard_groups(11, {'due', 'sched', 'schedules'})
for g = 0, count - 1 do
  for i, rt in ipairs(GROUP_ROLE_TYPES) do expect_type(KEYS[4 + 11 * g + i], rt[2]) end
end
if redis.call('SCARD', KEYS[3]) ~= count then fail('CONFLICT', 'the groups changed; retry') end
for i = 1, count do
  if redis.call('SISMEMBER', KEYS[3], ARGV[i + 1]) == 0 then fail('CONFLICT', 'the groups changed; retry') end
end
local existed = redis.call('EXISTS', KEYS[1]) == 1 and 1 or redis.call('EXISTS', KEYS[4])
for i = 1, #KEYS do redis.call('DEL', KEYS[i]) end
return existed
