-- group_poll: hand out up to max_records records under a lease: due redeliveries first
-- (by due time), then delayed records the group passed over that came due (from the due
-- index, lua/includes/due.lua), then new records in offset order. Each delivery adds one
-- to the record's attempts. A lapsed lease counts as a failed delivery; a record whose failed
-- deliveries reached max_attempts becomes a dead letter instead of being handed out.
-- Scripts never block: the reply says when the next owed record or lease falls due and
-- where to block (log tail, wake sequence) so no wake-up is missed.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[14] due         zset: the shard's due index (optional: without it, delivery times
--                      are not waited for; lua/includes/group.lua)
-- KEYS[15] bell        zset: the group's bell, PREFIX:{TAG}:g:GROUP:bell (only with a
--                      WAITER): at most one member, score 0, a ring: 'ID NEXT WSEQ DUEIN'
--                      (the ring id, the log and wake points to watch from, and in how
--                      many ms the next owed record or lease is due, -1: none)
-- ARGV[1] max_records  integer 1..10000 (0..10000 with !SHARDS below)
-- ARGV[2] consumer     consumer name holding the leases, '' for anonymous
-- ARGV[3] reclaim      '1': first make this consumer's in-flight records owed at once;
--                      'RECLAIM WAITER TTL_MS[ RING][ +SHARDS|!SHARDS]' (RECLAIM '0' or
--                      '1'): a long poll's call, by waiter WAITER (1..64 of
--                      [A-Za-z0-9_.-], one per polling thread or task), that takes part
--                      in the group's watch (below) for
--                      TTL_MS (1..999999999 ms); RING: the ring id ('@' and 1..40 of
--                      [0-9.]) of a ring this waiter popped; it needs KEYS[15]. Ending
--                      in ' +SHARDS' or ' !SHARDS' (SHARDS 0..16000 of [0-9.,:?-]): a
--                      call of a group's watch over all its shards (held on shard 0), a
--                      ring it rings carries SHARDS (the client's points of the other
--                      shards, opaque here); '!': by a waiter that took records on
--                      another shard: it gives the watch up as a call that hands out
--                      records does
-- ARGV[4..] ack        0..10000 offsets (integers) of delivered records to ack before
--                      polling, as group_ack does (one round trip for both), except
--                      that they go all together: one never delivered fails the poll
--                      before anything is written (a poll has no place to report it);
--                      or, alone, one run 'FIRST-LAST' (FIRST < LAST, at most 10000
--                      offsets): the same as its offsets given one by one
--
-- Role: group.consume, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:consume, derived from KEYS[3]; never passed nor accessed.
-- Delayed records (a due time later than now) are passed over and handed out once due
-- (as first deliveries, by due time, after the due redeliveries); an expired record is
-- dead-lettered with reason 'expired' instead of being handed out. A rate limit (group
-- field rate) caps the hand-outs per window.
-- Fleets: of the long-pollers of a group on a shard, one at a time (the watcher, held in
-- the group field lead until its TTL_MS lapse) blocks on the log and the wake stream;
-- the others block on the bell (BZPOPMIN). A call with a WAITER that hands out nothing
-- becomes (or stays) the watcher when there is none live; one that hands out records
-- gives up the watch, and when nobody watches then it rings the bell: the ring hands
-- the watch to the follower that pops it (lead '@ID', until this call's TTL_MS lapse),
-- with the points to watch from (the first record not handed out yet: the rest of a
-- burst wakes it at once, and is passed on the same way). That follower names the ring
-- in its next call (RING), which then counts as the watcher's. A call that hands out
-- nothing while a ring is still on the bell (no follower waited to pop it: the ringer
-- alone, or every other waiter busy) takes the watch itself and clears the bell, so a
-- lone poller's next empty poll watches at once instead of popping its own ring. A
-- watcher that dies (or a ring nobody pops) is replaced by the first call after its
-- TTL_MS lapse. (A ring is 'ID NEXT WSEQ DUEIN', or 'ID NEXT WSEQ DUEIN SHARDS' from a
-- call with SHARDS.)
-- Returns: {now ms, next due ms (-1: none; at most now: poll again at once, as after a
-- poll that handed out max_records while delayed records wait in the index), tail, wake
-- sequence, n, then n times: entry ID 'OFFSET-PUBLISHMS', attempts (integer), key (nil
-- when none; the due ms as an integer for a delayed record with no key, headers nor
-- expiry; else {key, headers, due ms, expiry ms} for a record with any of the last three),
-- payload; or, for the first delivery of a record with none of them (attempts 1, no
-- key), only entry ID and payload (a string where the others have attempts)},
-- and with a WAITER two more: its role (1 the watcher, 2 a follower, 0 handed records)
-- and the watch's expiry (ms; 0: none).
-- Errors: FELIX_NOPERM (no group.consume role), FELIX_NOT_FOUND (stream, shard or group;
-- an offset to ack never delivered), FELIX_INVALID, FELIX_WRONGTYPE. All arguments,
-- the acks' offsets included, are checked before anything is written.
--- @include "group"
--- @include "dead_letters"
--- @include "records"
--- @include "due"
require_group_role('group.consume')
local consumer, reclaim = ARGV[2], s_sub(ARGV[3], 1, 1) == '1'
local waiter, watch_ttl, ring, bell, rung = false, 0, false, false, false
-- shards: what a ring carries of the other shards ('' none); busy: a call by a waiter
-- that took records on another shard ('!')
local shards, busy, call = '', false, ARGV[3]
do
  local head, mark, points = s_match(call, '^(.-) ([+!])([%d.,:?%-]*)$')
  if head then
    if #points > 16000 then fail('INVALID', 'ARGV[3]: SHARDS is longer than 16000') end
    shards, busy, call = points, mark == '!', head
    if #call < 2 then fail('INVALID', 'ARGV[3]: SHARDS go with a WAITER') end
  end
end
local max_records = int_arg(ARGV[1], 'max_records', busy and 0 or 1, 10000)
if #call > 1 then
  local r, w, t, g = s_match(call, '^([01]) ([%w_.%-]+) (%d+) ?(@?[%d.]*)$')
  if not r or #w > 64 or #t > 9 or tonumber(t) < 1 or #g > 41 or g == '@' or (g ~= '' and s_byte(g, 1) ~= 64) then
    fail('INVALID', "ARGV[3] must be '0', '1' or 'RECLAIM WAITER TTL_MS[ @RING][ +SHARDS|!SHARDS]', got "
      .. s_sub(ARGV[3], 1, 80))
  end
  waiter, watch_ttl = w, tonumber(t)
  if g ~= '' then ring = g end
  bell = passed_key('bell')
  if not bell then fail('INVALID', "a poll with a WAITER takes the group's bell key after the key block") end
  local nb = redis.pcall('ZCARD', bell)
  if type(nb) == 'table' then
    expect_type(bell, 'zset')
    error(nb, 0)
  end
  rung = nb > 0  -- (a ring nobody took yet: ringing again changes nothing)
end
if #ARGV > 10003 then fail('INVALID', 'a poll acks at most 10000 offsets') end
local acks, ack_offs, ack_a, ack_b = nil, nil, nil, nil
if #ARGV == 4 and s_find(ARGV[4], '-', 1, true) then
  ack_a, ack_b = run_arg(ARGV[4], 'ARGV[4]')
elseif #ARGV > 3 then
  acks, ack_offs = offset_args(4)
end
local K = group_role_keys()
local S = load_group(K)
local now = now_ms()
-- due times are compared with the due cursor's clock, which never goes back (a
-- failover to a server whose clock is behind would otherwise pass over records twice)
local dnow = math.max(now, S.dcur)

