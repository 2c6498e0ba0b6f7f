-- stream_info: read one shard's settings, offsets and group names. Writes nothing.
--
-- KEYS[1] meta    hash: tail, first
-- KEYS[2] log     stream: the records
-- KEYS[3] groups  set: names of the groups on this shard (a name whose group hash does not
--                 exist is left out: a group deleted since, or a name a manager added by hand)
-- KEYS[4] conf    hash: the settings and created
-- (no ARGV)
--
-- Returns: {the settings and offsets as a flat field/value list (fields absent left out),
-- group names, log length, now ms}.
-- Errors: FELIX_NOT_FOUND (no such stream or shard), FELIX_INVALID (keys not the shard's
-- meta, log, groups and conf), FELIX_WRONGTYPE.
--- @include "acl"
local base = require_shard_keys(SHARD_KEYS_INFO).base
expect_type(KEYS[1], 'hash')
expect_type(KEYS[2], 'stream')
expect_type(KEYS[3], 'set')
expect_type(KEYS[4], 'hash')
-- the settings and offsets by name: meta also holds a field per idempotent producer
-- (lua/publish.lua), any number of them, which this reply leaves out
local SETTINGS = {'kind', 'shards', 'shard', 'replication', 'consistency', 'max_len', 'max_age', 'max_payload',
  'name', 'mode', 'spread', 'created'}
local got = redis.call('HMGET', KEYS[4], unpack(SETTINGS))
local tail = shard_tail(redis.call('HGET', KEYS[1], 'tail'), KEYS[2])
local meta = {}
for i, f in ipairs(SETTINGS) do
  if got[i] then
    meta[#meta + 1] = f
    meta[#meta + 1] = got[i]
  end
end
if #meta == 0 then fail('NOT_FOUND', 'stream (or shard) does not exist') end
-- the offsets as the log has them (meta's may have been written by hand)
meta[#meta + 1], meta[#meta + 2] = 'tail', fmt(tail)
meta[#meta + 1], meta[#meta + 2] = 'first', fmt(log_first(KEYS[2], tail))
-- a listed name counts when its group hash exists; one this user may not read counts too
local groups = {}
for _, g in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local there = redis.pcall('EXISTS', base .. 'g:' .. g)
  if there ~= 0 then groups[#groups + 1] = g end
end
return {meta, groups, redis.call('XLEN', KEYS[2]), now_ms()}
