-- stream_info: read one shard's settings, offsets and group names. Writes nothing.
--
-- KEYS[1] meta    hash: settings, tail, first
-- KEYS[2] log     stream: the records
-- KEYS[3] groups  set: names of the groups on this shard
-- (no ARGV)
--
-- Returns: {meta as a flat field/value list, group names, log length, now ms}.
-- Errors: FELIX_NOT_FOUND (no such stream or shard), FELIX_WRONGTYPE.
expect_type(KEYS[1], 'hash')
expect_type(KEYS[2], 'stream')
expect_type(KEYS[3], 'set')
local meta = redis.call('HGETALL', KEYS[1])
if #meta == 0 then fail('NOT_FOUND', 'stream (or shard) does not exist') end
return {meta, redis.call('SMEMBERS', KEYS[3]), redis.call('XLEN', KEYS[2]), now_ms()}
