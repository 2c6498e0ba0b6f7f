-- shard_groups: the key list of the scripts that act on a shard and each of its groups
-- (stream_trim, stream_delete): KEYS[1..4] the shard's meta, log, groups and conf, then
-- `per` keys per group named in ARGV[2..] (ARGV[1]: how many).

--- @include "acl"

-- Checks the group count ARGV[1], that the keys are exactly the shard's and, per group
-- name, its first `per` keys (require_group_keys), then (with due_ok, optional) the
-- shard's due index, and the shard keys' types; returns the group count and the due
-- index key (false: not passed). The caller checks the group keys' types.
local function shard_groups(per, due_ok)
  local count = int_arg(ARGV[1], 'group count', 0, 100000)
  if #ARGV ~= count + 1 then fail('INVALID', 'group names do not match the count') end
  local base = require_shard_keys(SHARD_KEYS_INFO, true).base
  local due = false
  if due_ok and #KEYS == 5 + per * count and KEYS[#KEYS] == base .. 'due' then due = KEYS[#KEYS] end
  require_group_keys(5, per, {unpack(ARGV, 2)}, due and 1 or 0)
  expect_type(KEYS[1], 'hash')
  expect_type(KEYS[2], 'stream')
  expect_type(KEYS[3], 'set')
  expect_type(KEYS[4], 'hash')
  if due then expect_type(due, 'zset') end
  return count, due
end
