-- stream_read: read records from one shard in offset order, for subscribers and replay.
-- Independent of groups. Writes nothing.
--
-- KEYS[1] meta    hash: tail, first
-- KEYS[2] log     stream: the records
-- ARGV[1] from    integer >= 0, first offset wanted
-- ARGV[2] count   integer 1..10000, most records returned
--
-- Returns: {tail, first offset still in the log, n, then n times: offset, publish ms,
-- key (nil when none; {key, headers, due ms, expiry ms} for a record with any of the last
-- three: lua/includes/records.lua), payload}.
-- Errors: FELIX_NOT_FOUND (no such stream or shard), FELIX_INVALID (bad argument, keys not
-- the meta and log of one shard), FELIX_WRONGTYPE.
--- @include "acl"
--- @include "records"
require_shard_keys(SHARD_KEYS_READ)
local from = int_arg(ARGV[1], 'from offset', 0, 2 ^ 52)
local count = int_arg(ARGV[2], 'count', 1, 10000)
expect_type(KEYS[1], 'hash')
expect_type(KEYS[2], 'stream')
if redis.call('EXISTS', KEYS[1]) == 0 then fail('NOT_FOUND', 'stream (or shard) does not exist') end
local tail = shard_tail(redis.call('HGET', KEYS[1], 'tail'), KEYS[2])
local out = {tail, log_first(KEYS[2], tail), 0}
local entries = redis.call('XRANGE', KEYS[2], fmt(from), '+', 'COUNT', count)
for _, e in ipairs(entries) do
  local off, ms = parse_id(e[1])
  local payload, key, h, d, x = record_fields(e[2], e[1])
  key = key_slot(key, h, d, x)
  out[#out + 1] = off
  out[#out + 1] = ms
  out[#out + 1] = key
  out[#out + 1] = payload
end
out[3] = #entries
return out
