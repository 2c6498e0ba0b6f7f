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
  local base = string.match(KEYS[1] or '', '^([^{}]-:{[^{}]*})')
  if not base then fail('INVALID', 'key ' .. tostring(KEYS[1]) .. ' is not a felix-redis shard key') end
  local n = #base + 1
  for i = 2, #KEYS do
    if string.sub(KEYS[i], 1, n) ~= base .. ':' then
      fail('INVALID', 'key ' .. KEYS[i] .. ' does not belong to the shard of ' .. KEYS[1])
    end
  end
  local open = string.find(base, ':{', 1, true)
  return string.sub(base, 1, open - 1), string.sub(base, open + 2, #base - 1)
end

local function acl_require(role, cap, what)
  if not redis.acl_check_cmd then return end
  if not redis.acl_check_cmd('EVALSHA', '0', '1', cap) then
    fail('NOPERM', 'this Redis user lacks the ' .. role .. ' role on ' .. what
      .. ' (no ACL access to ' .. cap .. ')')
  end
end

local function stream_of(tag)
  return (string.gsub(tag, '/[^/]*$', ''))
end

-- Fails with NOPERM unless the user holds role ('group.consume' or 'group.manage') on
-- the group whose hash is KEYS[3].
local function require_group_role(role)
  local prefix, tag = acl_base()
  local group = string.sub(KEYS[3] or '', #prefix + #tag + 7)
  if string.sub(KEYS[3] or '', 1, #prefix + #tag + 6) ~= prefix .. ':{' .. tag .. '}:g:' or group == ''
      or string.find(group, ':', 1, true) then
    fail('INVALID', 'KEYS[3] is not a group key')
  end
  local cap = prefix .. 'cap:{' .. tag .. '}:g:' .. group .. ':' .. string.sub(role, 7)
  acl_require(role, cap, 'group ' .. group .. ' of stream ' .. stream_of(tag))
end

-- Fails with NOPERM unless the user holds one of roles ('stream.publish',
-- 'stream.admin') on the stream of KEYS[1].
local function require_stream_role(...)
  if not redis.acl_check_cmd then return end
  local prefix, tag = acl_base()
  local roles, caps = {...}, {}
  for i, role in ipairs(roles) do
    caps[i] = prefix .. 'cap:{' .. tag .. '}:' .. string.sub(role, 8)
    if redis.acl_check_cmd('EVALSHA', '0', '1', caps[i]) then return end
  end
  fail('NOPERM', 'this Redis user lacks the ' .. table.concat(roles, ' or ') .. ' role on stream '
    .. stream_of(tag) .. ' (no ACL access to ' .. table.concat(caps, ' or ') .. ')')
end
