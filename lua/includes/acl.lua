-- acl: role checks against Redis ACL, atomic with the operation they guard.
-- A role is granted by giving the user access (an ACL key pattern) to a
-- capability key: PREFIXcap:{tenant/namespace/stream/shard}:g:GROUP:consume|manage for
-- group roles, PREFIXcap:{...}:publish|admin for stream roles (docs/security.md). The
-- capability key is derived from the shard's hash tag in KEYS[1]; it is never passed,
-- read or written (it holds no data): redis.acl_check_cmd only evaluates whether the
-- calling user could run EXISTS on it (every role holds +exists; the key pattern is what
-- differs). Every key passed must carry that same tag, and a
-- group operation's keys must be exactly its group's, so a capability of one stream or
-- group cannot be used on the keys of another.
-- Backends without ACL (fakeredis, memory://) have no redis.acl_check_cmd: no check.

--- @include "roles"

-- 'PREFIX:{TAG}:' of KEYS[1] (no braces in PREFIX nor in TAG), its PREFIX and TAG.
local function shard_base()
  local k1 = KEYS[1] or ''
  local open = s_find(k1, '[{}]')
  local close = open and s_find(k1, '[{}]', open + 1)
  if not close or open < 2 or s_byte(k1, open - 1) ~= 58 or s_byte(k1, open) ~= 123
      or s_byte(k1, close) ~= 125 then
    fail('INVALID', 'key ' .. tostring(KEYS[1]) .. ' is not a felix-redis shard key')
  end
  return s_sub(k1, 1, open - 2), s_sub(k1, open + 1, close - 1), s_sub(k1, 1, close) .. ':'
end

local function stream_of(tag)
  return (string.gsub(tag, '/[^/]*$', ''))
end

-- Group key lists already checked, by group hash key. Checking is a pure function of
-- the key names, so where the scripts are loaded as functions (which keep their state
-- between calls) a repeated call compares its keys with the list it checked before
-- instead of building every expected name again. Bounded; EVAL starts empty each call.
local SHAPES, shapes = {}, 0

-- The checked shape of a group operation's KEYS: {keys = KEYS[1..n], groups = the
-- shard's groups set key, prefix, tag, group}; fails INVALID on any other key list.
local LAST_SHAPE = false

local function group_shape()
  local k3 = KEYS[3] or ''
  local shape = SHAPES[k3]
  if shape then
    local keys = shape.keys
    for i = 1, #keys do
      if KEYS[i] ~= keys[i] then shape = nil break end
    end
    if shape then
      for i = #keys + 1, #KEYS do
        if KEYS[i] ~= shape.groups and KEYS[i] ~= shape.due and KEYS[i] ~= shape.bell then shape = nil break end
      end
    end
    if shape then LAST_SHAPE = shape return shape end
  end
  local prefix, tag, base = shard_base()
  local group = s_sub(k3, #base + 3)
  if KEYS[1] ~= base .. 'meta' or KEYS[2] ~= base .. 'log' or s_sub(k3, 1, #base + 2) ~= base .. 'g:'
      or group == '' or s_find(group, ':', 1, true) then
    fail('INVALID', 'KEYS[1], KEYS[2] and KEYS[3] are not the meta, log and group keys of one shard')
  end
  local n = #GROUP_ROLE_TYPES
  local keys = {KEYS[1], KEYS[2], k3}
  for i = 2, n do
    local want = k3 .. ':' .. GROUP_ROLE_TYPES[i][1]
    if KEYS[i + 2] ~= want then
      fail('INVALID', 'KEYS[' .. (i + 2) .. '] is ' .. tostring(KEYS[i + 2]) .. ', not ' .. want)
    end
    keys[i + 2] = want
  end
  local groups, due, bell = base .. 'groups', base .. 'due', k3 .. ':bell'
  for i = n + 3, #KEYS do
    if KEYS[i] ~= groups and KEYS[i] ~= due and KEYS[i] ~= bell then
      fail('INVALID', 'KEYS[' .. i .. '] is ' .. KEYS[i] .. ', not ' .. groups .. ', ' .. due .. ' nor ' .. bell)
    end
  end
  shape = {keys = keys, groups = groups, due = due, bell = bell, prefix = prefix, tag = tag, group = group,
           caps = {}}
  if shapes >= 1024 then SHAPES, shapes = {}, 0 end
  SHAPES[k3], shapes = shape, shapes + 1
  LAST_SHAPE = shape
  return shape
end

-- Fails with NOPERM unless the user holds role ('group.consume' or 'group.manage') on
-- the group whose hash is KEYS[3]. The keys must be exactly that group's keys on one
-- shard (GROUP_ROLE_TYPES order), so that the role of one group cannot be used on the
-- keys of another group of the same stream; any key after them is the shard's groups set,
-- its due index or the group's bell.
local function require_group_role(role)
  local shape = group_shape()
  if not redis.acl_check_cmd then return end
  local cap = shape.caps[role]
  if not cap then
    cap = shape.prefix .. 'cap:{' .. shape.tag .. '}:g:' .. shape.group .. ':' .. s_sub(role, 7)
    shape.caps[role] = cap
  end
  if not redis.acl_check_cmd('EXISTS', cap) then
    fail('NOPERM', 'this Redis user lacks the ' .. role .. ' role on group ' .. shape.group .. ' of stream '
      .. stream_of(shape.tag) .. ' (no ACL access to ' .. cap .. ')')
  end
end

-- Streams whose KEYS[1] was parsed already: base, prefix, tag, capability keys and the
-- exact key lists checked (kept between function calls, like the group key lists; bounded).
local STREAMS, streams = {}, 0

-- The parsed shard of KEYS[1]: {prefix, tag, base = 'PREFIX:{TAG}:', caps, keys}.
local function stream_shape()
  local k1 = KEYS[1] or ''
  local sh = STREAMS[k1]
  if not sh then
    local prefix, tag, base = shard_base()
    sh = {prefix = prefix, tag = tag, base = base, caps = {}, keys = {}}
    if streams >= 1024 then STREAMS, streams = {}, 0 end
    STREAMS[k1], streams = sh, streams + 1
  end
  return sh
end

-- The key `name` of the group shape ('due': the shard's due index, a zset of delayed
-- records' offsets by due time; 'bell': the group's bell, a zset long-pollers wait on,
-- lua/group_poll.lua) when the caller passed it among the keys after the group key
-- block (group_shape checked its name), else false: where no key names it, a script
-- does not touch it.
local function passed_key(name)
  -- the shape checked by this call's require_group_role (LAST_SHAPE: its keys are these)
  local shape = LAST_SHAPE
  if not shape or shape.keys[3] ~= KEYS[3] then shape = group_shape() end
  local key = shape[name]
  for i = #GROUP_ROLE_TYPES + 3, #KEYS do
    if KEYS[i] == key then return key end
  end
  return false
end

-- Key lists of the stream scripts: the shard's keys each takes first, by role name.
local SHARD_KEYS_READ = {'meta', 'log'}
local SHARD_KEYS_PUBLISH = {'meta', 'log', 'conf'}
local SHARD_KEYS_INFO = {'meta', 'log', 'groups', 'conf'}

-- Fails with INVALID unless KEYS[1..#names] are exactly the keys `names` of one shard
-- (base .. name), and, unless `more`, there are no other keys. Runs with and without ACL:
-- a script never acts on keys its arguments do not imply. Returns the shard.
local function require_shard_keys(names, more)
  local sh = stream_shape()
  local want = sh.keys[names]
  if not want then
    want = {}
    for i, n in ipairs(names) do want[i] = sh.base .. n end
    sh.keys[names] = want
  end
  if not more and #KEYS ~= #want then
    fail('INVALID', 'this script takes ' .. #want .. ' keys (' .. table.concat(names, ', ') .. '), got ' .. #KEYS)
  end
  for i = 1, #want do
    if KEYS[i] ~= want[i] then
      fail('INVALID', 'KEYS[' .. i .. '] is ' .. tostring(KEYS[i]) .. ', not ' .. want[i])
    end
  end
  return sh
end

-- Fails with INVALID unless KEYS[from..] are, for each group name of names (ARGV
-- values), exactly the `per` keys of that group on the shard of KEYS[1] in
-- GROUP_ROLE_TYPES order (per = 11: all of them; per = 2: the group hash and its
-- redo set), and nothing else (but `extra` keys after them, which the caller checks).
local function require_group_keys(from, per, names, extra)
  local base = stream_shape().base
  if #KEYS ~= from - 1 + per * #names + (extra or 0) then
    fail('INVALID', 'group keys do not match the group names: ' .. fmt(#KEYS - from + 1) .. ' keys for '
      .. fmt(#names) .. ' groups')
  end
  for g, name in ipairs(names) do
    if name == '' or s_find(name, '[:{}]') then fail('INVALID', 'bad group name ' .. name) end
    local gkey = base .. 'g:' .. name
    local at = from + per * (g - 1)
    for j = 1, per do
      local role = (per == 2 and j == 2) and 'redo' or GROUP_ROLE_TYPES[j][1]
      local want = j == 1 and gkey or (gkey .. ':' .. role)
      if KEYS[at + j - 1] ~= want then
        fail('INVALID', 'KEYS[' .. (at + j - 1) .. '] is ' .. tostring(KEYS[at + j - 1]) .. ', not ' .. want)
      end
    end
  end
end

-- The capability key of a stream role ('stream.publish' -> PREFIXcap:{TAG}:publish),
-- made once per parsed stream sh.
local function stream_cap(sh, role)
  local cap = sh.caps[role]
  if not cap then
    cap = sh.prefix .. 'cap:{' .. sh.tag .. '}:' .. s_sub(role, 8)
    sh.caps[role] = cap
  end
  return cap
end

-- Fails with NOPERM unless the user holds role ('stream.publish' or 'stream.admin'), or
-- else role2 when given, on the stream of KEYS[1]. With names (a SHARD_KEYS_ list), the
-- keys must be exactly those (require_shard_keys, also without ACL; with more, the
-- script checks the keys after them itself); else every key must
-- carry KEYS[1]'s shard tag (each script also checks its exact keys).
local function require_stream_role(role, role2, names, more)
  if names then require_shard_keys(names, more) end
  if not redis.acl_check_cmd then return end
  local sh = stream_shape()
  if not names then
    local base, k1 = sh.base, KEYS[1]
    for i = 2, #KEYS do
      -- a plain find at 1: no substring is made per key
      if s_find(KEYS[i], base, 1, true) ~= 1 then
        fail('INVALID', 'key ' .. KEYS[i] .. ' does not belong to the shard of ' .. k1)
      end
    end
  end
  local cap = stream_cap(sh, role)
  if redis.acl_check_cmd('EXISTS', cap) then return end
  local roles, missing = role, cap
  if role2 then
    local cap2 = stream_cap(sh, role2)
    if redis.acl_check_cmd('EXISTS', cap2) then return end
    roles, missing = role .. ' or ' .. role2, cap .. ' or ' .. cap2
  end
  fail('NOPERM', 'this Redis user lacks the ' .. roles .. ' role on stream '
    .. stream_of(sh.tag) .. ' (no ACL access to ' .. missing .. ')')
end