-- The rate limit: what this window still allows caps max_records.
local rate_left, rate_end = false, false
if S.rate then
  local start, taken = S.rwin_start, S.rwin_taken
  if now >= start + S.rate_per or now < start then start, taken = now, 0 end
  rate_left, rate_end = math.max(0, S.rate_count - taken), start + S.rate_per
  S.rwin_start, S.rwin_taken = start, taken
  if rate_left < max_records then max_records = rate_left end
end

-- A record whose deliveries reached max_attempts becomes a dead letter (true) instead of
-- being owed or handed out again: reclaimed, lapsed or due (past a lowered max).
local function buried(off, a, why)
  if a < S.max then return false end
  dead_letter(K, S, off, a, 'max_attempts reached' .. why, now)
  return true
end

-- 0. Acks, exactly as group_ack would: the records the caller finished leave before
-- new ones are leased.
if ack_a then
  ack_run(K, S, ack_a, ack_b)
elseif acks then
  ack_many(K, S, acks, ack_offs)
end

-- 1. Reclaim: this consumer's in-flight records become owed, due before everything else.
local reclaimed = false
if reclaim and consumer ~= '' and S.cons then
  local mine = redis.call('ZRANGEBYLEX', K.byowner, '[' .. consumer .. '|', '(' .. consumer .. '}')
  for _, member in ipairs(mine) do
    local m = s_sub(member, #consumer + 2)
    redis.call('ZREM', K.byowner, member)
    redis.call('HDEL', K.owner, m)
    if unlease(K, {tonumber(m)}) == 1 then
      local a = tonumber(redis.call('HGET', K.attempts, m)) or 1
      if not buried(tonumber(m), a, ': reclaimed by ' .. consumer) then
        redis.call('HSET', K.attempts, m, a)
        redis.call('ZADD', K.owed, 0, m)
        reclaimed = true
      end
    end
  end
  -- what this poll does not take back, another long-poller may
  if reclaimed then wake(K, S) end
end

-- 2. Lapsed leases: failed deliveries, owed from their expiry (bounded per call).
-- The earliest lease (and below, the earliest owed record) tells in one command whether
-- anything lapsed (fell due); usually nothing did, and it also gives the next due time.
local slow = reclaim and consumer ~= '' and S.cons
local now_s = fmt(now)
local earliest = {}
if K.types.lease ~= 'none' then earliest = first_lease(K) end
local lapsed = {}
if #earliest > 0 and tonumber(earliest[2]) <= now then
  slow = true
  lapsed = redis.call('ZRANGEBYSCORE', K.lease, '-inf', now_s, 'WITHSCORES', 'LIMIT', '0', fmt(max_records + 64))
end
if #lapsed > 0 then
  -- the records of each lapsed lease, max_records + 64 at most: the rest of a lease
  -- that goes over is leased again with the same expiry (the next poll takes it)
  local firsts = {}
  for i = 1, #lapsed, 2 do firsts[#firsts + 1] = lapsed[i] end
  local lasts = {}
  if K.types.held ~= 'none' then lasts = call_many('ZMSCORE', K.held, firsts) end
  call_many('ZREM', K.lease, firsts)
  if K.types.held ~= 'none' then call_many('ZREM', K.held, firsts) end
  local budget = max_records + 64
  for j, f in ipairs(firsts) do
    local first, last, expiry = tonumber(f), tonumber(lasts[j] or f), lapsed[2 * j]
    local upto = math.min(last, first + budget - 1)
    for off = first, upto do
      local m = fmt(off)
      release_owner(K, S, m)
      local a = tonumber(redis.call('HGET', K.attempts, m)) or 1
      if not buried(off, a, ': lease lapsed') then
        redis.call('HSET', K.attempts, m, a)
        redis.call('ZADD', K.owed, expiry, m)
      end
    end
    budget = budget - math.max(0, upto - first + 1)
    if upto < last then add_leases(K, {fmt(math.max(first, upto + 1))}, {fmt(last)}, expiry) end
  end
end

local out = {now, -1, S.tail, S.wseq, 0}
local o = 5
local n = 0
-- numbers passed to redis.call are formatted with %.14g: pass strings made once
local expiry = fmt(now + S.vt)
-- leases, owners and attempts are written once per poll, for all records together:
-- the leases as ranges (lfirst[i]..llast[i]; one for the new records when nothing was
-- trimmed between them, one per redelivered record)
local lfirst, llast, owners, held, counts = {}, {}, {}, {}, {}
local h = 0
-- Takes record m into the poll's leases: its attempts (past the first) and its owner.
local function lease(m, attempts)
  -- an in-flight record without an attempts entry is on its first delivery
  if attempts > 1 then counts[#counts + 1] = m; counts[#counts + 1] = fmt(attempts) end
  if consumer ~= '' then
    h = h + 2
    owners[h - 1] = m
    owners[h] = consumer
    held[h - 1] = '0'
    held[h] = consumer .. '|' .. m
  end
end
-- Writes the log entries es[i..j], delivered with attempts, into the reply: ID and
-- payload for a plain record's first delivery, else ID, attempts, key, payload (one
-- call for a poll's dense new records). due (ms, optional): the due time the due index
-- gives every one of them (3b), used for a record with only a payload and a due time
-- instead of reading its d field again (publish writes both in one call: they agree).
local function put(es, i, j, attempts, due)
  local r, at = out, o  -- (locals: an upvalue costs more per record)
  local first = attempts == 1
  for k = i, j do
    local e = es[k]
    local fields = e[2]
    if first and fields[1] == 'p' and fields[3] == nil then
      -- the usual record: two slots, not four (the client tells them apart by the second
      -- slot's type: a payload is a string, attempts a number)
      r[at + 1] = e[1]
      r[at + 2] = fields[2]
      at = at + 2
    else
      local payload, key
      if fields[1] == 'p' and (fields[3] == nil or (fields[3] == 'k' and fields[5] == nil)) then
        payload, key = fields[2], fields[4] or false
      elseif fields[1] == 'p' and fields[3] == 'd' and fields[5] == nil then
        -- a delayed record without key, headers nor expiry (as publish writes it): its
        -- due time alone, as an integer, in the key's place (no table to build and send)
        payload, key = fields[2], due or due_time(e[1], fields[4])
      else
        local h, d, x
        payload, key, h, d, x = record_fields(fields, e[1])
        key = key_slot(key, h, d, x)
      end
      r[at + 1] = e[1]
      r[at + 2] = attempts
      r[at + 3] = key
      r[at + 4] = payload
      at = at + 4
    end
  end
  o, n = at, n + j - i + 1
end

-- True when every entry of es[i..j] is handed out as it is: a plain record, or one due
-- by due_by (before it when strict) that has not expired.
local function all_out(es, i, j, due_by, strict)
  for k = i, j do
    local f = es[k][2]
    if not (f[1] == 'p' and (f[3] == nil or (f[3] == 'k' and f[5] == nil))) then
      local d, x
      if f[1] == 'p' and f[3] == 'd' and f[5] == nil then
        d, x = due_time(es[k][1], f[4]), false
      else
        d, x = select(4, record_fields(f, es[k][1]))
      end
      if d and (tonumber(d) > due_by or (strict and tonumber(d) == due_by)) then return false end
      if x and tonumber(x) <= now then return false end
    end
  end
  return true
end

-- True when every entry of es is handed out as it is, all of them due at or before
-- due_by by the due index (3b): a record with only a payload and a due time is (publish
-- writes its d field and its index entry in one call, so the index's due time is its
-- own, and it has no expiry: nothing to read); any other is looked at as all_out does.
local function all_out_indexed(es, due_by)
  for k = 1, #es do
    local f = es[k][2]
    if not (f[1] == 'p' and f[3] == 'd' and f[5] == nil) and not all_out(es, k, k, due_by) then
      return false
    end
  end
  return true
end

-- Hands out the records at offsets toff (members tm, ta: the attempts this delivery
-- makes), in that order: one XRANGE per run of consecutive offsets; a run found whole
-- in the log (the usual case) with the same attempts goes into the reply at once and
-- takes one lease. A record retention trimmed is finished (counted), an expired one
-- dead-lettered.
local function deliver(toff, tm, ta)
  local i, count = 1, #toff
  while i <= count do
    local j = i
    while j < count and toff[j + 1] == toff[j] + 1 and ta[j + 1] == ta[i] do j = j + 1 end
    local es = redis.call('XRANGE', K.log, tm[i], tm[j], 'COUNT', fmt(j - i + 1))
    local whole = #es == j - i + 1 and s_find(es[#es][1], tm[j] .. '-', 1, true) == 1
      and s_find(es[1][1], tm[i] .. '-', 1, true) == 1
    if whole and S.tlast >= toff[i] then
      -- timed records: whole only when none of them expired
      for _, e in ipairs(es) do
        if not plain_fields(e[2]) and expired_at(e[2], now) then whole = false break end
      end
    end
    if whole then
      for k = i, j do lease(tm[k], ta[i]) end
      put(es, 1, #es, ta[i])
      lfirst[#lfirst + 1] = tm[i]
      llast[#llast + 1] = tm[j]
    else
      local entry = {}
      for _, e in ipairs(es) do
        local off = tonumber(s_match(e[1], '^%d+'))
        if off and not entry[off] then entry[off] = e end
      end
      local prev = false
      for k = i, j do
        local off, m = toff[k], tm[k]
        local e = entry[off]
        if not e then
          -- trimmed by retention while owed: counted, never silently skipped
          finish(K, S, off)
          S.trimmed = S.trimmed + 1
          S.dirty = true
          prev = false
        elseif S.tlast >= off and not plain_fields(e[2]) and expired_at(e[2], now) then
          dead_letter(K, S, off, ta[k] - 1, 'expired', now)
          prev = false
        else
          lease(m, ta[k])
          put({e}, 1, 1, ta[k])
          if prev and off == prev + 1 then
            llast[#llast] = m  -- the lease of the record before it grows by one
          else
            lfirst[#lfirst + 1] = m
            llast[#llast + 1] = m
          end
          prev = off
        end
      end
    end
    i = j + 1
  end
end

-- 3. Due redeliveries, by due time.
local first_owed = {}
if K.types.owed ~= 'none' or slow then first_owed = redis.call('ZRANGE', K.owed, '0', '0', 'WITHSCORES') end
if max_records > 0 and #first_owed > 0 and tonumber(first_owed[2]) <= now then
  slow = true
  local got = redis.call('ZRANGEBYSCORE', K.owed, '-inf', now_s, 'WITHSCORES', 'LIMIT', '0', fmt(max_records))
  -- by due time, then offset (records due at the same time come in member order, which
  -- is not numeric): neighbours in the log then lie next to each other, and a run of them
  -- is read with one XRANGE and takes one lease
  local offs, same = {}, true
  for i = 1, #got, 2 do
    offs[#offs + 1] = tonumber(got[i])
    if got[i + 1] ~= got[2] then same = false end
  end
  if same then
    table.sort(offs)
  else
    local score = {}
    for i = 1, #got, 2 do score[tonumber(got[i])] = tonumber(got[i + 1]) end
    table.sort(offs, function(x, y)
      if score[x] ~= score[y] then return score[x] < score[y] end
      return x < y
    end)
  end
  local ms = {}
  for i, off in ipairs(offs) do ms[i] = fmt(off) end
  -- (the lapses above may have written attempts in this call: always read them)
  local tries = call_many('HMGET', K.attempts, ms)
  -- the records to hand out: offsets, members and attempts so far, in parallel
  -- (ta: the attempts this delivery makes)
  local toff, tm, ta = {}, {}, {}
  for i, off in ipairs(offs) do
    local a = tonumber(tries[i]) or 0
    if not buried(off, a, '') then
      local attempts = a + 1
      toff[#toff + 1], tm[#tm + 1], ta[#ta + 1] = off, ms[i], attempts
    end
  end
  call_many('ZREM', K.owed, tm)
  deliver(toff, tm, ta)
end

-- 3b. Delayed records this group passed over whose due time came: handed out here as
-- first deliveries (attempts 1), after the due redeliveries and before new records, in
-- the order of the shard's due index: by due time, then offset. The due cursor says how
-- far the group got: every entry due before S.dcur is handled (handed out, left to the
-- scan when at or above next, or not the group's when below base), and so are those due
-- at S.dcur, but for the ones above offset S.doff when the cursor stands inside a due
-- time (many records due at once, more than a poll took). Records at or above next are
-- not passed yet: the scan below meets them, due by then. The index is read bucket by
-- bucket (lua/includes/due.lua), at most DUE_BUCKETS a call.
local DUE_BUCKETS = 16
local want = max_records - n
if K.due and want > 0 and (S.dmax > S.dcur or S.doff) then
  local ranges = {}  -- the offsets to hand out, as {first, last} in hand-out order
  local room, given = want, 0
  local cur, doff = S.dcur, S.doff
  local bs = due_bucket(cur)
  local full = false
  for step = 1, DUE_BUCKETS do
    -- (standing inside a due time, its bucket has records: no need to look for it)
    local b = (step == 1 and doff) and bs or due_next_bucket(K.due, bs, fmt(dnow))
    if not b then
      -- everything due by dnow is handled
      cur, doff = dnow, false
      break
    end
    local rd, ra, rz = due_bucket_ranges(K.due, b)
    for i = 1, #rd do
      local t, a, z = rd[i], ra[i], rz[i]
      if t > dnow then break end
      if t > cur or (t == cur and doff and z > doff) then
        if room == 0 then
          -- the entries before filled the poll: the cursor stays after the last of them
          -- (not inside this one's due time, where nothing below its first offset is:
          -- a cursor below offset 0 would not read back)
          full = true
          break
        end
        if t == cur and doff and a <= doff then a = doff + 1 end
        -- a .. z: those in [base, next) are handed out while room lasts
        if a < S.base then a = S.base end
        local upto = math.min(z, S.next - 1)
        local give = math.max(0, upto - a + 1)
        if give > room then
          give = room
          full = true
        end
        if give > 0 then ranges[#ranges + 1] = {a, a + give - 1, t} end
        room, given = room - give, given + give
        cur = t
        if full then
          doff = a + give - 1
          break
        end
        doff = z
      end
    end
    if full then break end
    if b + DUE_W - 1 <= dnow then
      -- the whole bucket is handled
      cur, doff = b + DUE_W - 1, false
      bs = b + DUE_W
    else
      cur, doff = dnow, false
      break
    end
  end
  if given > 0 then
    S.sk = math.max(0, S.sk - given)
    for _, rg in ipairs(ranges) do
      local a, z, t = rg[1], rg[2], rg[3]
      local a_s, z_s = fmt(a), fmt(z)
      local es = redis.call('XRANGE', K.log, a_s, z_s, 'COUNT', fmt(z - a + 1))
      if #es == z - a + 1 and s_find(es[1][1], a_s .. '-', 1, true) == 1
          and s_find(es[#es][1], z_s .. '-', 1, true) == 1 and all_out_indexed(es, cur) then
        -- the usual case: one entry per offset, all due and none expired: into the reply
        -- at once, one lease
        if consumer ~= '' then
          for o = a, z do lease(fmt(o), 1) end
        end
        put(es, 1, #es, 1, t)
        lfirst[#lfirst + 1] = a_s
        llast[#llast + 1] = z_s
      else
        local toff, tm, ta = {}, {}, {}
        for o = a, z do toff[#toff + 1], tm[#tm + 1], ta[#ta + 1] = o, fmt(o), 1 end
        deliver(toff, tm, ta)
      end
    end
  end
  S.dcur, S.doff = cur, doff
  dnow = cur
  S.dirty = true
end

-- 4. New records, in offset order. Where the range may hold timed records (at or below
-- meta's tlast) each is looked at: a delayed one not yet due is passed over (counted in
-- sk; 3b hands it out once due), an expired one dead-lettered; the scan goes on past
-- them, up to a bound (more: the caller polls again at once). While the due cursor
-- stands inside a due time (3b filled the poll, but some of what it took were expired or
-- trimmed), records of that due time are passed over too: 3b hands them out.
want = max_records - n
local scanned, more, wide = 0, false, false
local held_by_due = {}  -- the due index's buckets read by this scan
while want > 0 and S.next < S.tail do
  if scanned >= 4 * max_records + 4096 then more = true break end
  -- once this call passed over a record, where timed records may be, a page larger than
  -- wanted: the ones passed over do not count (the loop stops taking at max_records; next
  -- stays at the last one taken). Records due by now take the pages they fill.
  local page = want
  if wide and S.tlast >= S.next then page = math.max(want, 256) end
  local entries = redis.call('XRANGE', K.log, fmt(S.next), '+', 'COUNT', fmt(page))
  local first = S.next
  local count = #entries
  scanned = scanned + count
  if count > 0 and page == want and s_find(entries[count][1], fmt(first + count - 1) .. '-', 1, true) == 1
      and (S.tlast < first or all_out(entries, 1, count, dnow, S.doff)) then
    -- dense (nothing trimmed in between, the usual case): offsets follow from the order,
    -- and the records take one lease (anonymous first deliveries, the usual case, have
    -- no attempts nor owner to write)
    if consumer ~= '' then
      for i = 1, count do lease(fmt(first + i - 1), 1) end
    end
    put(entries, 1, count, 1)
    lfirst[#lfirst + 1] = fmt(first)
    llast[#llast + 1] = fmt(first + count - 1)
    S.next = first + count
  else
    local fresh = {}
    for i, e in ipairs(entries) do
      if n >= max_records then break end
      local m = s_match(e[1], '^%d+')
      local off = tonumber(m)
      -- a second entry at an offset (added by hand with a later time) is no record: the
      -- offset's record is its first entry, as a redelivery's XRANGE O O finds it
      if off >= S.next then
        if off > S.next then skip_trimmed(K, S, S.next, off - 1) end
        S.next = off + 1
        local f, verdict = e[2], 'out'
        if off <= S.tlast and not plain_fields(f) then
          local _, _, _, d, x = record_fields(f, e[1])
          local dt = d and tonumber(d)
          if dt and K.due and (dt > dnow or (S.doff and dt == dnow)) and due_holds(K.due, off, dt, held_by_due) then
            verdict = 'later'
          elseif x and tonumber(x) <= now then
            verdict = 'expired'
          end
        end
        if verdict == 'out' then
          lease(m, 1)
          put(entries, i, i, 1)
          fresh[#fresh + 1] = off
        elseif verdict == 'later' then
          S.sk = S.sk + 1
          wide = true
        else
          dead_letter(K, S, off, 0, 'expired', now)
          wide = true
        end
      end
    end
    each_stretch(fresh, function(a, b)
      lfirst[#lfirst + 1] = fmt(a)
      llast[#llast + 1] = fmt(b)
    end)
    if count == 0 then
      -- nothing from next on: retention trimmed up to the tail, or meta's tail was written
      -- above the log by hand; only offsets the log really passed count as trimmed
      local tail = math.min(S.tail, log_tail(K.log))
      if tail > S.next then skip_trimmed(K, S, S.next, tail - 1) end
      if tail > S.next then S.next = tail end
      S.dirty = true
      break
    end
  end
  S.dirty = true
  want = max_records - n
end

if rate_left then
  -- the window's hand-outs (expired records are not handed out)
  if n > 0 then
    S.rwin_taken = S.rwin_taken + n
    S.rwin_changed = true
    S.dirty = true
  end
  rate_left = rate_left - n
end
if n > 0 then
  add_leases(K, lfirst, llast, expiry)
  if #counts > 0 then call_many('HSET', K.attempts, counts) end
  if consumer ~= '' then
    call_many('HSET', K.owner, owners)
    call_many('ZADD', K.byowner, held)
    if not S.cons then S.cons = true; S.dirty = true end
  end
end
save_group(K, S)
if slow then
  out[2] = next_due(K)
else
  -- nothing lapsed nor fell due: the earliest of the first owed record, the first lease
  -- and the leases just given
  local at = -1
  if #first_owed > 0 then at = tonumber(first_owed[2]) end
  if #earliest > 0 and (at < 0 or tonumber(earliest[2]) < at) then at = tonumber(earliest[2]) end
  if n > 0 and (at < 0 or now + S.vt < at) then at = now + S.vt end
  out[2] = at
end
-- the next delayed record falls due (for this group or not: a wake-up at most early)
if K.due and S.doff then
  -- the rest of a split due time is due now
  out[2] = now
elseif K.due and S.dmax > S.dcur and max_records > 0 and n >= max_records then
  -- a full poll: its caller polls again at once (a full batch may have more; a ring says
  -- so to its follower), so the index is not searched for the next due time
  out[2] = now
elseif K.due and S.dmax > S.dcur then
  -- (from the due cursor: where 3b did not run, as when the rate limit's window is spent,
  -- passed-over records may be due already)
  local d = due_after(K.due, S.dcur)
  if d and (out[2] < 0 or d < out[2]) then out[2] = d end
end
if more then out[2] = now end
if rate_left == 0 then
  -- the window is spent: nothing is handed out before it ends; records waiting now
  -- are handed out when it does
  local waiting = S.next < S.tail or (#first_owed > 0 and tonumber(first_owed[2]) <= now)
  if waiting then
    out[2] = rate_end
  elseif out[2] >= 0 then
    out[2] = math.max(out[2], rate_end)
  end
end
out[5] = n
-- The watch (see the header): written only here, after every check passed.
if waiter then
  local holder, lexp = false, 0
  local lead = S.loaded[11]
  if lead then
    local w, e = s_match(lead, '^(%S+) (%d+)$')
    if w then holder, lexp = w, tonumber(e) end
  end
  local live = holder and lexp > now
  local mine = holder and (holder == waiter or holder == ring)
  local role = 0
  if n == 0 and not busy then
    role = 2
    -- a ring still on the bell is one no follower waited for (a blocked BZPOPMIN pops
    -- it as soon as it is rung): nothing was handed out, so this caller watches itself
    local unpopped = rung and holder and s_sub(holder, 1, 1) == '@'
    if not live or mine or unpopped then
      if rung then
        redis.call('DEL', bell)  -- (at most one member: a ring for a watch now this caller's)
      end
      lexp = now + watch_ttl
      redis.call('HSET', K.group, 'lead', waiter .. ' ' .. fmt(lexp))
      role = 1
    end
  else
    if mine then live, lexp = false, 0 end
    if not live and not rung then
      -- the ring: the watch, for whoever pops it, from the first record not handed out
      local id = fmt(now) .. '.' .. fmt(S.next)
      local din = out[2] < 0 and -1 or math.max(0, out[2] - now)
      local member = id .. ' ' .. fmt(S.next) .. ' ' .. fmt(out[4]) .. ' ' .. fmt(din)
      if shards ~= '' then member = member .. ' ' .. shards end
      redis.call('ZADD', bell, 0, member)
      lexp = now + watch_ttl
      redis.call('HSET', K.group, 'lead', '@' .. id .. ' ' .. fmt(lexp))
    elseif mine then
      redis.call('HDEL', K.group, 'lead')
    end
  end
  out[#out + 1] = role
  out[#out + 1] = lexp
end
return out
