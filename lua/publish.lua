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
-- Returns: {first offset, count, publish time ms (a string), 1 if a duplicate re-send else 0,
-- first offset kept in the log (a string; the client trims when the log outgrows its
-- retention)}. The two strings are passed on as Redis gave them: no number is parsed
-- or formatted for them.
-- Errors: FELIX_NOPERM (no stream.publish role), FELIX_NOT_FOUND (no such stream or shard), FELIX_INVALID (oversize payload, bad
-- argument), FELIX_SEQUENCE (sequence older than the last or with a gap), FELIX_WRONGTYPE.
--- @include "acl"
require_stream_role('stream.publish')
local count = #ARGV - 4
if count < 1 or count > 10000 then fail('INVALID', 'a publish carries 1 to 10000 payloads') end
local key, pid, seq_s, idle = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local seq = int_arg(seq_s, 'sequence', 0, 2 ^ 52)
-- the same few idle times come every call: checked once (idle is passed on as the string)
int_arg_seen(idle, 'producer idle_ms', 1, 2 ^ 40)
-- Type checks ride on the first command on each key, all before the first write: the
-- meta read, the producer read, and the first XADD (the first write itself).
local m = typed_call('hash', 'HMGET', KEYS[1], 'tail', 'max_payload', 'created', 'first')
local tail_s = m[1]
if not tail_s then fail('NOT_FOUND', 'stream (or shard) does not exist') end
local max_payload, epoch = setting_num(m[2]), m[3]
for i = 5, #ARGV do
  if #ARGV[i] > max_payload then
    fail('INVALID', 'payload ' .. fmt(i - 5) .. ' is ' .. fmt(#ARGV[i]) .. ' bytes; this stream accepts at most '
      .. fmt(max_payload))
  end
end
if pid ~= '' then
  if seq < 1 then fail('INVALID', 'sequence must be >= 1') end
  local state = typed_call('string', 'GET', KEYS[3])
  -- state: 'EPOCH SEQ FIRST COUNT MS'. The next sequence, the usual case, needs only
  -- the epoch (compared in place) and SEQ (cut out with plain finds); the whole state is
  -- matched for a re-send or a refusal, and one this script did not write counts as none.
  local last
  if state and epoch then
    local n = #epoch
    if s_byte(state, n + 1) == 32 and s_find(state, epoch, 1, true) == 1 then
      local j = s_find(state, ' ', n + 2, true)
      last = j and tonumber(s_sub(state, n + 2, j - 1))
    end
  end
  if last and seq ~= last + 1 then
    local _, _, first, n, ms = s_match(state, '^(%d+) (%d+) (%d+) (%d+) (%d+)$')
    if first then
      if seq == last then
        if tonumber(n) ~= count then
          fail('SEQUENCE', 'sequence ' .. fmt(seq) .. ' was sent before with ' .. n .. ' records, now '
            .. fmt(count))
        end
        redis.call('PEXPIRE', KEYS[3], idle)
        return {tonumber(first), count, ms, 1, m[4]}
      elseif seq < last then
        fail('SEQUENCE', 'sequence ' .. fmt(seq) .. ' is older than the last one (' .. fmt(last) .. ')')
      end
      fail('SEQUENCE', 'sequence gap: got ' .. fmt(seq) .. ', expected ' .. fmt(last + 1))
    end
  end
end
-- Entry IDs and the producer state are made of the strings Redis handed over (the tail
-- as HMGET read it, the time as TIME gave it): only the new tail is formatted.
local ms = now_ms_text()
local log, p, k = KEYS[2], 'p', 'k'
-- the first XADD is the first write: it doubles as the log's type check
if key ~= '' then
  typed_call('stream', 'XADD', log, tail_s .. '-' .. ms, p, ARGV[5], k, key)
else
  typed_call('stream', 'XADD', log, tail_s .. '-' .. ms, p, ARGV[5])
end
local tail, count_s = tonumber(tail_s), '1'
if count > 1 then
  count_s = fmt(count)
  for i = 6, #ARGV do
    local id = fmt(tail + i - 5) .. '-' .. ms
    if key ~= '' then
      redis.call('XADD', log, id, p, ARGV[i], k, key)
    else
      redis.call('XADD', log, id, p, ARGV[i])
    end
  end
end
redis.call('HSET', KEYS[1], 'tail', fmt(tail + count))
if pid ~= '' then
  redis.call('SET', KEYS[3], epoch .. ' ' .. seq_s .. ' ' .. tail_s .. ' ' .. count_s .. ' ' .. ms, 'PX', idle)
end
return {tail, count, ms, 0, m[4]}
