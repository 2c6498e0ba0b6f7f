-- schedule_fire: publish the due times a tick computed for a shard's schedules (its second
-- step), each at most once. A schedule's record for due time D is appended only when D is
-- later than the last due time it published and than the time it was set, and D is not
-- after now; the same call records D as the last, with the record's offset, and moves the
-- schedule's next due time on (never back). So however many tickers send the same due
-- time, at once, after a crash or again after a lost reply, one record is appended.
--
-- KEYS[1] sched      zset: schedule name -> next due time (ms since the epoch; +inf: none)
-- KEYS[2] schedules  hash: the schedules' specs, states, payloads, keys and headers
--                    (lua/includes/schedules.lua)
-- KEYS[3] meta       hash: tail (next offset), tlast (set to the last offset of a record
--                    with headers)
-- KEYS[4] log        stream: the records (ID OFFSET-PUBLISHMS; fields p, k, h as publish
--                    writes them)
-- KEYS[5] conf       hash: the stream's settings (max_payload, bytes)
-- ARGV[1..] quads    1..2500 of: name; version (V of the state schedule_due read); due (ms,
--                    the schedule's latest due time at or before now, '0' for none: only
--                    move on); next (ms, its first due time after due, 'inf' for none)
--
-- Role: stream.publish or stream.admin, checked first (lua/includes/acl.lua).
-- Returns: per quad its outcome: the offset of the record appended (>= 0); -1 nothing to
-- publish (no due time, or one already published, or not after the time it was set); -2
-- the schedule was deleted or replaced since its due times were computed (nothing done);
-- -3 its payload is larger than the stream accepts now (skipped, moved on).
-- Errors: FELIX_NOPERM (neither role), FELIX_NOT_FOUND (no such stream or shard),
-- FELIX_INVALID (malformed quads, a due time after now, a next time not after due; keys
-- not the shard's sched, schedules, meta, log and conf), FELIX_WRONGTYPE.
--- @include "schedules"
require_stream_role('stream.publish', 'stream.admin', SCHED_KEYS_FIRE)
local n = #ARGV
if n < 4 or n % 4 ~= 0 or n > 10000 then fail('INVALID', 'give 1..2500 quads (name, version, due, next)') end
local sched, schedules, meta, log, conf = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now = now_ms()
-- every argument checked and every state read before the first write
local todo = {}
for i = 1, n, 4 do
  local name = check_schedule_name(ARGV[i])
  local version = int_arg(ARGV[i + 1], 'version', 1, 2 ^ 52)
  local due = int_arg(ARGV[i + 2], 'due ms', 0, 2 ^ 52)
  if due > now then fail('INVALID', 'due time ' .. ARGV[i + 2] .. ' of ' .. name .. ' is after now (' .. fmt(now) .. ')') end
  local next_s = ARGV[i + 3]
  if next_s ~= 'inf' and int_arg(next_s, 'next ms', due + 1, 2 ^ 52) then next_s = fmt(tonumber(next_s)) end
  todo[#todo + 1] = {name = name, version = version, due = due, next = next_s}
end
local max_payload = setting_num(typed_call('hash', 'HGET', conf, 'max_payload'))
if not max_payload then fail('NOT_FOUND', 'stream (or shard) does not exist') end
expect_type(sched, 'zset')
local states = {}
for _, t in ipairs(todo) do
  if states[t.name] == nil then
    local got = typed_call('hash', 'HMGET', schedules, t.name .. '|s', t.name .. '|p', t.name .. '|k', t.name .. '|h')
    local v, a, last = schedule_state(got[1])
    states[t.name] = v and {v = v, a = a, last = last, p = got[2] or '', k = got[3], h = got[4]} or false
  end
end
local m = typed_call('hash', 'HMGET', meta, 'tail')
local tail_s = m[1]
if not tail_s or not s_match(tail_s, '^%d+$') then tail_s = fmt(log_tail(log)) end
local tail, tlast, wrote = tonumber(tail_s), false, false
local ms = fmt(now)
local out = {}
for i, t in ipairs(todo) do
  local st = states[t.name]
  if not st or st.v ~= t.version then
    out[i] = -2
  else
    if t.due == 0 or t.due <= st.a or (st.last and t.due <= st.last) then
      out[i] = -1
    elseif #st.p > max_payload then
      out[i] = -3
    else
      local fields = {'p', st.p}
      if st.k then fields[#fields + 1] = 'k'; fields[#fields + 1] = st.k end
      if st.h then fields[#fields + 1] = 'h'; fields[#fields + 1] = st.h end
      local added = redis.pcall('XADD', log, fmt(tail) .. '-' .. ms, unpack(fields))
      if type(added) == 'table' and added.err then
        local text = tostring(added.err)
        if s_find(text, 'WRONGTYPE', 1, true) then expect_type(log, 'stream') end
        if not s_find(text, 'equal or smaller', 1, true) then error(added, 0) end
        -- a tail below the log's (written by hand): the log's own, then the same XADD
        tail = log_tail(log)
        redis.call('XADD', log, fmt(tail) .. '-' .. ms, unpack(fields))
      end
      out[i] = tail
      wrote = true
      if st.h then tlast = tail end
      st.last = t.due
      redis.call('HSET', schedules, t.name .. '|s',
        fmt(st.v) .. ' ' .. fmt(st.a) .. ' ' .. fmt(t.due) .. ' ' .. fmt(tail))
      tail = tail + 1
    end
    redis.call('ZADD', sched, 'GT', t.next == 'inf' and '+inf' or t.next, t.name)
  end
end
if wrote then
  if tlast then
    redis.call('HSET', meta, 'tail', fmt(tail), 'tlast', fmt(tlast))
  else
    redis.call('HSET', meta, 'tail', fmt(tail))
  end
end
return out
