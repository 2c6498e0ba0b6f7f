-- roles: the Redis type of each key of a group on one shard, in the order of
-- felix_redis.keys.GROUP_ROLES (which scripts receive them in).

local GROUP_ROLE_TYPES = {
  {'group', 'hash'}, {'lease', 'zset'}, {'owed', 'zset'}, {'attempts', 'hash'}, {'done', 'zset'},
  {'redo', 'zset'}, {'dead', 'hash'}, {'owner', 'hash'}, {'byowner', 'zset'}, {'wake', 'stream'},
  {'held', 'zset'},
}

-- expect_type for the key of group role `role`, except that the done key may still be
-- the set of single offsets an earlier version kept (the next script that writes to
-- the group turns it into runs; deleting it needs no conversion).
local function expect_role_type(key, role, want)
  if role == 'done' and redis.call('TYPE', key)['ok'] == 'set' then return end
  expect_type(key, want)
end
