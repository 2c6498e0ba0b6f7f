-- group: load, check and update one consumer group's state on one shard.
-- The group key block: scripts that include it receive KEYS in this order
-- (felix_redis.keys: SHARD_ROLES, then GROUP_ROLES); their headers name the keys only.
-- KEYS[1] meta       hash: shard settings, tail (next offset), first (first offset kept)
-- KEYS[2] log        stream: the records, entry ID OFFSET-PUBLISHMS
-- KEYS[3] group      hash: vt (ms), max (attempts), pos, next, wseq, cons, trimmed, top
--                    (FIRST-LAST: the highest finished run above pos), created
-- KEYS[4] lease      zset: leases, member = the FIRST offset of a range of in-flight
--                    records (KEYS[13]), score = its expiry (ms)
-- KEYS[5] owed       zset: offsets waiting for redelivery, score = due time (ms)
-- KEYS[6] attempts   hash: offset -> deliveries so far, for unfinished delivered records
-- KEYS[7] done       zset: runs of finished offsets above the position (below top),
--                    member FIRST scored LAST
-- KEYS[8] redo       zset: redriven offsets below the position, score = offset
-- KEYS[9] dead       hash: offset -> "ATTEMPTS|MS|REASON" dead-letter pointers
-- KEYS[10] owner     hash: offset -> consumer name holding the lease (named consumers)
-- KEYS[11] byowner   zset: "CONSUMER|OFFSET" members, score 0, for reclaim
-- KEYS[12] wake      stream: one entry per wake-up, long-polling consumers block on it
-- KEYS[13] held      zset: the leases' ranges, member FIRST offset scored LAST offset

--- @include "roles"
--- @include "acl"

local GROUP_KEY_TYPES = {{'meta', 'hash'}, {'log', 'stream'}}
for _, rt in ipairs(GROUP_ROLE_TYPES) do GROUP_KEY_TYPES[#GROUP_KEY_TYPES + 1] = rt end

-- K: role -> key name, and K.types: role -> the key's type ('none' when missing) once
-- load_group has checked them all.
local function group_keys()
  -- table constructors size the tables once (filling them key by key rehashes 4 times)
  return {
    meta = KEYS[1], log = KEYS[2], group = KEYS[3], lease = KEYS[4], owed = KEYS[5],
    attempts = KEYS[6], done = KEYS[7], redo = KEYS[8], dead = KEYS[9], owner = KEYS[10],
    byowner = KEYS[11], wake = KEYS[12], held = KEYS[13],
    types = {
      meta = false, log = false, group = false, lease = false, owed = false, attempts = false,
      done = false, redo = false, dead = false, owner = false, byowner = false, wake = false,
      held = false,
    },
  }
end

-- Checks the type of every key of the group (WRONGTYPE on a foreign type) and records
-- it: a missing key then costs no command where it would only be read or cleaned. The
-- check is the type's own size command (an integer reply is cheaper than TYPE's status
-- reply); only a WRONGTYPE error asks TYPE, for the message. The keys most groups never
-- have (attempts: redeliveries, redo: redrives, owner/byowner: named consumers) are
-- answered for together by one EXISTS, and checked one by one only when some exist. The
-- meta and group hashes are checked by load_group's reads (typed_call).
local SIZE_OF = {hash = 'HLEN', zset = 'ZCARD', stream = 'XLEN'}
local RARE_ROLES = {'attempts', 'redo', 'owner', 'byowner'}
local OTHER_ROLES = {'log', 'lease', 'held', 'owed', 'dead', 'wake', 'done'}
local ROLE_TYPE = {}
for _, kt in ipairs(GROUP_KEY_TYPES) do ROLE_TYPE[kt[1]] = kt[2] end

local function check_type(K, role)
  local want = ROLE_TYPE[role]
  local n = redis.pcall(SIZE_OF[want], K[role])
  if type(n) == 'table' then
    expect_type(K[role], want)
    error(n, 0)
  end
  K.types[role] = n > 0 and want or 'none'
end

-- Calls fn(first, last) for each stretch of consecutive offsets in the ascending list
-- offs.
local function each_stretch(offs, fn)
  local i, n = 1, #offs
  while i <= n do
    local j = i
    while j < n and offs[j + 1] == offs[j] + 1 do j = j + 1 end
    fn(offs[i], offs[j])
    i = j + 1
  end
end

local function check_types(K)
  if redis.call('EXISTS', K.attempts, K.redo, K.owner, K.byowner) == 0 then
    for _, role in ipairs(RARE_ROLES) do K.types[role] = 'none' end
  else
    for _, role in ipairs(RARE_ROLES) do check_type(K, role) end
  end
  for _, role in ipairs(OTHER_ROLES) do check_type(K, role) end
end

