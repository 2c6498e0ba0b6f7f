-- prelude: put in front of every script by the loader (felix_redis/scripts.py).
-- Errors are raised as {felix = 'FELIX_<CODE> <message>'} and turned into an error
-- reply by the loader's epilogue, so they work the same on Redis and on fakeredis.

-- The string functions the hot paths call, as locals: an upvalue is read faster than
-- the global string table's field.
local s_find, s_sub, s_byte, s_format, s_match = string.find, string.sub, string.byte, string.format, string.match

local function fail(code, message)
  error({felix = 'FELIX_' .. code .. ' ' .. message}, 0)
end

-- An integer as a decimal string (tostring would give 1e+15).
local function fmt(n)
  return s_format('%d', n)
end

-- Milliseconds since the epoch, from the Redis server's clock.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The first 3 digits of a microseconds string (1 to 6 digits, not zero-padded) padded
-- to 6, by its length.
local MS_PAD = {'000', '000', '000', '00', '0', ''}

-- now_ms() as a decimal string, made from TIME's strings: for a script that only writes
-- the time into IDs and values, this skips two tonumber (strtod) and a string.format.
local function now_ms_text()
  local t = redis.call('TIME')
  local u = t[2]
  local n = #u
  if n <= 3 then return t[1] .. '000' end
  return t[1] .. MS_PAD[n] .. s_sub(u, 1, n - 3)
end

-- A decimal integer argument within [lo, hi]; anything else fails with INVALID.
local function int_arg(value, what, lo, hi)
  if type(value) ~= 'string' or #value > 16 or not s_match(value, '^%-?%d+$') then
    fail('INVALID', what .. ' must be an integer, got ' .. s_sub(tostring(value), 1, 40))
  end
  local n = tonumber(value)
  if n < lo or n > hi then
    fail('INVALID', what .. ' must be between ' .. fmt(lo) .. ' and ' .. fmt(hi) .. ', got ' .. value)
  end
  return n
end

-- int_arg for an argument that repeats from call to call (a client setting): the
-- values seen are remembered per what (functions keep them between calls; bounded).
local INTS, ints = {}, 0
local function int_arg_seen(value, what, lo, hi)
  local seen = INTS[what]
  local n = seen and seen[value]
  if n then return n end
  n = int_arg(value, what, lo, hi)
  if ints >= 256 then INTS, ints = {}, 0 end
  seen = INTS[what]
  if not seen then seen = {} INTS[what] = seen end
  seen[value], ints = n, ints + 1
  return n
end

-- tonumber of a decimal string this library wrote (a stream setting), remembered like
-- int_arg_seen's values: tonumber is strtod, costly next to a table lookup.
local NUMS, nums = {}, 0
local function setting_num(s)
  local n = NUMS[s]
  if n then return n end
  n = tonumber(s)
  if n then
    if nums >= 256 then NUMS, nums = {}, 0 end
    NUMS[s], nums = n, nums + 1
  end
  return n
end

-- Fails with WRONGTYPE unless key is missing or holds the wanted type; returns its type.
local function expect_type(key, want)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then
    fail('WRONGTYPE', 'key ' .. key .. ' holds a ' .. t .. ' where felix-redis keeps a ' .. want
      .. '; another application wrote it')
  end
  return t
end

-- redis.call for a command on one key that doubles as the key's type check: it must
-- come before the script's first write (a read, or the first write itself), so that a
-- key of the wrong type fails the script, naming the key, with nothing written.
local function typed_call(want, cmd, key, ...)
  local r = redis.pcall(cmd, key, ...)
  if type(r) == 'table' and r.err then
    -- (fakeredis hands the message over as userdata)
    if s_find(tostring(r.err), 'WRONGTYPE', 1, true) then expect_type(key, want) end
    error(r, 0)
  end
  return r
end

-- Offset and publish time (ms) from a log entry ID 'OFFSET-MS'.
local function parse_id(id)
  local dash = s_find(id, '-', 1, true)
  return tonumber(s_sub(id, 1, dash - 1)), s_sub(id, dash + 1)
end

-- The offset after the last entry of a log (0 for an empty or missing one): the tail
-- the log itself implies (an emptied log keeps its last generated ID, read from XINFO
-- STREAM). For a tail that meta does not hold as a number (a publisher may write meta).
local function log_tail(log)
  local last = redis.call('XREVRANGE', log, '+', '-', 'COUNT', 1)[1]
  local id = last and last[1]
  if not id and redis.call('EXISTS', log) == 1 then
    local info = redis.call('XINFO', 'STREAM', log)
    for i = 1, #info, 2 do
      if info[i] == 'last-generated-id' then id = info[i + 1] end
    end
  end
  if not id then return 0 end
  return tonumber(s_match(id, '^%d+')) + 1
end

-- meta's tail (a string) as a number when it is one (a non-negative integer), else the
-- log's: a publisher may write meta by hand, so a missing or garbled tail is no error.
local function shard_tail(tail_s, log)
  local n = tonumber(tail_s)
  if n and n >= 0 and n == math.floor(n) then return n end
  return log_tail(log)
end

-- The offset of the log's first entry, or tail when it holds none: the first record
-- kept, from the log itself (meta's 'first' is only a hint for when to trim; publishers
-- may write it).
local function log_first(log, tail)
  local e = redis.call('XRANGE', log, '-', '+', 'COUNT', 1)[1]
  if not e then return tail end
  return tonumber(s_match(e[1], '^%d+'))
end
