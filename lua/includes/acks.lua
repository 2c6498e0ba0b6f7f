-- acks: finishing records (acks) and checking claims (nack, extend, dead letter).

--- @include "leases"
--- @include "runs"
--- @include "records"
--- @include "due"

-- Finishes record off: drops its lease or owed entry, attempts and owner.
local function finish(K, S, off)
  local m = fmt(off)
  if unlease(K, {off}) == 0 then redis.call('ZREM', K.owed, m) end
  redis.call('HDEL', K.attempts, m)
  release_owner(K, S, m)
  mark_done(K, S, off)
end

-- Finishes many records at once (ack): ms are members known to be unfinished (offs, if
-- given: their offsets in ascending order; aligned: ms is in that same order). Their
-- lease or owed entries must already be removed; a missing attempts hash or done key
-- costs no command. The position walks over the sorted offsets without set operations
-- when they continue it (in-order acks); the done runs are looked at only when the
-- position moved (the position itself is never finished, so never in a run).
local function finish_many(K, S, ms, offs, aligned)
  if K.types.attempts ~= 'none' then call_many('HDEL', K.attempts, ms) end
  if S.cons then
    local owners = call_many('HMGET', K.owner, ms)
    local held = {}
    for i, c in ipairs(owners) do if c then held[#held + 1] = c .. '|' .. ms[i] end end
    if #held > 0 then
      call_many('HDEL', K.owner, ms)
      call_many('ZREM', K.byowner, held)
    end
  end
  if not offs then
    offs = {}
    for i, m in ipairs(ms) do offs[i] = tonumber(m) end
    table.sort(offs)
  end
  local below, above = {}, {}
  local start_pos = S.pos
  local n = #offs
  if aligned and offs[1] == start_pos and offs[n] == start_pos + n - 1 then
    -- ascending and without repeats: a contiguous run from the position (in-order acks)
    S.pos = start_pos + n
  elseif offs[1] > start_pos then
    -- all above the position (a record before them is still unfinished, the usual
    -- case while one is held back): remembered as runs
    above = offs
  else
    for i, off in ipairs(offs) do
      if off < start_pos then
        below[#below + 1] = aligned and ms[i] or fmt(off)
      elseif off == S.pos then
        S.pos = off + 1
      else
        above[#above + 1] = off
      end
    end
  end
  if #below > 0 then call_many('ZREM', K.redo, below) end
  local m = #above
  if m > 0 and above[m] - above[1] == m - 1 then
    -- one stretch (a poll's records acked together, the usual case)
    add_run(K, S, above[1], above[m])
  elseif m > 0 then
    each_stretch(above, function(a, b) add_run(K, S, a, b) end)
  end
  if S.pos ~= start_pos then
    advance_done(K, S)
    S.dirty = true
  end
end

-- 10^k for k = 0..16: an integer x is written with exactly d digits when
-- POW10[d - 1] <= x < POW10[d] (d > 1) or x < 10 (d = 1).
local POW10 = {}

for k = 0, 16 do POW10[k] = 10 ^ k end

-- The offsets ARGV[from..] as canonical decimal members (the form the zsets, hashes and
-- sets hold) and as numbers: ms, offs. Fails INVALID on anything that is not an offset;
-- writes nothing. An argument is taken as it is when tonumber reads a whole number
-- with as many digits as the argument has characters (no sign, space, point or leading
-- zero) and the list holds no exponent or hex letter (one plain search over it all);
-- anything else takes the checking path, which also reads '01' as 1.
local function offset_args(from)
  local last = #ARGV
  local ms, offs, n = {}, {}, 0
  local quick = last - from < 7000
  if quick then
    local all = table.concat(ARGV, '', from, last)
    quick = not (s_find(all, 'e', 1, true) or s_find(all, 'E', 1, true) or s_find(all, 'x', 1, true)
      or s_find(all, 'X', 1, true))
  end
  if quick then
    for i = from, last do
      local v = ARGV[i]
      local d = #v
      local x = d <= 15 and tonumber(v)
      if not x or x < 0 or x % 1 ~= 0 or x >= POW10[d] or (d > 1 and x < POW10[d - 1]) then
        quick = false
        break
      end
      n = n + 1
      ms[n], offs[n] = v, x
    end
  end
  if not quick then
    ms, offs, n = {}, {}, 0
    for i = from, last do
      local v = ARGV[i]
      local x = int_arg(v, 'offset', 0, 2 ^ 52)
      n = n + 1
      ms[n], offs[n] = fmt(x), x
    end
  end
  return ms, offs
end

-- True when member m is a delayed record the group passed over (below next) and has
-- not handed out yet: due (the log's d field) after the group's due cursor, and in the
-- due index with that due time.
local function not_yet_due(K, S, m)
  local off = tonumber(m)
  if off < S.base or off >= S.next then return false end
  local e = redis.call('XRANGE', K.log, m, m, 'COUNT', 1)[1]
  if not e or s_find(e[1], m .. '-', 1, true) ~= 1 or plain_fields(e[2]) then return false end
  local _, _, _, d = record_fields(e[2], e[1])
  if not d then return false end
  d = tonumber(d)
  if d < S.dcur or (d == S.dcur and (not S.doff or off <= S.doff)) then return false end
  return due_holds(K.due, off, d, {})
end

-- Acks the delivered records ms, offsets offs (from offset_args): each leaves no group state
-- behind and the position advances over any contiguous run of finished records. Acking
-- a finished record changes nothing; acking a stale claim whose record is unfinished
-- (owed, or in flight under a newer lease) finishes it. An offset never delivered: with
-- each (group_ack), it is skipped and the others are acked all the same; without (a
-- poll's acks), the call fails NOT_FOUND before its first write. With statuses, returns
-- one status per member: 1 acked now, 0 already finished (or repeated in ms), -1 never
-- delivered (with each). The caller saves S (save_group).
local function ack_many(K, S, ms, offs, statuses, each)
  -- offsets in strictly ascending order (a poll's records usually are) repeat none: no
  -- table of the members seen is needed
  local n = #ms
  local ascending, last, next_off = true, -1, S.next
  local undelivered = nil
  for i = 1, n do
    local off = offs[i]
    if off >= next_off then
      if not each then
        fail('NOT_FOUND', 'record ' .. ms[i] .. ' has not been delivered to this group (next is ' .. fmt(next_off) .. ')')
      end
      undelivered = undelivered or {}
      undelivered[i] = true
    end
    if off <= last then ascending = false end
    last = off
  end
  if undelivered then
    -- settle the others on their own, then put the -1s in their places
    local dms, doffs = {}, {}
    for i = 1, n do
      if not undelivered[i] then
        dms[#dms + 1], doffs[#doffs + 1] = ms[i], offs[i]
      end
    end
    local got = #dms > 0 and ack_many(K, S, dms, doffs, true) or {}
    local out, j = {}, 0
    for i = 1, n do
      if undelivered[i] then
        out[i] = -1
      else
        j = j + 1
        out[i] = got[j]
      end
    end
    return out
  end
  local uniq, first = ms, nil
  if not ascending then
    local given = offs
    uniq, first, offs = {}, {}, {}
    for i = 1, n do
      local m = ms[i]
      if not first[m] then
        first[m] = i
        uniq[#uniq + 1] = m
        offs[#offs + 1] = given[i]
      end
    end
    table.sort(offs)
  end
  -- unfinished = in flight (lease) or owed; anything else delivered is finished already
  local unfinished = uniq
  local removed, taken = unlease(K, offs)
  local finished, notyet = nil, nil
  if removed < #uniq then
    -- some were owed or finished: tell them apart. The done runs and the redo marks are
    -- untouched so far, so is_finished still answers for the state before this ack.
    unfinished, finished = {}, {}
    local owed, owed_scores = {}, {}
    if K.types.owed ~= 'none' then owed_scores = call_many('ZMSCORE', K.owed, uniq) end
    for j, m in ipairs(uniq) do
      if taken[tonumber(m)] then
        unfinished[#unfinished + 1] = m
      elseif owed_scores[j] then
        owed[#owed + 1] = m
        unfinished[#unfinished + 1] = m
      elseif is_finished(K, S, m, tonumber(m)) then
        finished[m] = true
      elseif K.due and S.sk > 0 and not_yet_due(K, S, m) then
        -- a delayed record the group passed over, never delivered
        if not each then
          fail('NOT_FOUND', 'record ' .. m .. ' has not been delivered to this group (it is not due yet)')
        end
        notyet = notyet or {}
        notyet[m] = true
      else
        unfinished[#unfinished + 1] = m
      end
    end
    if #owed > 0 then call_many('ZREM', K.owed, owed) end
  end
  local out = nil
  if statuses then
    out = {}
    for i, m in ipairs(ms) do
      if notyet and notyet[m] then
        out[i] = -1
      else
        out[i] = ((not first or first[m] == i) and not (finished and finished[m])) and 1 or 0
      end
    end
  end
  if #unfinished > 0 then
    -- in order (uniq itself, all unfinished): offs lines up with the members
    if unfinished ~= uniq then offs = nil end
    finish_many(K, S, unfinished, offs, offs and ascending)
  end
  return out
end

-- A run of offsets 'FIRST-LAST' (a poll's acks when they are consecutive: the previous
-- batch, the usual case) as two numbers; fails INVALID unless both are offsets written
-- plainly (no sign, leading zero or exponent), FIRST < LAST, at most 10000 offsets.
-- Writes nothing.
local function run_arg(v, what)
  local a_s, b_s = s_match(v, '^(%d+)%-(%d+)$')
  local a, b = a_s and #a_s <= 15 and #b_s <= 15 and tonumber(a_s), b_s and tonumber(b_s)
  if not a or not b or (#a_s > 1 and s_byte(a_s, 1) == 48) or (#b_s > 1 and s_byte(b_s, 1) == 48)
      or a >= b or b - a >= 10000 or b > 2 ^ 52 then
    fail('INVALID', what .. " must be offsets or one run 'FIRST-LAST' (FIRST < LAST, at most 10000), got "
      .. s_sub(v, 1, 40))
  end
  return a, b
end

-- Acks the delivered records a..b exactly as ack_many does for their offsets (a poll's
-- acks: one never delivered fails the call before its first write). The usual case
-- costs no string nor table per record: the run is one whole lease (so every record in
-- it is in flight, none owed nor finished: leases never overlap and hold only records
-- in flight) at or above the position, with no attempts to drop nor owners (anonymous
-- leases); then ack_many would remove that lease and move the position over the run or
-- remember it as a done run, which is what is done here. Anything else goes through
-- ack_many. The records of one lease were all leased by one poll with the same
-- attempts (group_poll: a lease is a run of new records, or of redelivered ones with
-- the same attempts, and later leases are only pieces of it), and only a record leased
-- again after its first delivery has an attempts entry (written when it is leased;
-- the others take theirs when they leave their lease): so where the attempts key
-- exists, the lease's first record tells for all of them.
local function ack_run(K, S, a, b)
  if b >= S.next then
    fail('NOT_FOUND', 'record ' .. fmt(math.max(a, S.next)) .. ' has not been delivered to this group (next is '
      .. fmt(S.next) .. ')')
  end
  if a >= S.pos and not S.cons
      and (K.types.attempts == 'none' or redis.call('HEXISTS', K.attempts, fmt(a)) == 0) then
    local first, last = lease_holding(K, a)
    if first == a and last == b then
      local m = fmt(a)
      redis.call('ZREM', K.lease, m)
      redis.call('ZREM', K.held, m)  -- (lease_holding found the lease in held)
      mark_run_done(K, S, a, b)
      return
    end
  end
  local ms, offs = {}, {}
  for off = a, b do
    ms[#ms + 1], offs[#offs + 1] = fmt(off), off
  end
  ack_many(K, S, ms, offs)
end

-- The claim (off, attempts) must be current: record in flight, same attempts, lease
-- not lapsed. Returns the record's member string and its lease {first, last, expiry}
-- (for unlease); fails STALE_CLAIM otherwise.
local function check_claim(K, S, off, attempts, now)
  local m = fmt(off)
  if off >= S.tail then
    fail('NOT_FOUND', 'offset ' .. m .. ' does not exist (the tail is ' .. fmt(S.tail) .. ')')
  end
  local first, last = lease_holding(K, off)
  local expiry = first and redis.call('ZSCORE', K.lease, fmt(first))
  if not expiry then
    if off >= S.next then fail('STALE_CLAIM', 'record ' .. m .. ' has not been delivered') end
    if is_finished(K, S, m, off) then fail('STALE_CLAIM', 'record ' .. m .. ' is already finished') end
    fail('STALE_CLAIM', 'record ' .. m .. ' is not in flight (its lease lapsed or it was nacked)')
  end
  local current = tonumber(redis.call('HGET', K.attempts, m)) or 1
  if attempts > current then
    fail('STALE_CLAIM', 'the claim ' .. m .. ' with attempts ' .. fmt(attempts) .. ' does not match any delivery: '
      .. 'record ' .. m .. ' was delivered ' .. fmt(current) .. ' time' .. (current == 1 and '' or 's') .. ' so far')
  end
  if current ~= attempts then
    fail('STALE_CLAIM', 'the claim of record ' .. m .. ' with attempts ' .. fmt(attempts) .. ' is stale: '
      .. 'the record was delivered again (attempts now ' .. fmt(current) .. ')')
  end
  if tonumber(expiry) <= now then
    fail('STALE_CLAIM', 'the lease on record ' .. m .. ' lapsed')
  end
  return m, {first, last, expiry}
end