-- redis.call(cmd, key, members...) in chunks (Lua's unpack has a limit); returns the
-- replies' sum (integer replies) or their concatenation (array replies); 0 for no
-- members (no command is sent). The members are unpacked in place: no argument list is
-- copied. CHUNK is even, so that pairs (ZADD, HSET) never straddle two calls.
local CHUNK = 1000
local function call_many(cmd, key, members)
  local n = #members
  if n == 0 then return 0 end
  if n <= CHUNK then return redis.call(cmd, key, unpack(members, 1, n)) end
  local total, parts = 0, nil
  for i = 1, n, CHUNK do
    local r = redis.call(cmd, key, unpack(members, i, math.min(i + CHUNK - 1, n)))
    if type(r) == 'table' then
      parts = parts or {}
      for _, v in ipairs(r) do parts[#parts + 1] = v end
    else
      total = total + r
    end
  end
  return parts or total
end

-- Checks every key's type, that the stream (shard) and the group exist; returns the
-- group's state S. Nothing is written.
local function load_group(K)
  check_types(K)
  local tail_s = typed_call('hash', 'HGET', K.meta, 'tail')
  local g = typed_call('hash', 'HMGET', K.group, 'vt', 'max', 'pos', 'next', 'wseq', 'cons', 'trimmed', 'top')
  if not tail_s and not g[1] then fail('NOT_FOUND', 'stream (or shard) does not exist') end
  if not g[1] then fail('NOT_FOUND', 'group does not exist') end
  local top_first, top_last = false, false
  if g[8] then
    local f, l = s_match(g[8], '^(%d+)%-(%d+)$')
    if not f then fail('WRONGTYPE', 'field top of ' .. K.group .. ' is not FIRST-LAST: ' .. s_sub(g[8], 1, 40)) end
    top_first, top_last = tonumber(f), tonumber(l)
  end
  return {
    tail = shard_tail(tail_s, K.log),
    vt = tonumber(g[1]), max = tonumber(g[2]), pos = tonumber(g[3]), next = tonumber(g[4]),
    wseq = tonumber(g[5]), cons = g[6] == '1', trimmed = tonumber(g[7] or '0'),
    top_first = top_first, top_last = top_last, loaded_top_first = top_first, loaded_top_last = top_last,
    dirty = false, loaded = g,
  }
end

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

local function save_group(K, S)
  if S.dirty then
    -- the position fields always; the others when they changed
    local args, g = {'pos', fmt(S.pos), 'next', fmt(S.next)}, S.loaded
    local wseq, cons, trimmed = fmt(S.wseq), S.cons and '1' or '0', fmt(S.trimmed)
    if wseq ~= g[5] then args[#args + 1] = 'wseq'; args[#args + 1] = wseq end
    if cons ~= g[6] then args[#args + 1] = 'cons'; args[#args + 1] = cons end
    if trimmed ~= (g[7] or '0') then args[#args + 1] = 'trimmed'; args[#args + 1] = trimmed end
    -- the top run (formatted only when it changed)
    local top_first, top_last = S.top_first, S.top_last
    local top_changed = top_first ~= S.loaded_top_first or top_last ~= S.loaded_top_last
    if top_changed and top_first then
      args[#args + 1] = 'top'
      args[#args + 1] = fmt(top_first) .. '-' .. fmt(top_last)
    end
    redis.call('HSET', K.group, unpack(args))
    if top_changed and not top_first then redis.call('HDEL', K.group, 'top') end
  end
end

-- Wakes long-polling consumers of this group (they block on the wake stream).
local function wake(K, S)
  S.wseq = S.wseq + 1
  S.dirty = true
  redis.call('XADD', K.wake, 'MAXLEN', '1', fmt(S.wseq) .. '-1', 'w', '1')
end

-- Forgets which consumer holds record m.
local function release_owner(K, S, m)
  if S.cons then
    local c = redis.call('HGET', K.owner, m)
    if c then
      redis.call('HDEL', K.owner, m)
      redis.call('ZREM', K.byowner, c .. '|' .. m)
    end
  end
end

-- The finished records above the position are kept as runs of consecutive offsets that
-- never overlap nor touch (neighbours merge when a run is added) and never hold an
-- unfinished record, so there is at most one run more than there are unfinished records
-- above the position, however many records finished while one was held back; a poll's
-- cost does not grow with them. The highest run may be kept in the group hash (field
-- top, 'FIRST-LAST'; S.top_first and S.top_last, false when there is none); the others
-- are in the done key, sorted-set members FIRST (the run's first offset) scored LAST
-- (its last), all below the top run. While the position is held back (as it is
-- whenever another consumer holds a record before them), acks in order extend the top
-- run without a command.

-- The run holding offset off (> S.pos): its first and last offsets; nil when none.
local function run_holding(K, S, off)
  local top_first = S.top_first
  if top_first and off >= top_first then
    if off <= S.top_last then return top_first, S.top_last end
    return nil
  end
  if K.types.done == 'none' then return nil end
  local r = redis.call('ZRANGE', K.done, fmt(off), '+inf', 'BYSCORE', 'LIMIT', '0', '1', 'WITHSCORES')
  if #r == 0 then return nil end
  local first = tonumber(r[1])
  if first > off then return nil end
  return first, tonumber(r[2])
end

-- The member of the run in the done key that ends at offset last, or nil.
local function run_ending(K, last)
  if K.types.done == 'none' then return nil end
  local m = fmt(last)
  return redis.call('ZRANGE', K.done, m, m, 'BYSCORE')[1]
end

-- Marks the unfinished records a..b (S.pos < a) finished, merged with the runs next to
-- them. b < S.next, except for records retention trimmed before a poll handed them out
-- (skip_trimmed, before the poll moves S.next past them): nothing lies above those.
local function add_run(K, S, a, b)
  local top_first, top_last = S.top_first, S.top_last
  if top_first then
    if a == top_last + 1 then
      -- the usual case: the top run grows (nothing lies above it)
      S.top_last = b
      S.dirty = true
      return
    elseif a > top_last + 1 then
      -- a new top run; the old one goes to the done key
      redis.call('ZADD', K.done, fmt(top_last), fmt(top_first))
      K.types.done = 'zset'
      S.top_first, S.top_last = a, b
      S.dirty = true
      return
    elseif b + 1 == top_first then
      -- just below the top run: they merge, and with the run before, if any
      local before = run_ending(K, a - 1)
      if before then
        redis.call('ZREM', K.done, before)
        a = tonumber(before)
      end
      S.top_first = a
      S.dirty = true
      return
    end
  end
  -- further below the top run, or there is none
  local before = run_ending(K, a - 1)
  local first, last = before or fmt(a), b
  if b + 1 < S.next and K.types.done ~= 'none' then
    local after = fmt(b + 1)
    local after_last = redis.call('ZSCORE', K.done, after)
    if after_last then
      last = tonumber(after_last)
      redis.call('ZREM', K.done, after)
    end
  end
  if not top_first and last == S.next - 1 then
    -- nothing can lie above a run that reaches the last delivered record: the top run
    if before then redis.call('ZREM', K.done, before) end
    S.top_first, S.top_last = tonumber(first), last
    S.dirty = true
    return
  end
  redis.call('ZADD', K.done, fmt(last), first)
  K.types.done = 'zset'
end

-- Moves S.pos over the run of finished records starting at it, if any (at most one
-- command; runs are maximal, so one run is all there can be).
local function advance_done(K, S)
  if S.top_first == S.pos then
    S.pos = S.top_last + 1
    S.top_first, S.top_last = false, false
    S.dirty = true
    return
  end
  if K.types.done == 'none' then return end
  local m = fmt(S.pos)
  local last = redis.call('ZSCORE', K.done, m)
  if not last then return end
  redis.call('ZREM', K.done, m)
  S.pos = tonumber(last) + 1
  S.dirty = true
end

-- Makes finished record off (> S.pos) unfinished again (a redrive): its run is split.
local function unfinish_above(K, S, off)
  local first, last = run_holding(K, S, off)
  if not first then return end
  if first == S.top_first then
    -- the part above off stays the top run; the part below goes to the done key
    if last > off then
      S.top_first = off + 1
      if first < off then
        redis.call('ZADD', K.done, fmt(off - 1), fmt(first))
        K.types.done = 'zset'
      end
    elseif first < off then
      S.top_last = off - 1
    else
      S.top_first, S.top_last = false, false
    end
    S.dirty = true
    return
  end
  redis.call('ZREM', K.done, fmt(first))
  if first < off then redis.call('ZADD', K.done, fmt(off - 1), fmt(first)) end
  if last > off then redis.call('ZADD', K.done, fmt(last), fmt(off + 1)) end
end

-- Marks offset off finished for the position: advance over a contiguous run, or
-- remember it above the position, or (below the position) drop its redrive mark.
local function mark_done(K, S, off)
  if off < S.pos then
    redis.call('ZREM', K.redo, fmt(off))
  elseif off == S.pos then
    S.pos = off + 1
    advance_done(K, S)
    S.dirty = true
  else
    add_run(K, S, off, off)
  end
end

-- True when a delivered record (off < S.next) is finished.
local function is_finished(K, S, m, off)
  if off < S.pos then return redis.call('ZSCORE', K.redo, m) == false end
  return run_holding(K, S, off) ~= nil
end

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

-- Acks the delivered records ms, offsets offs (from offset_args): each leaves no group state
-- behind and the position advances over any contiguous run of finished records. Acking
-- a finished record changes nothing; acking a stale claim whose record is unfinished
-- (owed, or in flight under a newer lease) finishes it. Fails NOT_FOUND, before its
-- first write, when an offset was never delivered. With statuses, returns one status
-- per member: 1 acked now, 0 already finished (or repeated in ms). The caller saves S
-- (save_group).
local function ack_many(K, S, ms, offs, statuses)
  -- offsets in strictly ascending order (a poll's records usually are) repeat none: no
  -- table of the members seen is needed
  local n = #ms
  local ascending, last, next_off = true, -1, S.next
  for i = 1, n do
    local off = offs[i]
    if off >= next_off then
      fail('NOT_FOUND', 'record ' .. ms[i] .. ' has not been delivered to this group (next is ' .. fmt(next_off) .. ')')
    end
    if off <= last then ascending = false end
    last = off
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
  local finished = nil
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
      elseif not is_finished(K, S, m, tonumber(m)) then
        unfinished[#unfinished + 1] = m
      else
        finished[m] = true
      end
    end
    if #owed > 0 then call_many('ZREM', K.owed, owed) end
  end
  local out = nil
  if statuses then
    out = {}
    for i, m in ipairs(ms) do
      out[i] = ((not first or first[m] == i) and not (finished and finished[m])) and 1 or 0
    end
  end
  if #unfinished > 0 then
    -- in order (uniq itself, all unfinished): offs lines up with the members
    if unfinished ~= uniq then offs = nil end
    finish_many(K, S, unfinished, offs, offs and ascending)
  end
  return out
end

-- Records a dead letter (a pointer: attempts, time, reason) and finishes the record.
local function dead_letter(K, S, off, attempts, reason, now)
  redis.call('HSET', K.dead, fmt(off), fmt(attempts) .. '|' .. fmt(now) .. '|' .. reason)
  finish(K, S, off)
end

-- Dead letters read per call of a redrive or discard of them all (an HSCAN COUNT).
local DEAD_SCAN = 1000

-- True when the log holds record m (a member string): retention has not trimmed it.
local function in_log(K, m)
  return #redis.call('XRANGE', K.log, m, m, 'COUNT', 1) > 0
end

-- The dead letters a redrive or discard (verb) acts on, as members, and the next HSCAN
-- cursor ('0' when done), by ARGV[1] mode: 'list', the offsets ARGV[3..], each checked
-- to be a dead letter (and, with logged, to be in the log) before anything is written;
-- 'all', the next chunk of them from cursor ARGV[2] (with logged, those in the log).
local function dead_targets(K, verb, logged)
  local mode, targets, cursor = ARGV[1], {}, '0'
  if mode == 'list' then
    if #ARGV < 3 or #ARGV > 10002 then fail('INVALID', verb .. ' takes 1 to 10000 offsets') end
    for i = 3, #ARGV do
      local m = fmt(int_arg(ARGV[i], 'offset', 0, 2 ^ 52))
      if redis.call('HEXISTS', K.dead, m) == 0 then
        fail('NOT_FOUND', 'record ' .. m .. ' is not a dead letter of this group')
      end
      if logged and not in_log(K, m) then
        fail('NOT_FOUND', 'record ' .. m .. ' was trimmed from the log; discard it instead')
      end
      targets[#targets + 1] = m
    end
  elseif mode == 'all' then
    local scan = redis.call('HSCAN', K.dead, ARGV[2], 'COUNT', DEAD_SCAN)
    cursor = scan[1]
    for i = 1, #scan[2], 2 do
      local m = scan[2][i]
      -- trimmed records cannot be redelivered: they stay dead letters
      if not logged or in_log(K, m) then targets[#targets + 1] = m end
    end
  else
    fail('INVALID', "mode must be 'all' or 'list'")
  end
  return targets, cursor
end

-- Records in [a, b] that retention trimmed before they were delivered: counted, finished.
local function skip_trimmed(K, S, a, b)
  if a == S.pos then
    -- nothing unfinished before them: the position jumps over the whole run
    S.pos = b + 1
    advance_done(K, S)
  elseif a > S.pos then
    add_run(K, S, a, b)
  else
    for off = a, b do mark_done(K, S, off) end
  end
  S.trimmed = S.trimmed + (b - a + 1)
  S.dirty = true
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
  if current ~= attempts then
    fail('STALE_CLAIM', 'the claim of record ' .. m .. ' with attempts ' .. fmt(attempts) .. ' is stale: '
      .. 'the record was delivered again (attempts now ' .. fmt(current) .. ')')
  end
  if tonumber(expiry) <= now then
    fail('STALE_CLAIM', 'the lease on record ' .. m .. ' lapsed')
  end
  return m, {first, last, expiry}
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
