-- shard_groups: the key list of the scripts that act on a shard and each of its groups
-- (stream_trim, stream_delete): KEYS[1..4] the shard's meta, log, groups and conf, then
-- `per` keys per group named in ARGV[2..] (ARGV[1]: how many).

--- @include "acl"

-- Checks the group count ARGV[1], that the keys are exactly the shard's and, per group
-- name, its first `per` keys (require_group_keys), then optionally the shard keys
-- `extras` names (due, sched, schedules: a prefix of that list, in its order), and the
-- shard keys' types; returns the group count and {role = key} of the extras passed. The
-- caller checks the group keys' types.
local SHARD_EXTRA_TYPES = {due = 'zset', sched = 'zset', schedules = 'hash'}

local function shard_groups(per, extras)
  local count = int_arg(ARGV[1], 'group count', 0, 100000)
  if #ARGV ~= count + 1 then fail('INVALID', 'group names do not match the count') end
  local base = require_shard_keys(SHARD_KEYS_INFO, true).base
  -- the optional shard keys after the group keys, in the order `extras` names them
  local from, passed = 5 + per * count, {}
  local n = #KEYS - from + 1
  if extras and n >= 1 and n <= #extras then
    for i = 1, n do
      if KEYS[from + i - 1] ~= base .. extras[i] then n = 0 break end
    end
    if n > 0 then
      for i = 1, n do passed[extras[i]] = KEYS[from + i - 1] end
    end
  else
    n = 0
  end
  require_group_keys(5, per, {unpack(ARGV, 2)}, n)
  expect_type(KEYS[1], 'hash')
  expect_type(KEYS[2], 'stream')
  expect_type(KEYS[3], 'set')
  expect_type(KEYS[4], 'hash')
  for role, key in pairs(passed) do expect_type(key, SHARD_EXTRA_TYPES[role]) end
  return count, passed
end
