-- group_describe: a group's state on one shard, for operators. Writes nothing.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- (no ARGV)
--
-- Returns: {position, tail, next, owed, in_flight, dead, oldest unfinished age ms (-1:
-- none), trimmed, vt_ms, max_attempts, now ms}. next and trimmed include records
-- retention removed before the group polled past them. position is the smallest unfinished
-- offset (redriven records included); owed counts lapsed leases too.
-- Errors: FELIX_NOT_FOUND, FELIX_WRONGTYPE.
--- @include "group"
local K = group_keys()
local S = load_group(K)
local now = now_ms()
local position = S.pos
-- the first record kept, from the log (meta's 'first' is a hint publishers may write)
local first = log_first(K.log, S.tail)
-- everything delivered is finished and retention removed what came next
if S.pos == S.next and first > S.pos then position = first end
local r = redis.call('ZRANGE', K.redo, 0, 0, 'WITHSCORES')
if #r > 0 and tonumber(r[2]) < position then position = tonumber(r[2]) end
-- each lease covers FIRST..LAST (the held key's score of FIRST)
local lapsed, in_flight = 0, 0
local leases = redis.call('ZRANGE', K.lease, '0', '-1', 'WITHSCORES')
if #leases > 0 then
  local firsts = {}
  for i = 1, #leases, 2 do firsts[#firsts + 1] = leases[i] end
  local lasts = {}
  if K.types.held ~= 'none' then lasts = call_many('ZMSCORE', K.held, firsts) end
  for j, f in ipairs(firsts) do
    local size = tonumber(lasts[j] or f) - tonumber(f) + 1
    if tonumber(leases[2 * j]) <= now then lapsed = lapsed + size else in_flight = in_flight + size end
  end
end
local owed = redis.call('ZCARD', K.owed) + lapsed
local age = -1
if position < S.tail then
  local e = redis.call('XRANGE', K.log, fmt(position), '+', 'COUNT', 1)
  if #e > 0 then
    local _, ms = parse_id(e[1][1])
    age = math.max(0, now - tonumber(ms))
  end
end
-- records retention removed before this group got to them, not yet counted by a poll
local lost = math.max(0, first - S.next)
return {position, S.tail, S.next + lost, owed, in_flight, redis.call('HLEN', K.dead), age, S.trimmed + lost,
  S.vt, S.max, now}
