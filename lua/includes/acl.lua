-- acl: role checks against Redis ACL, atomic with the operation they guard.
-- A role is granted by giving the user access (ACL key pattern, with +evalsha) to a
-- capability key: PREFIXcap:{tenant/namespace/stream/shard}:g:GROUP:consume|manage for
-- group roles, PREFIXcap:{...}:publish|admin for stream roles (docs/security.md). The
-- capability key is derived from the shard's hash tag in KEYS[1]; it is never passed,
-- read or written (it holds no data): redis.acl_check_cmd only evaluates whether the
-- calling user could run EVALSHA on it. Every key passed must carry that same tag, so a
-- capability of one stream or group cannot be used on the keys of another.
-- Backends without ACL (fakeredis, memory://) have no redis.acl_check_cmd: no check.

local function acl_base()
  local k1 = KEYS[1] or ''
  -- PREFIX:{TAG}...: no braces in PREFIX nor in TAG
  local open = s_find(k1, '[{}]')
  local close = open and s_find(k1, '[{}]', open + 1)
  if not close or open < 2 or s_byte(k1, open - 1) ~= 58 or s_byte(k1, open) ~= 123
      or s_byte(k1, close) ~= 125 then
    fail('INVALID', 'key ' .. tostring(KEYS[1]) .. ' is not a felix-redis shard key')
  end
  local base = s_sub(k1, 1, close) .. ':'
  for i = 2, #KEYS do
    -- a plain find at 1: no substring is made per key
    if s_find(KEYS[i], base, 1, true) ~= 1 then
      fail('INVALID', 'key ' .. KEYS[i] .. ' does not belong to the shard of ' .. KEYS[1])
    end
  end
  return s_sub(k1, 1, open - 2), s_sub(k1, open + 1, close - 1)
end

local function stream_of(tag)
  return (string.gsub(tag, '/[^/]*$', ''))
end

-- Fails with NOPERM unless the user holds role ('group.consume' or 'group.manage') on
-- the group whose hash is KEYS[3].
local function require_group_role(role)
  local prefix, tag = acl_base()
  local k3 = KEYS[3] or ''
  local at = #prefix + #tag + 5 -- just after 'PREFIX:{TAG}:', which acl_base checked
  local group = s_sub(k3, at + 2)
  if s_sub(k3, at, at + 1) ~= 'g:' or group == '' or s_find(group, ':', 1, true) then
    fail('INVALID', 'KEYS[3] is not a group key')
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
