-- schedule_due: the recurring schedules of a shard that are due now (a tick's first step),
-- or all of them (a listing). Writes nothing.
--
-- KEYS[1] sched      zset: schedule name -> next due time (ms since the epoch; +inf: none)
-- KEYS[2] schedules  hash: the schedules' specs, states, payloads, keys and headers
--                    (lua/includes/schedules.lua)
-- ARGV[1] mode       'due': the schedules whose next due time is at or before now; 'all':
--                    every schedule, with its payload, key and headers; 'none': only the time
-- ARGV[2] limit      most schedules returned, 1..10000
--
-- Role: stream.publish or stream.admin, checked first (lua/includes/acl.lua).
-- Returns: {now ms, the earliest next due time after now ('' for none; '' in mode all),
-- 1 when more schedules were due (or there) than limit else 0, then per schedule: name,
-- next due ms (a string; 'inf' for none), spec, state, and in mode 'all' payload, key and
-- headers (false for none)}, in order of next due time.
-- Errors: FELIX_NOPERM (neither role), FELIX_INVALID (bad mode or limit; keys not the
-- shard's sched and schedules), FELIX_WRONGTYPE.
--- @include "schedules"
require_stream_role('stream.publish', 'stream.admin', SCHED_KEYS)
local mode = ARGV[1]
if mode ~= 'due' and mode ~= 'all' and mode ~= 'none' then
  fail('INVALID', "mode must be 'due', 'all' or 'none', got " .. s_sub(tostring(mode), 1, 20))
end
local limit = int_arg(ARGV[2], 'limit', 1, 10000)
local sched, schedules = KEYS[1], KEYS[2]
local now = now_ms()
local out = {fmt(now), '', 0}
expect_type(schedules, 'hash')
if mode == 'none' then
  expect_type(sched, 'zset')
  return out
end
local found
if mode == 'due' then
  found = typed_call('zset', 'ZRANGE', sched, '-inf', fmt(now), 'BYSCORE', 'LIMIT', 0, limit + 1, 'WITHSCORES')
  local after = redis.call('ZRANGE', sched, '(' .. fmt(now), '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
  if after[2] then out[2] = after[2] end
else
  found = typed_call('zset', 'ZRANGE', sched, 0, limit, 'WITHSCORES')
end
if #found > 2 * limit then
  out[3] = 1
  found[#found], found[#found - 1] = nil, nil
end
for i = 1, #found, 2 do
  local name = found[i]
  local f = {name, name .. '|s'}
  if mode == 'all' then f[3], f[4], f[5] = name .. '|p', name .. '|k', name .. '|h' end
  local got = redis.call('HMGET', schedules, unpack(f))
  out[#out + 1] = name
  out[#out + 1] = found[i + 1]
  out[#out + 1] = got[1]
  out[#out + 1] = got[2]
  if mode == 'all' then
    out[#out + 1] = got[3]
    out[#out + 1] = got[4]
    out[#out + 1] = got[5]
  end
end
return out
