-- publish: append one or more records to one shard, atomically, with dense offsets.
-- With a producer id, the shard remembers the producer's last sequence and its offsets:
-- a re-send of that sequence returns the original offsets and appends nothing.
--
-- KEYS[1] meta         hash: settings, tail (next offset to assign)
-- KEYS[2] log          stream: records as entry ID OFFSET-PUBLISHMS, fields p (payload), k (key)
-- KEYS[3] producer     string: 'EPOCH SEQ FIRST COUNT MS' of the producer's last publish
--                      (any key of the shard's tag when ARGV[2] is '')
-- ARGV[1] key          record key, '' for none
-- ARGV[2] producer_id  decimal producer id, '' for a plain publish
-- ARGV[3] sequence     integer >= 1, the producer's per-shard sequence ('0' when none)
-- ARGV[4] idle_ms      integer, milliseconds the producer state is kept after its last use
-- ARGV[5..] payloads   1..10000 payloads (bytes)
--
-- Role: stream.publish, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:publish, derived from KEYS[1]; never passed nor accessed.
-- Returns: {first offset, count, publish time ms, 1 if a duplicate re-send else 0, first
-- offset kept in the log (the client trims when the log outgrows its retention)}.
-- Errors: FELIX_NOPERM (no stream.publish role), FELIX_NOT_FOUND (no such stream or shard), FELIX_INVALID (oversize payload, bad
-- argument), FELIX_SEQUENCE (sequence older than the last or with a gap), FELIX_WRONGTYPE.
--- @include "acl"
require_stream_role('stream.publish')
local count = #ARGV - 4
if count < 1 or count > 10000 then fail('INVALID', 'a publish carries 1 to 10000 payloads') end
local key, pid = ARGV[1], ARGV[2]
local seq = int_arg(ARGV[3], 'sequence', 0, 2 ^ 52)
local idle = int_arg(ARGV[4], 'producer idle_ms', 1, 2 ^ 40)
-- Type checks ride on the first command on each key, all before the first write: the
-- meta read, the producer read, and the first XADD (the first write itself).
local m = typed_call('hash', 'HMGET', KEYS[1], 'tail', 'max_payload', 'created', 'first')
if not m[1] then fail('NOT_FOUND', 'stream (or shard) does not exist') end
local tail, max_payload, epoch = tonumber(m[1]), tonumber(m[2]), m[3]
for i = 5, #ARGV do
  if #ARGV[i] > max_payload then
    fail('INVALID', 'payload ' .. fmt(i - 5) .. ' is ' .. fmt(#ARGV[i]) .. ' bytes; this stream accepts at most '
      .. fmt(max_payload))
  end
end
if pid ~= '' then
  if seq < 1 then fail('INVALID', 'sequence must be >= 1') end
  local state = typed_call('string', 'GET', KEYS[3])
  if state then
    local e, last, first, n, ms = s_match(state, '^(%d+) (%d+) (%d+) (%d+) (%d+)$')
    if e == epoch then
      last = tonumber(last)
      if seq == last then
        if tonumber(n) ~= count then
          fail('SEQUENCE', 'sequence ' .. fmt(seq) .. ' was sent before with ' .. n .. ' records, now '
            .. fmt(count))
        end
        redis.call('PEXPIRE', KEYS[3], idle)
        return {tonumber(first), count, tonumber(ms), 1, tonumber(m[4])}
      elseif seq < last then
        fail('SEQUENCE', 'sequence ' .. fmt(seq) .. ' is older than the last one (' .. fmt(last) .. ')')
      elseif seq > last + 1 then
        fail('SEQUENCE', 'sequence gap: got ' .. fmt(seq) .. ', expected ' .. fmt(last + 1))
      end
    end
  end
end
local now = now_ms()
local ms = fmt(now)
for i = 5, #ARGV do
  local id = fmt(tail + i - 5) .. '-' .. ms
  -- the first XADD is the first write: it doubles as the log's type check
  local call = redis.call
  if i == 5 then call = function(cmd, ...) return typed_call('stream', cmd, ...) end end
  if key ~= '' then
    call('XADD', KEYS[2], id, 'p', ARGV[i], 'k', key)
  else
    call('XADD', KEYS[2], id, 'p', ARGV[i])
  end
end
redis.call('HSET', KEYS[1], 'tail', fmt(tail + count))
if pid ~= '' then
  redis.call('SET', KEYS[3], epoch .. ' ' .. fmt(seq) .. ' ' .. fmt(tail) .. ' ' .. fmt(count) .. ' ' .. ms,
    'PX', idle)
end
return {tail, count, now, 0, tonumber(m[4])}
