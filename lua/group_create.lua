-- group_create: create a consumer group on one shard, starting at the earliest record,
-- the tail ('latest') or an offset. Safe to run twice: with strict=0 an existing group
-- is left as it is.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[14] due       zset: the shard's due index (optional: lua/includes/group.lua). With it
--                    the group starts its due cursor now and, when it starts above delayed
--                    records not yet due, notes the latest of their due times (dpre) for
--                    describe
-- KEYS[15] groups    set: names of the groups on this shard
-- ARGV[1] name        the group name: the one KEYS[3] is of
-- ARGV[2] start       'earliest', 'latest' or an offset (integer, 0..tail)
-- ARGV[3] vt_ms       integer 1..604800000, visibility timeout (lease length) in ms
-- ARGV[4] max_attempts integer 1..1000000, deliveries before a record is dead-lettered
-- ARGV[5] strict      '1': fail if the group exists; '0': return 0
-- ARGV[6] check       '1': validate only and write nothing; '0': create
-- ARGV[7] rate        'COUNT PER_MS' rate limit (as group_configure), '' or absent: none
--
-- Role: group.manage, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:manage, derived from KEYS[3]; never passed nor accessed.
-- Returns: 1 when created, 0 when it existed (strict=0) or check=1.
-- Errors: FELIX_NOPERM (no group.manage role), FELIX_NOT_FOUND (no such stream or shard), FELIX_GROUP_EXISTS (strict=1),
-- FELIX_INVALID (bad start, timeout or attempts; a name or key not the group's), FELIX_WRONGTYPE.
--- @include "group"
--- @include "due"
require_group_role('group.manage')
local K = group_role_keys()
local name, start = ARGV[1], ARGV[2]
if name ~= group_shape().group then
  fail('INVALID', 'ARGV[1] names group ' .. tostring(name) .. ', KEYS are those of group ' .. group_shape().group)
end
local vt = int_arg(ARGV[3], 'visibility_timeout_ms', 1, 604800000)
local max = int_arg(ARGV[4], 'max_attempts', 1, 1000000)
local rate = ARGV[7] or ''
if rate ~= '' then rate = check_rate(rate) end
for _, kt in ipairs(GROUP_KEY_TYPES) do expect_type(K[kt[1]], kt[2]) end
local GROUPS = KEYS[#KEYS]
if GROUPS ~= group_shape().groups then
  fail('INVALID', 'the last key is ' .. tostring(GROUPS) .. ', not ' .. group_shape().groups)
end
expect_type(GROUPS, 'set')
if K.due then expect_type(K.due, 'zset') end
if redis.call('EXISTS', K.meta) == 0 then fail('NOT_FOUND', 'stream (or shard) does not exist') end
-- the tail and the first record kept, as the log has them where meta was written by hand
local tail = shard_tail(redis.call('HGET', K.meta, 'tail'), K.log)
local first = log_first(K.log, tail)
local pos
if start == 'earliest' then
  pos = first
elseif start == 'latest' then
  pos = tail
else
  pos = int_arg(start, 'start offset', 0, 2 ^ 52)
  if pos > tail then
    fail('INVALID', 'start offset ' .. start .. ' is beyond the tail (' .. fmt(tail) .. ')')
  end
  if pos < first then pos = first end
end
if redis.call('EXISTS', K.group) == 1 then
  if ARGV[5] == '1' then fail('GROUP_EXISTS', 'group exists already') end
  return 0
end
if ARGV[6] == '1' then return 0 end
local now = now_ms()
-- The wake sequence starts at the server time (ms), and above a wake stream left behind
-- (a group hash removed by hand or by eviction): the first wake-up below can always be
-- written (read before any write)
local wseq = now
local left = redis.call('XREVRANGE', K.wake, '+', '-', 'COUNT', 1)
if left[1] then
  local top = tonumber(s_match(left[1][1], '^%d+'))
  if top and top >= wseq then wseq = top + 1 end
end
local fields = {'name', name, 'vt', fmt(vt), 'max', fmt(max), 'pos', fmt(pos),
  'next', fmt(pos), 'wseq', fmt(wseq), 'cons', '0', 'trimmed', '0', 'created', fmt(now)}
if K.due and redis.call('HEXISTS', K.meta, 'dmax') == 1 then
  -- delayed records were published: due times up to now are the scan's (the group meets
  -- those records due), and delayed records below where it starts are not its own. (A
  -- group made before the first delayed record needs neither: its first poll after one
  -- sets the due cursor before it scans.)
  fields[#fields + 1] = 'dly'
  fields[#fields + 1] = fmt(now) .. ' ' .. fmt(pos) .. ' 0'
  if pos > first then
    local latest = due_latest(K.due)
    if latest and latest > now then
      fields[#fields + 1] = 'dpre'
      fields[#fields + 1] = fmt(latest)
    end
  end
end
if rate and rate ~= '' then
  fields[#fields + 1] = 'rate'
  fields[#fields + 1] = rate
end
redis.call('HSET', K.group, unpack(fields))
redis.call('SADD', GROUPS, name)
-- The group is made with a wake-up, above the wake sequence of a group of this name
-- deleted before (unless the server's clock is behind it): a consumer that knew the shard
-- idle under that group (its wake point below this one) looks again.
redis.call('XADD', K.wake, 'MAXLEN', '1', fmt(wseq) .. '-1', 'w', '1')
return 1
