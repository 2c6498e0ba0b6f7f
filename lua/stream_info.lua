-- stream_info: read one shard's settings, offsets and group names. Writes nothing.
--
-- KEYS[1] meta    hash: settings, tail, first
-- KEYS[2] log     stream: the records
-- KEYS[3] groups  set: names of the groups on this shard
-- (no ARGV)
--
-- Returns: {the settings and offsets in meta as a flat field/value list (fields absent
-- from the hash left out), group names, log length, now ms}.
-- Errors: FELIX_NOT_FOUND (no such stream or shard), FELIX_WRONGTYPE.
expect_type(KEYS[1], 'hash')
expect_type(KEYS[2], 'stream')
expect_type(KEYS[3], 'set')
-- the settings and offsets by name: the hash also holds a field per idempotent producer
-- (lua/publish.lua), any number of them, which this reply leaves out
local FIELDS = {'kind', 'shards', 'shard', 'replication', 'consistency', 'max_len', 'max_age', 'max_payload',
  'name', 'mode', 'spread', 'tail', 'first', 'created'}
local got = redis.call('HMGET', KEYS[1], unpack(FIELDS))
local meta = {}
for i, f in ipairs(FIELDS) do
  if got[i] then
    meta[#meta + 1] = f
    meta[#meta + 1] = got[i]
  end
end
if #meta == 0 then fail('NOT_FOUND', 'stream (or shard) does not exist') end
return {meta, redis.call('SMEMBERS', KEYS[3]), redis.call('XLEN', KEYS[2]), now_ms()}
