-- group: one consumer group's state on one shard: its keys and their types, loading
-- and saving the state (S), waking long-pollers, releasing an owner.
-- The group key block: scripts that include it receive KEYS in this order
-- (felix_redis.keys: SHARD_ROLES, then GROUP_ROLES); their headers stand for it with
-- the one line "-- KEYS[1]..KEYS[13]: the group key block" (tests/test_scripts.py expands it).
-- KEYS[1] meta       hash: shard settings, tail (next offset), first (first offset kept)
-- KEYS[2] log        stream: the records, entry ID OFFSET-PUBLISHMS
-- KEYS[3] group      hash: vt (ms), max (attempts), pos, next, wseq, cons, trimmed, top
--                    (FIRST-LAST: the highest finished run above pos), created, and for
--                    delayed records dly ('DCUR BASE SK[ DOFF]': the due cursor (ms), the
--                    offset the group started at, the delayed records passed over and
--                    not yet handed out, and when the cursor stands inside a due time,
--                    the last offset of it handled) and dpre; rate ('COUNT PER_MS START TAKEN': the limit and the
--                    current window's start (ms) and hand-outs) when rate limited;
--                    lead ('WAITER EXPIRY_MS': the long-poller watching for the group,
--                    lua/group_poll.lua)
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
-- After the block some scripts take the shard's groups set and its due index
-- (felix:{TAG}:due, zset: the delayed records' offsets by due time, lua/includes/due.lua).

--- @include "roles"
--- @include "acl"

local GROUP_KEY_TYPES = {{'meta', 'hash'}, {'log', 'stream'}}
for _, rt in ipairs(GROUP_ROLE_TYPES) do GROUP_KEY_TYPES[#GROUP_KEY_TYPES + 1] = rt end

-- K: role -> key name, and K.types: role -> the key's type ('none' when missing) once
-- load_group has checked them all.
local function group_role_keys()
  -- table constructors size the tables once (filling them key by key rehashes 4 times)
  return {
    meta = KEYS[1], log = KEYS[2], group = KEYS[3], lease = KEYS[4], owed = KEYS[5],
    attempts = KEYS[6], done = KEYS[7], redo = KEYS[8], dead = KEYS[9], owner = KEYS[10],
    byowner = KEYS[11], wake = KEYS[12], held = KEYS[13], due = passed_key('due'),
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
  local mt = typed_call('hash', 'HMGET', K.meta, 'tail', 'tlast', 'dmax')
  local tail_s = mt[1]
  local g = typed_call('hash', 'HMGET', K.group, 'vt', 'max', 'pos', 'next', 'wseq', 'cons', 'trimmed', 'top',
    'dly', 'rate', 'lead')
  if not tail_s and not g[1] then fail('NOT_FOUND', 'stream (or shard) does not exist') end
  if not g[1] then fail('NOT_FOUND', 'group does not exist') end
  local top_first, top_last = false, false
  if g[8] then
    local f, l = s_match(g[8], '^(%d+)%-(%d+)$')
    if not f then fail('WRONGTYPE', 'field top of ' .. K.group .. ' is not FIRST-LAST: ' .. s_sub(g[8], 1, 40)) end
    top_first, top_last = tonumber(f), tonumber(l)
  end
  -- the due index is read only where delayed records were ever published (dmax)
  if K.due and mt[3] then expect_type(K.due, 'zset') end
  -- delayed records: 'DCUR BASE SK'; the rate limit: 'COUNT PER_MS[ START TAKEN]'
  local dcur, dbase, sk, doff = 0, 0, 0, false
  if g[9] then
    local a, b, c, o = s_match(g[9], '^(%d+) (%d+) (%d+) ?(%d*)$')
    if a then dcur, dbase, sk = tonumber(a), tonumber(b), tonumber(c) end
    if o and o ~= '' then doff = tonumber(o) end
  end
  local rate, rate_count, rate_per, rwin_start, rwin_taken = false, false, false, 0, 0
  if g[10] then
    local c, per, start, taken = s_match(g[10], '^(%d+) (%d+) ?(%d*) ?(%d*)$')
    if c then
      rate, rate_count, rate_per = c .. ' ' .. per, tonumber(c), tonumber(per)
      rwin_start, rwin_taken = tonumber(start) or 0, tonumber(taken) or 0
    end
  end
  return {
    tail = shard_tail(tail_s, K.log),
    vt = tonumber(g[1]), max = tonumber(g[2]), pos = tonumber(g[3]), next = tonumber(g[4]),
    wseq = tonumber(g[5]), cons = g[6] == '1', trimmed = tonumber(g[7] or '0'),
    top_first = top_first, top_last = top_last, loaded_top_first = top_first, loaded_top_last = top_last,
    -- timed records (lua/includes/records.lua): the last offset of one with a due time,
    -- expiry or headers (-1: none), the latest due time in the shard's due index (0:
    -- none), this group's due cursor (due times up to it are handled), the offset the
    -- group started at, and how many delayed records it passed that are not yet due
    tlast = tonumber(mt[2]) or -1, dmax = tonumber(mt[3]) or 0,
    dcur = dcur, base = dbase, sk = sk, doff = doff, loaded_dly = g[9],
    -- the rate limit ('COUNT PER_MS', or false), and its window's start (ms) and hand-outs
    rate = rate, rate_count = rate_count, rate_per = rate_per, rwin_start = rwin_start, rwin_taken = rwin_taken,
    rwin_changed = false,
    dirty = false, loaded = g,
  }
end

local function save_group(K, S)
  if S.dirty then
    -- the position fields always; the others when they changed
    local args, g = {'pos', fmt(S.pos), 'next', fmt(S.next)}, S.loaded
    local wseq, cons, trimmed = fmt(S.wseq), S.cons and '1' or '0', fmt(S.trimmed)
    if wseq ~= g[5] then args[#args + 1] = 'wseq'; args[#args + 1] = wseq end
    if cons ~= g[6] then args[#args + 1] = 'cons'; args[#args + 1] = cons end
    if trimmed ~= (g[7] or '0') then args[#args + 1] = 'trimmed'; args[#args + 1] = trimmed end
    if S.loaded_dly or S.dcur > 0 then
      local dly = fmt(S.dcur) .. ' ' .. fmt(S.base) .. ' ' .. fmt(S.sk)
      if S.doff then dly = dly .. ' ' .. fmt(S.doff) end
      if dly ~= S.loaded_dly then
        args[#args + 1] = 'dly'
        args[#args + 1] = dly
      end
    end
    if S.rwin_changed then
      args[#args + 1] = 'rate'
      args[#args + 1] = S.rate .. ' ' .. fmt(S.rwin_start) .. ' ' .. fmt(S.rwin_taken)
    end
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

-- A rate limit argument 'COUNT PER_MS' checked (COUNT 1..1000000, PER_MS 1..86400000),
-- as stored; false for '0 0' (no limit).
local function check_rate(arg)
  if arg == '0 0' then return false end
  local c, per = s_match(arg, '^(%d+) (%d+)$')
  if not c or #c > 7 or #per > 9 or tonumber(c) < 1 or tonumber(c) > 1000000 or tonumber(per) < 1
      or tonumber(per) > 86400000 then
    fail('INVALID', "rate limit must be 'COUNT PER_MS' (COUNT 1..1000000, PER_MS 1..86400000) or '0 0', got "
      .. s_sub(arg, 1, 40))
  end
  return fmt(tonumber(c)) .. ' ' .. fmt(tonumber(per))
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
