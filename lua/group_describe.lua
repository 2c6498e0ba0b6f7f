-- group_describe: a group's state on one shard, for operators. Writes nothing.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- (no ARGV)
--
-- KEYS[14] due   zset: the shard's due index (optional: without it no record counts as
--                scheduled; lua/includes/group.lua)
-- Returns: {position, tail, next, owed, in_flight, dead, oldest unfinished age ms (-1:
-- none), trimmed, vt_ms, max_attempts, now ms, scheduled, pending adjustment, rate limit
-- ('COUNT PER_MS' or nil)}. next and trimmed include records retention removed before the
-- group polled past them. position is the smallest unfinished offset (redriven records
-- included); owed counts lapsed leases too. scheduled: delayed records not yet due (a
-- record retention trimmed before its due time counts until then); pending is tail -
-- next + the adjustment (delayed records above next not yet due are not pending; ones
-- the group passed over whose due time came, before a poll hands them out, are). The
-- oldest age is of the first unfinished record that is due (a delayed one ages from its
-- due time), looked for among the 1000 records from the position and 100 from next.
-- Errors: FELIX_NOT_FOUND, FELIX_WRONGTYPE.
--- @include "group"
--- @include "runs"
--- @include "records"
--- @include "due"
local K = group_role_keys()
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
-- delayed records: not yet due (scheduled), and passed over but due (pending)
local scheduled, passed_due, adjust = 0, 0, 0
if K.due and (S.dmax > math.min(now, S.dcur) or S.doff) then
  if S.dmax > now then
    scheduled = due_count_after(K.due, now)
    -- delayed records below where the group started are not its own
    local dpre = tonumber(redis.call('HGET', K.group, 'dpre'))
    if dpre and dpre > now then
      due_each(K.due, now, dpre, function(_, a, z)
        if a < S.base then scheduled = scheduled - (math.min(z, S.base - 1) - a + 1) end
      end)
    end
  end
  if (S.dmax > S.dcur and now > S.dcur) or S.doff then
    -- passed over (in [base, next)), after the due cursor and due by now (inside the due
    -- time the cursor stands in, above its last offset handled)
    local upto = math.max(now, S.dcur)
    local function count(a, z)
      a, z = math.max(a, S.base), math.min(z, S.next - 1)
      if z >= a then passed_due = passed_due + z - a + 1 end
    end
    if S.doff then
      local rd, ra, rz = due_bucket_ranges(K.due, due_bucket(S.dcur))
      for i = 1, #rd do
        if rd[i] == S.dcur and rz[i] > S.doff then count(math.max(ra[i], S.doff + 1), rz[i]) end
      end
    end
    due_each(K.due, S.dcur, upto, function(_, a, z) count(a, z) end)
  end
  local passed_future = math.max(0, S.sk - passed_due)
  adjust = passed_due - math.max(0, scheduled - passed_future)
end
-- The age of the first unfinished record that is due (from its due time if delayed).
local function due_age(entry)
  local off, ms = parse_id(entry[1])
  local f = entry[2]
  local from = tonumber(ms)
  if off <= S.tlast and not plain_fields(f) then
    local _, _, _, d = record_fields(f, entry[1])
    if d then
      if tonumber(d) > now then return false end
      from = math.max(from, tonumber(d))
    end
  end
  if off < S.next and off >= position and is_finished(K, S, fmt(off), off) then return false end
  return math.max(0, now - from)
end
local age = -1
if position < S.tail then
  if S.tlast < position then
    local e = redis.call('XRANGE', K.log, fmt(position), '+', 'COUNT', 1)
    if #e > 0 then
      local _, ms = parse_id(e[1][1])
      age = math.max(0, now - tonumber(ms))
    end
  else
    local from, seen = position, 0
    while age < 0 and seen < 1000 and from < S.tail do
      local es = redis.call('XRANGE', K.log, fmt(from), '+', 'COUNT', 100)
      if #es == 0 then break end
      for _, e in ipairs(es) do
        local a = due_age(e)
        if a then age = a break end
      end
      seen = seen + #es
      from = parse_id(es[#es][1]) + 1
    end
    if age < 0 and from < S.next then
      for _, e in ipairs(redis.call('XRANGE', K.log, fmt(S.next), '+', 'COUNT', 100)) do
        local a = due_age(e)
        if a then age = a break end
      end
    end
  end
end
-- records retention removed before this group got to them, not yet counted by a poll
local lost = math.max(0, first - S.next)
return {position, S.tail, S.next + lost, owed, in_flight, redis.call('HLEN', K.dead), age, S.trimmed + lost,
  S.vt, S.max, now, scheduled, adjust, S.rate}
