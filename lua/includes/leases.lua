-- leases: the leases of one group (includes/group.lua's keys lease and held).

--- @include "group"

-- Leases. A lease covers a range of consecutive offsets FIRST..LAST, all in flight under
-- one expiry: the lease key holds member FIRST scored by the expiry (ms), the held key
-- member FIRST scored LAST. A poll's new records take one lease, so a lease costs two
-- members however many records it covers; a redelivered record takes one of its own. A
-- record leaves its lease (ack, nack, dead letter, extend, lapse) by splitting it: the
-- rest keeps the expiry. Ranges never overlap, and every record in one is in flight.

-- The first lease as {FIRST, expiry} of a ZRANGE WITHSCORES, or {} when none.
local function first_lease(K)
  return redis.call('ZRANGE', K.lease, '0', '0', 'WITHSCORES')
end

-- The lease holding delivered record off: its range's first and last offsets, or nil
-- when the record is not in flight.
local function lease_holding(K, off)
  if K.types.lease == 'none' then return nil end
  local m = fmt(off)
  if K.types.held ~= 'none' then
    local r = redis.call('ZRANGE', K.held, m, '+inf', 'BYSCORE', 'LIMIT', '0', '1', 'WITHSCORES')
    if r[1] then
      local first = tonumber(r[1])
      if first <= off then return first, tonumber(r[2]) end
    end
  end
  return nil
end

-- Adds leases: firsts and lasts (strings, same length), all expiring at expiry (string).
local function add_leases(K, firsts, lasts, expiry)
  local n = #firsts
  if n == 0 then return end
  local l, h = {}, {}
  for i = 1, n do
    l[2 * i - 1], l[2 * i] = expiry, firsts[i]
    h[2 * i - 1], h[2 * i] = lasts[i], firsts[i]
  end
  call_many('ZADD', K.lease, l)
  call_many('ZADD', K.held, h)
  K.types.lease, K.types.held = 'zset', 'zset'
end

-- Takes the delivered records offs (ascending, no repeats) out of their leases; the rest
-- of each lease keeps its expiry. Returns how many were in flight and a table offset ->
-- true of those. One lookup per lease touched (and per record not in flight); none for
-- offs[1] when its lease is known ({first, last, expiry}, as check_claim returns it).
local function unlease(K, offs, known)
  local taken, count = {}, 0
  if K.types.lease == 'none' then return 0, taken end
  local gone, pieces = {}, {}
  local i, n = 1, #offs
  while i <= n do
    local first, last, expiry
    if known then
      first, last, expiry = known[1], known[2], known[3]
      known = nil
    else
      first, last = lease_holding(K, offs[i])
    end
    if not first then
      i = i + 1
    else
      local j = i
      while j < n and offs[j + 1] <= last do j = j + 1 end
      local f = fmt(first)
      gone[#gone + 1] = f
      local from = first
      for k = i, j do
        local o = offs[k]
        if o > from then
          expiry = expiry or redis.call('ZSCORE', K.lease, f)
          pieces[#pieces + 1] = {from, o - 1, expiry}
        end
        from = o + 1
        taken[o] = true
      end
      if from <= last then
        expiry = expiry or redis.call('ZSCORE', K.lease, f)
        pieces[#pieces + 1] = {from, last, expiry}
      end
      count = count + j - i + 1
      i = j + 1
    end
  end
  if #gone > 0 then
    call_many('ZREM', K.lease, gone)
    if K.types.held ~= 'none' then call_many('ZREM', K.held, gone) end
  end
  for _, p in ipairs(pieces) do add_leases(K, {fmt(p[1])}, {fmt(p[2])}, p[3]) end
  return count, taken
end

-- Earliest time (ms) an owed record or a lease falls due, or -1 when none.
local function next_due(K)
  local due = -1
  local o = redis.call('ZRANGE', K.owed, 0, 0, 'WITHSCORES')
  if #o > 0 then due = tonumber(o[2]) end
  local l = first_lease(K)
  if #l > 0 and (due < 0 or tonumber(l[2]) < due) then due = tonumber(l[2]) end
  return due
end
