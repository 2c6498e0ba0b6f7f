-- acl: role checks against Redis ACL, atomic with the operation they guard.
-- A role is granted by giving the user access (ACL key pattern, with +evalsha) to a
-- capability key: PREFIXcap:{tenant/namespace/stream/shard}:g:GROUP:consume|manage for
-- group roles, PREFIXcap:{...}:publish|admin for stream roles (docs/security.md). The
-- capability key is derived from the shard's hash tag in KEYS[1]; it is never passed,
-- read or written (it holds no data): redis.acl_check_cmd only evaluates whether the
-- calling user could run EVALSHA on it. Every key passed must carry that same tag, and a
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

-- Every key must carry KEYS[1]'s shard tag; returns PREFIX and TAG.
local function acl_base()
  local prefix, tag, base = shard_base()
  for i = 2, #KEYS do
    -- a plain find at 1: no substring is made per key
    if s_find(KEYS[i], base, 1, true) ~= 1 then
      fail('INVALID', 'key ' .. KEYS[i] .. ' does not belong to the shard of ' .. KEYS[1])
    end
  end
  return prefix, tag
end

local function stream_of(tag)
  return (string.gsub(tag, '/[^/]*$', ''))
end

-- Fails with NOPERM unless the user holds role ('group.consume' or 'group.manage') on
-- the group whose hash is KEYS[3]. The keys must be exactly that group's keys on one
-- shard (GROUP_ROLE_TYPES order), so that the role of one group cannot be used on the
-- keys of another group of the same stream; any key after them is the shard's groups set.
local function require_group_role(role)
  local prefix, tag, base = shard_base()
  local k3 = KEYS[3] or ''
  local group = s_sub(k3, #base + 3)
  if KEYS[1] ~= base .. 'meta' or KEYS[2] ~= base .. 'log' or s_sub(k3, 1, #base + 2) ~= base .. 'g:'
      or group == '' or s_find(group, ':', 1, true) then
    fail('INVALID', 'KEYS[1], KEYS[2] and KEYS[3] are not the meta, log and group keys of one shard')
  end
  local n = #GROUP_ROLE_TYPES
  for i = 2, n do
    local want = k3 .. ':' .. GROUP_ROLE_TYPES[i][1]
    if KEYS[i + 2] ~= want then
      fail('INVALID', 'KEYS[' .. (i + 2) .. '] is ' .. tostring(KEYS[i + 2]) .. ', not ' .. want)
    end
  end
  for i = n + 3, #KEYS do
    if KEYS[i] ~= base .. 'groups' then
      fail('INVALID', 'KEYS[' .. i .. '] is ' .. KEYS[i] .. ', not ' .. base .. 'groups')
    end
  end
  if not redis.acl_check_cmd then return end
  local cap = prefix .. 'cap:{' .. tag .. '}:g:' .. group .. ':' .. s_sub(role, 7)
  if not redis.acl_check_cmd('EVALSHA', '0', '1', cap) then
    fail('NOPERM', 'this Redis user lacks the ' .. role .. ' role on group ' .. group .. ' of stream '
      .. stream_of(tag) .. ' (no ACL access to ' .. cap .. ')')
  end
end

-- Fails with NOPERM unless the user holds one of roles ('stream.publish',
-- 'stream.admin') on the stream of KEYS[1].
local function require_stream_role(...)
  if not redis.acl_check_cmd then return end
  local prefix, tag = acl_base()
  local roles, caps = {...}, {}
  for i, role in ipairs(roles) do
    caps[i] = prefix .. 'cap:{' .. tag .. '}:' .. s_sub(role, 8)
    if redis.acl_check_cmd('EVALSHA', '0', '1', caps[i]) then return end
  end
  fail('NOPERM', 'this Redis user lacks the ' .. table.concat(roles, ' or ') .. ' role on stream '
    .. stream_of(tag) .. ' (no ACL access to ' .. table.concat(caps, ' or ') .. ')')
end
